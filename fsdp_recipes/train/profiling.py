"""``--profile_steps 5-8``: a torch.profiler trace of those optimizer steps on every rank, and how much of
their time went to FSDP's communication.

Each rank writes ``output_dir/profile/rank<R>.trace.json`` (Chrome trace format: open it in Perfetto,
https://ui.perfetto.dev, or chrome://tracing) and, on CUDA, ``rank<R>.memory.pickle`` for PyTorch's memory
viewer (https://pytorch.org/memory_viz). Rank 0 prints one line and writes ``profile/summary.json``: the share
of the profiled steps' wall time spent in all-gather, reduce-scatter and all-reduce, and the share of that
communication that ran while compute ran too (overlapped); on CUDA also ``cuda_memory_at_peak``, the allocations
live at the profiled steps' highest point grouped by the code that made them (read from the live snapshot, so no
pickle is read back). On GPUs both come from the device timeline (NCCL
kernels against the other kernels); on CPU from the host (gloo's collectives, run on its worker threads, against
the aten operators of the training thread). gloo has no reduce-scatter of its own: on CPU FSDP's reduce-scatter
runs as an all-reduce and is counted there.
"""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path

import torch
from transformers import TrainerCallback

from fsdp_recipes.compat import internals

logger = logging.getLogger("train_fsdp")
PROFILE_DIR = "profile"
# allocator events the CUDA memory history keeps (the newest)
MEMORY_EVENTS = 100_000
# the share reported for each, by the names torch's process groups and NCCL give their work
COLLECTIVES = {
    "all_gather": ("all_gather", "allgather", "_allgather_base"),
    "reduce_scatter": ("reduce_scatter", "reducescatter", "_reduce_scatter_base"),
    "all_reduce": ("all_reduce", "allreduce"),
}


def collective_kind(name: str, on_device: bool) -> str | None:
    """The collective an event executes: NCCL kernels on the device; on the host, gloo's own events (its worker
    threads run them; the c10d::* calls on the main thread only enqueue them)."""
    lowered = name.lower()
    if not ("nccl" in lowered if on_device else lowered.startswith("gloo:")):
        return None
    return next((kind for kind, tags in COLLECTIVES.items() if any(t in lowered for t in tags)), None)


def _union(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    merged: list[list[float]] = []
    for start, end in sorted(intervals):
        if merged and start <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([start, end])
    return [(s, e) for s, e in merged]


def _length(intervals) -> float:
    return sum(e - s for s, e in intervals)


def _intersection(a, b) -> float:
    total, j = 0.0, 0
    for start, end in a:
        while j < len(b) and b[j][1] <= start:
            j += 1
        k = j
        while k < len(b) and b[k][0] < end:
            total += max(0.0, min(end, b[k][1]) - max(start, b[k][0]))
            k += 1
    return total


def summarize(events, wall_us: float, on_device: bool) -> dict:
    """Shares of wall time per collective kind, and the overlapped share of all communication.

    ``events``: the profiler's FunctionEvents; on GPUs the device kernels count, on CPU the host operators.
    """
    comm: dict[str, list] = {kind: [] for kind in COLLECTIVES}
    compute = []
    for event in events:
        device = str(getattr(event, "device_type", "")).endswith(("CUDA", "PrivateUse1"))
        if device != on_device:
            continue
        start, end = event.time_range.start, event.time_range.end
        if (kind := collective_kind(event.name, on_device)) is not None:
            comm[kind].append((start, end))
        elif on_device or (event.name.startswith("aten::") and not event.name.startswith("aten::_foreach")):
            compute.append((start, end))
    comm_union = _union([i for spans in comm.values() for i in spans])
    compute_union = _union(compute)
    communicated = _length(comm_union)
    summary = {f"{kind}_share": round(_length(_union(spans)) / wall_us, 4) for kind, spans in comm.items()}
    summary["communication_share"] = round(communicated / wall_us, 4)
    summary["overlapped_share"] = (
        round(_intersection(comm_union, compute_union) / communicated, 4) if communicated else None
    )
    summary["timeline"] = "device (NCCL kernels)" if on_device else "host (gloo)"
    return summary


def _where(frame: dict) -> str:
    name = frame.get("filename", "")
    for root in ("site-packages/", "dist-packages/"):
        if root in name:
            name = name.split(root, 1)[1]
            break
    return f"{name}:{frame.get('line')} {frame.get('name')}"


BEFORE = "(allocated before the profiled steps)"


def _sites(frames: list[dict]) -> tuple[str, str]:
    """(the innermost Python frame, the innermost Python frame outside torch): what allocated, and for whom. Without
    a Python frame (the backward pass runs on autograd's own thread), the autograd node whose backward allocated."""
    python = [f for f in frames if str(f.get("filename", "")).endswith(".py")]
    if not python:
        node = next((part for f in frames for part in str(f.get("name", "")).split("::") if "Backward" in part), None)
        return (f"autograd {node}" if node else "(no Python frame)"), "-"
    outside = next(
        (f for f in python if "/torch/" not in f["filename"] and not f["filename"].startswith("torch/")), None
    )
    return _where(python[0]), _where(outside) if outside else "-"


def live_at_peak(trace: list[dict], segments: list[dict] = (), top: int = 12, max_entries: int | None = None) -> dict:
    """The allocations live when allocated bytes were highest over the recorded trace, grouped by where they were made.

    ``trace``: one device's ``device_traces`` from ``torch.cuda.memory._snapshot()``, in order; ``segments``: its
    ``segments`` (blocks still allocated when the snapshot was taken). A block's bytes count from its ``alloc`` to its
    ``free_requested``, as torch.cuda.memory_allocated (and max_memory_allocated, the peak the estimate is compared
    with) counts them; PyTorch's memory viewer keeps a block until ``free_completed``, when a stream that used it is
    done too. Blocks allocated before the recording began count as live from its start: those the trace frees before
    allocating that address, and those still allocated at the end that the trace never allocated. A trace of
    ``max_entries`` events may have lost its oldest ones (the recorder keeps the newest): ``truncated`` says so.
    """
    allocated_in_trace = {e["addr"] for e in trace if e["action"] == "alloc"}
    before: dict[int, int] = {}
    seen: set[int] = set()
    for event in trace:
        if event["action"] == "alloc":
            seen.add(event["addr"])
        elif event["action"] == "free_requested" and event["addr"] not in seen and event["addr"] not in before:
            before[event["addr"]] = event["size"]
    for segment in segments:
        for block in segment.get("blocks", []):
            if block.get("state") == "active_allocated" and block["address"] not in allocated_in_trace:
                before.setdefault(block["address"], block["size"])
    sizes = dict(before)
    total = peak = sum(before.values())
    peak_at = -1
    for i, event in enumerate(trace):
        if event["action"] == "alloc":
            sizes[event["addr"]] = event["size"]
            total += event["size"]
            if total > peak:
                peak, peak_at = total, i
        elif event["action"] == "free_requested" and event["addr"] in sizes:
            total -= sizes.pop(event["addr"])
    live: dict[int, tuple[int, tuple[str, str]]] = {addr: (size, (BEFORE, "-")) for addr, size in before.items()}
    for event in trace[: peak_at + 1]:
        if event["action"] == "alloc":
            live[event["addr"]] = (event["size"], _sites(event.get("frames") or []))
        elif event["action"] == "free_requested":
            live.pop(event["addr"], None)
    groups: dict[tuple[str, str], list[int]] = {}
    for size, where in live.values():
        group = groups.setdefault(where, [0, 0])
        group[0] += size
        group[1] += 1
    ranked = sorted(groups.items(), key=lambda kv: -kv[1][0])
    return {
        "peak_bytes": peak,
        "before_recording_bytes": sum(before.values()),
        "events": len(trace),
        "truncated": max_entries is not None and len(trace) >= max_entries,
        "groups": [
            {"bytes": b, "blocks": n, "allocated_in": site, "for": caller} for (site, caller), (b, n) in ranked[:top]
        ],
        "other_bytes": sum(b for _, (b, _) in ranked[top:]),
    }


class StepProfiler(TrainerCallback):
    """Profiles optimizer steps ``first``..``last`` (counted from 1) on every rank."""

    def __init__(self, first: int, last: int, output_dir: str, rank: int):
        self.first, self.last, self.rank = first, last, rank
        self.folder = Path(output_dir) / PROFILE_DIR
        self.profiler = None
        self.cuda = torch.cuda.is_available()
        self.summary: dict | None = None

    def on_step_begin(self, args, state, control, **kwargs):
        if self.profiler is None and self.summary is None and state.global_step + 1 == self.first:
            activities = [torch.profiler.ProfilerActivity.CPU] + (
                [torch.profiler.ProfilerActivity.CUDA] if self.cuda else []
            )
            self.profiler = torch.profiler.profile(activities=activities)
            if self.cuda:
                internals.get("torch.cuda.memory._record_memory_history")(max_entries=MEMORY_EVENTS)
            self.profiler.__enter__()
            self.started = time.perf_counter()

    def on_step_end(self, args, state, control, **kwargs):
        if self.profiler is None or state.global_step < self.last:
            return
        if self.cuda:
            torch.cuda.synchronize()
        wall_us = (time.perf_counter() - self.started) * 1e6
        self.profiler.__exit__(None, None, None)
        self.folder.mkdir(parents=True, exist_ok=True)
        self.profiler.export_chrome_trace(str(self.folder / f"rank{self.rank}.trace.json"))
        at_peak = None
        if self.cuda:
            import pickle

            # what torch's _dump_snapshot pickles, taken once
            snapshot = internals.get("torch.cuda.memory._snapshot")()
            with open(self.folder / f"rank{self.rank}.memory.pickle", "wb") as f:
                # for PyTorch's memory viewer; nothing here reads it back
                pickle.dump(snapshot, f)
            device = torch.cuda.current_device()
            at_peak = live_at_peak(
                snapshot["device_traces"][device],
                [g for g in snapshot["segments"] if g.get("device", device) == device],
                max_entries=MEMORY_EVENTS,
            )
            internals.get("torch.cuda.memory._record_memory_history")(enabled=None)
        self.summary = {
            "steps": [self.first, self.last],
            "wall_seconds": round(wall_us / 1e6, 4),
            **summarize(self.profiler.events(), wall_us, on_device=self.cuda),
        }
        if at_peak is not None:
            self.summary["cuda_memory_at_peak"] = at_peak
        self.profiler = None
        if self.rank == 0:
            (self.folder / "summary.json").write_text(json.dumps(self.summary, indent=2) + "\n")
            s = self.summary
            logger.info(
                f"profile of steps {self.first}-{self.last} (rank 0, {s['timeline']}): all-gather "
                f"{s['all_gather_share']:.1%}, "
                f"reduce-scatter {s['reduce_scatter_share']:.1%}, all-reduce {s['all_reduce_share']:.1%} of "
                f"{s['wall_seconds']:.2f} s; {s['overlapped_share'] or 0:.0%} of communication overlapped compute; "
                f"traces in {self.folder}"
            )
