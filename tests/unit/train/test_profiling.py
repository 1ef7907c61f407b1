"""fsdp_recipes.train.profiling: the step range and the arithmetic of communication shares and overlap."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from fsdp_recipes.config.values import parse_steps
from fsdp_recipes.train.profiling import live_at_peak, summarize


def event(name, start, end, device="CPU"):
    return SimpleNamespace(
        name=name, time_range=SimpleNamespace(start=start, end=end), device_type=f"DeviceType.{device}"
    )


def test_shares_and_overlap_on_the_host():
    """Wall 100 us. gloo all-gather 10-30 and 20-40 (union 30 us), all-reduce 60-70 (10 us); matmuls 0-25 and
    65-100. Communication 40 us, of which 15 (10-25) + 5 (65-70) ran beside compute: overlapped 20/40. The
    main thread's c10d enqueue call is not communication time; an optimizer foreach op is not compute."""
    events = [
        event("gloo:all_gather", 10, 30),
        event("gloo:all_gather", 20, 40),
        event("gloo:all_reduce", 60, 70),
        event("c10d::_allgather_base_", 0, 90),
        event("aten::mm", 0, 25),
        event("aten::addmm", 65, 100),
        event("aten::_foreach_add_", 30, 60),
    ]
    summary = summarize(events, wall_us=100, on_device=False)
    assert (
        summary["all_gather_share"] == 0.3
        and summary["all_reduce_share"] == 0.1
        and summary["reduce_scatter_share"] == 0
    )
    assert summary["communication_share"] == 0.4 and summary["overlapped_share"] == 0.5


def test_on_gpus_the_device_kernels_count():
    events = [
        event("ncclDevKernel_ReduceScatter_Sum_f32_RING_LL", 0, 50, "CUDA"),
        event("ampere_sgemm_128x64_tn", 25, 100, "CUDA"),
        event("gloo:all_reduce", 0, 100),
        # host events: not the GPU's timeline
        event("aten::mm", 0, 100),
    ]
    summary = summarize(events, wall_us=200, on_device=True)
    assert (
        summary["reduce_scatter_share"] == 0.25
        and summary["all_reduce_share"] == 0
        and summary["overlapped_share"] == 0.5
    )


@pytest.mark.parametrize("text, steps", [("5-8", (5, 8)), ("3", (3, 3))])
def test_step_ranges(text, steps):
    assert parse_steps(text) == steps


@pytest.mark.parametrize("text", ["0-3", "8-5", "a-b"])
def test_bad_step_ranges(text):
    with pytest.raises(ValueError):
        parse_steps(text)


def _frame(path, line, name):
    return {"filename": path, "line": line, "name": name}


FSDP = _frame(
    "/venv/lib/python3.12/site-packages/torch/distributed/fsdp/_fully_shard/_fsdp_collectives.py", 612, "foreach_reduce"
)
LLAMA = _frame("/venv/lib/python3.12/site-packages/transformers/models/llama/modeling_llama.py", 301, "forward")
LINEAR = _frame("/venv/lib/python3.12/site-packages/torch/nn/modules/linear.py", 134, "forward")
CXX = _frame("??", 0, "c10::cuda::CUDACachingAllocator::malloc")


def test_live_at_peak_names_what_was_live_at_the_highest_point():
    """The trace as torch.cuda.memory._snapshot gives it: the peak is B + C (250 bytes), A was freed before it and D
    came after; a free_completed changes nothing."""
    trace = [
        {"action": "alloc", "addr": 1, "size": 100, "frames": [CXX, LINEAR, LLAMA]},
        {"action": "alloc", "addr": 2, "size": 50, "frames": [CXX, FSDP]},
        {"action": "free_requested", "addr": 1, "size": 100, "frames": []},
        {"action": "free_completed", "addr": 1, "size": 100, "frames": []},
        {"action": "alloc", "addr": 3, "size": 120, "frames": [LINEAR, LLAMA]},
        {"action": "alloc", "addr": 4, "size": 80, "frames": [CXX, LINEAR, LLAMA]},
        {"action": "free_requested", "addr": 3, "size": 120, "frames": []},
        {"action": "alloc", "addr": 5, "size": 30, "frames": [FSDP]},
    ]
    got = live_at_peak(trace)
    assert got["peak_bytes"] == 250 and got["events"] == len(trace) and got["other_bytes"] == 0
    assert got["groups"] == [
        {
            "bytes": 200,
            "blocks": 2,
            "allocated_in": "torch/nn/modules/linear.py:134 forward",
            "for": "transformers/models/llama/modeling_llama.py:301 forward",
        },
        {
            "bytes": 50,
            "blocks": 1,
            "allocated_in": "torch/distributed/fsdp/_fully_shard/_fsdp_collectives.py:612 foreach_reduce",
            "for": "-",
        },
    ]
    assert live_at_peak(trace, top=1)["other_bytes"] == 50
    assert live_at_peak([]) == {
        "peak_bytes": 0,
        "before_recording_bytes": 0,
        "events": 0,
        "truncated": False,
        "groups": [],
        "other_bytes": 0,
    }


GIB = 2**30


def test_blocks_allocated_before_the_recording_count_from_its_start():
    """A 4 GiB block allocated before the recording, freed in it, is counted: the true peak is 5 GiB (it and the first
    1 GiB) at the first event, not the 2 GiB allocated after it.
    A block still allocated at the end (the snapshot's segments) that the trace never allocated was there all along."""
    trace = [
        {"action": "alloc", "addr": 1, "size": GIB, "frames": [LINEAR, LLAMA]},
        {"action": "free_requested", "addr": 7, "size": 4 * GIB, "frames": []},
        {"action": "alloc", "addr": 2, "size": 2 * GIB, "frames": [FSDP]},
    ]
    got = live_at_peak(trace)
    assert got["peak_bytes"] == 5 * GIB and got["before_recording_bytes"] == 4 * GIB
    assert [(g["allocated_in"], g["bytes"]) for g in got["groups"]] == [
        ("(allocated before the profiled steps)", 4 * GIB),
        ("torch/nn/modules/linear.py:134 forward", GIB),
    ]
    segments = [
        {
            "blocks": [
                # held throughout
                {"address": 8, "size": 3 * GIB, "state": "active_allocated"},
                # the trace's own
                {"address": 2, "size": 2 * GIB, "state": "active_allocated"},
                {"address": 9, "size": GIB, "state": "inactive"},
            ]
        }
    ]
    got = live_at_peak(trace, segments)
    assert got["peak_bytes"] == 8 * GIB and got["before_recording_bytes"] == 7 * GIB
    assert got["groups"][0] == {
        "bytes": 7 * GIB,
        "blocks": 2,
        "allocated_in": "(allocated before the profiled steps)",
        "for": "-",
    }


def test_a_full_trace_is_said_to_be_truncated_and_backward_allocations_name_their_autograd_node():
    backward = [_frame("??", 0, "torch::autograd::generated::MmBackward0::apply"), CXX]
    trace = [{"action": "alloc", "addr": i, "size": 10, "frames": backward} for i in range(5)]
    assert live_at_peak(trace, max_entries=5)["truncated"] and not live_at_peak(trace, max_entries=6)["truncated"]
    assert live_at_peak(trace)["groups"] == [
        {"bytes": 50, "blocks": 5, "allocated_in": "autograd MmBackward0", "for": "-"}
    ]
    assert (
        live_at_peak([{"action": "alloc", "addr": 1, "size": 1, "frames": [CXX]}])["groups"][0]["allocated_in"]
        == "(no Python frame)"
    )


def test_live_at_peak_takes_the_first_of_equal_peaks_and_reads_generated_traces():
    import random

    rng = random.Random(7)
    for _ in range(50):
        trace, live, total, best, best_live = [], {}, 0, 0, {}
        for addr in range(200):
            if live and rng.random() < 0.45:
                gone = rng.choice(sorted(live))
                total -= live.pop(gone)
                trace.append({"action": "free_requested", "addr": gone, "size": 0, "frames": []})
            size = rng.randrange(1, 1000)
            live[addr] = size
            total += size
            trace.append({"action": "alloc", "addr": addr, "size": size, "frames": [FSDP if addr % 2 else LLAMA]})
            if total > best:
                best, best_live = total, dict(live)
        got = live_at_peak(trace)
        assert got["peak_bytes"] == best == sum(best_live.values())
        assert sum(g["bytes"] for g in got["groups"]) == best
        assert sum(g["blocks"] for g in got["groups"]) == len(best_live)
