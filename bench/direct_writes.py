"""What writing a DCP shard past the page cache saves: one process, torch's own ``dcp.save`` of a state dict of
random fp32 tensors, through the page cache (DCP's FileSystemWriter as accelerate makes it) and with its shard files
written by fsdp_recipes.direct_writes.DirectFile (fsdp_recipes.compat.async_dcp.checkpoint_saves), which also leaves
out the zip CRC-32 of each record; a third kind, "direct, CRC kept", is the same with the CRC computed, to show what
each change saves. Alternated ``--repeats`` times. Reported: wall seconds and CPU seconds of the process (every
thread) per save, the medians' ratios, and whether every kind loads (dcp.load) the very tensors saved.

    PYTHONPATH=. python bench/direct_writes.py                 # 1.6 GB, 3 repeats: about a minute
    PYTHONPATH=. python bench/direct_writes.py --gigabytes 4 --folder /mnt/scratch

CPU seconds are what a background checkpoint takes from training; wall seconds what a foreground one stalls it.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from fsdp_recipes.console import HelpFormatter  # noqa: E402
from fsdp_recipes.removal import make_folder, remove  # noqa: E402

WORK = "direct writes benchmark"


def save(state, folder: Path, kind: str) -> tuple[float, float, dict]:
    from unittest import mock

    import torch
    import torch.distributed.checkpoint as dcp

    from fsdp_recipes.compat.async_dcp import ShardFiles, checkpoint_saves

    files = ShardFiles()
    # our writer's switch, held
    keep_crc = mock.patch.object(torch.serialization, "set_crc32_options", lambda _: None)
    wall, cpu = time.perf_counter(), time.process_time()
    with (
        checkpoint_saves(files, direct=kind != "page cache"),
        keep_crc if kind == "direct, CRC kept" else contextlib.nullcontext(),
    ):
        dcp.save(state, storage_writer=dcp.FileSystemWriter(str(folder)), no_dist=True)
    return time.perf_counter() - wall, time.process_time() - cpu, files.report()


def loads_the_same(state, folder: Path) -> bool:
    """The files hold the tensors saved, read back by our checkpoint reader (torch's DCP reader, guarded)."""
    import torch

    from fsdp_recipes.ckpt.readers import DCPSource

    loaded = DCPSource(folder).read(sorted(state))
    return all(torch.equal(loaded[k], v) for k, v in state.items())


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=HelpFormatter)
    p.add_argument("--gigabytes", type=float, default=1.6, help="size of the state dict (fp32 tensors of 16 MiB)")
    p.add_argument("--repeats", type=int, default=3, help="saves of each kind, alternated")
    p.add_argument(
        "--folder",
        type=Path,
        help="where to write (default: a temporary folder in /tmp); its filesystem is what is measured",
    )
    p.add_argument("--output", type=Path, help="write the results as JSON here")
    a = p.parse_args(argv)
    import warnings

    import torch

    warnings.filterwarnings("ignore", message="torch.distributed is disabled")
    count = max(1, int(a.gigabytes * 1e9 / (16 << 20)))
    state = {f"w{i}": torch.randn(4096, 1024) for i in range(count)}
    nbytes = count * (16 << 20)
    parent = make_folder(Path(tempfile.mkdtemp(prefix="direct_writes-", dir=a.folder)), WORK, exist_ok=True)
    times = {"page cache": [], "direct, CRC kept": [], "direct": []}
    folders = {kind: kind.replace(" ", "_").replace(",", "") for kind in times}
    try:
        for i in range(a.repeats):
            for kind in times:
                folder = parent / f"{folders[kind]}-{i}"
                wall, cpu, files = save(state, folder, kind)
                times[kind].append((wall, cpu))
                print(
                    f"  {kind:16s} {i}: {wall:6.2f} s wall, {cpu:6.2f} s CPU {files if kind != 'page cache' else ''}",
                    flush=True,
                )
        same = all(loads_the_same(state, parent / f"{folders[kind]}-0") for kind in times)
    finally:
        remove(parent, WORK)
    med = {k: (statistics.median(w for w, _ in v), statistics.median(c for _, c in v)) for k, v in times.items()}
    result = {
        "bytes": nbytes,
        "repeats": a.repeats,
        "median_wall_seconds": {k: round(v[0], 3) for k, v in med.items()},
        "median_cpu_seconds": {k: round(v[1], 3) for k, v in med.items()},
        "direct_vs_page_cache": {
            "wall": round(med["direct"][0] / med["page cache"][0], 3),
            "cpu": round(med["direct"][1] / med["page cache"][1], 3),
        },
        "direct_crc_kept_vs_page_cache": {
            "wall": round(med["direct, CRC kept"][0] / med["page cache"][0], 3),
            "cpu": round(med["direct, CRC kept"][1] / med["page cache"][1], 3),
        },
        "same_tensors_loaded": same,
    }
    print(
        f"{nbytes / 1e9:.2f} GB DCP shard, median of {a.repeats}: page cache {med['page cache'][0]:.2f} s wall "
        f"/ {med['page cache'][1]:.2f} s CPU, "
        f"direct, CRC kept {med['direct, CRC kept'][0]:.2f} s / {med['direct, CRC kept'][1]:.2f} s, "
        f"direct {med['direct'][0]:.2f} s / {med['direct'][1]:.2f} s "
        f"(x{result['direct_vs_page_cache']['wall']:.2f} wall, "
        f"x{result['direct_vs_page_cache']['cpu']:.2f} CPU); every kind loads the tensors saved: {same}"
    )
    if a.output:
        a.output.write_text(json.dumps(result, indent=1) + "\n")
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
