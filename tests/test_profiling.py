"""fsdp_recipes.train.profiling: the step range and the arithmetic of communication shares and overlap."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from fsdp_recipes.config.values import parse_steps
from fsdp_recipes.train.profiling import summarize


def event(name, start, end, device="CPU"):
    return SimpleNamespace(name=name, time_range=SimpleNamespace(start=start, end=end), device_type=f"DeviceType.{device}")


def test_shares_and_overlap_on_the_host():
    """Wall 100 us. gloo all-gather 10-30 and 20-40 (union 30 us), all-reduce 60-70 (10 us); matmuls 0-25 and
    65-100. Communication 40 us, of which 15 (10-25) + 5 (65-70) ran beside compute: overlapped 20/40. The
    main thread's c10d enqueue call is not communication time; an optimizer foreach op is not compute."""
    events = [
        event("gloo:all_gather", 10, 30), event("gloo:all_gather", 20, 40), event("gloo:all_reduce", 60, 70),
        event("c10d::_allgather_base_", 0, 90), event("aten::mm", 0, 25), event("aten::addmm", 65, 100),
        event("aten::_foreach_add_", 30, 60),
    ]
    summary = summarize(events, wall_us=100, on_device=False)
    assert summary["all_gather_share"] == 0.3 and summary["all_reduce_share"] == 0.1 and summary["reduce_scatter_share"] == 0
    assert summary["communication_share"] == 0.4 and summary["overlapped_share"] == 0.5


def test_on_gpus_the_device_kernels_count():
    events = [
        event("ncclDevKernel_ReduceScatter_Sum_f32_RING_LL", 0, 50, "CUDA"), event("ampere_sgemm_128x64_tn", 25, 100, "CUDA"),
        event("gloo:all_reduce", 0, 100), event("aten::mm", 0, 100),  # host events: not the GPU's timeline
    ]
    summary = summarize(events, wall_us=200, on_device=True)
    assert summary["reduce_scatter_share"] == 0.25 and summary["all_reduce_share"] == 0 and summary["overlapped_share"] == 0.5


@pytest.mark.parametrize("text, steps", [("5-8", (5, 8)), ("3", (3, 3))])
def test_step_ranges(text, steps):
    assert parse_steps(text) == steps


@pytest.mark.parametrize("text", ["0-3", "8-5", "a-b"])
def test_bad_step_ranges(text):
    with pytest.raises(ValueError):
        parse_steps(text)
