"""What a checkpoint's writing thread costs the training thread beside it, through the GIL.

    python bench/gil_copies.py [--gigabytes 2] [--folder /tmp]

A thread writes ``--gigabytes`` through fsdp_recipes.direct_writes.DirectFile (as a background save's writer does)
while the main thread runs a Python-driven loop of small torch ops for the same time (as FSDP2's hooks and the
Trainer drive a step). Side by side, each from the same start: the loop alone; beside a DirectFile whose copies into
its aligned buffer hold the GIL (``GIL_FREE_COPY`` set past any write: how it copied before); beside DirectFile as it
is (numpy's copy, which releases it). Prints the loop's iterations per second in each case against the loop alone.
"""

from __future__ import annotations

import argparse
import os
import tempfile
import threading
import time
from pathlib import Path

import torch

from fsdp_recipes import direct_writes
from fsdp_recipes.console import HelpFormatter
from fsdp_recipes.removal import make_folder, remove

BENCH_WORK = "gil copies benchmark"


def loop_rate(stop: threading.Event, seconds: float) -> float:
    """Iterations per second of a loop of small matmuls, each a return to Python, until ``stop`` or ``seconds``."""
    x, n, start = torch.randn(64, 64), 0, time.monotonic()
    while not stop.is_set() and time.monotonic() - start < seconds:
        for _ in range(10):
            x = torch.tanh(x @ x * 0.01)
        n += 1
    return n / (time.monotonic() - start)


def beside_writes(folder: Path, nbytes: int, gil_free_copy: int | None) -> tuple[float, float]:
    """(loop iterations per second, write seconds) while a thread writes ``nbytes`` (None: no thread, 10 s)."""
    if gil_free_copy is None:
        return loop_rate(threading.Event(), 10.0), 0.0
    # 64 MiB, written again and again
    data = torch.randint(0, 255, (64 << 20,), dtype=torch.uint8).numpy().tobytes()
    done, took = threading.Event(), []
    saved = direct_writes.GIL_FREE_COPY
    direct_writes.GIL_FREE_COPY = gil_free_copy

    def write():
        start = time.monotonic()
        work = make_folder(folder / f"gil-copies-{os.getpid()}", BENCH_WORK)
        try:
            with direct_writes.DirectFile(work / "written.bin", sync=True) as f:
                for _ in range(max(1, nbytes // len(data))):
                    f.write(data)
        finally:
            remove(work, BENCH_WORK)
            took.append(time.monotonic() - start)
            done.set()

    thread = threading.Thread(target=write)
    thread.start()
    try:
        rate = loop_rate(done, 600.0)
    finally:
        thread.join()
        direct_writes.GIL_FREE_COPY = saved
    return rate, took[0]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0], formatter_class=HelpFormatter)
    parser.add_argument("--gigabytes", type=float, default=2.0, help="bytes the writing thread writes, in GB")
    parser.add_argument(
        "--folder",
        type=Path,
        default=Path(tempfile.gettempdir()),
        help="where a folder of ours holds the file while it is written (then removed)",
    )
    args = parser.parse_args()
    torch.set_num_threads(1)
    nbytes = int(args.gigabytes * 1e9)
    alone, _ = beside_writes(args.folder, nbytes, None)
    held, held_s = beside_writes(args.folder, nbytes, 1 << 62)
    free, free_s = beside_writes(args.folder, nbytes, direct_writes.GIL_FREE_COPY)
    print(f"| loop beside | iterations/s | vs alone | write s ({args.gigabytes:g} GB) |")
    print("|---|---|---|---|")
    print(f"| nothing | {alone:,.0f} | 1.00x | |")
    print(f"| DirectFile, copies holding the GIL (before) | {held:,.0f} | {held / alone:.2f}x | {held_s:.1f} |")
    print(f"| DirectFile, copies releasing it (now) | {free:,.0f} | {free / alone:.2f}x | {free_s:.1f} |")
    print(f"cpu: {os.cpu_count()} core(s), torch {torch.__version__}")


if __name__ == "__main__":
    main()
