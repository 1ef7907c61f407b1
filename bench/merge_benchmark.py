"""Time tools/merge_checkpoint.py against `accelerate merge-weights` and `cp` on the same checkpoint.

    python bench/merge_benchmark.py --size 1GB --size 6GB [--ranks 2] [--workdir /tmp/merge-bench]
    python bench/merge_benchmark.py --size 1GB --baseline /tmp/old   # the converter of another checkout beside

For each size: builds a multi-rank FSDP2-layout checkpoint (bench/synthetic.py) as train_fsdp.py leaves one
(config, tokenizer, manifest), reads it once to warm the page cache, then runs each command (best of --repeats)
under /usr/bin/time -v and prints wall time, peak RSS and the ratios against merge-weights and cp as a Markdown
table. The converter runs three times: on that checkpoint; on the same shards without the manifest, as other
tools leave them (it then imports transformers to check config against weights); and on the same records as raw
torch DCP writes them (``dcp.save(model.state_dict())``: flat names, no "model." namespace) with nothing but
config.json beside them (no manifest, no tokenizer), and on those records again with the config given by
--base-model (a folder holding only config.json). With --baseline TREE (a checkout, e.g. ``git worktree add TREE
COMMIT``), TREE's converter runs each of these too, interleaved with this one's, so that both meet the same disk
and load. Needs free disk of about 5x the size.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

from synthetic import make_checkpoint

from fsdp_recipes.ckpt.layout import MANIFEST
from fsdp_recipes.compat import internals
from fsdp_recipes.console import HelpFormatter
from fsdp_recipes.removal import make_folder, remove, remove_inside

BENCH_WORK = "merge benchmark"

REPO = Path(__file__).resolve().parent.parent


def timed(cmd: list[str], warm: list[Path], env: dict | None = None) -> tuple[float, float, float]:
    """(wall seconds, wall seconds until the output is on disk, peak RSS in GB) of a command, from /usr/bin/time -v.

    Every command starts alike: no dirty pages left by the previous one (sync) and the checkpoint in the
    page cache (merge-weights' 6 GB of RSS evicts it otherwise, which would slow whoever runs next). The
    second time adds the `sync` that follows: a command that returns while the kernel still holds its output
    in dirty pages has not finished writing, and how much the kernel holds back varies from run to run."""
    subprocess.run(["sync"], check=True)
    subprocess.run(["cat", *map(str, warm)], stdout=subprocess.DEVNULL, check=True)
    start = time.monotonic()
    proc = subprocess.run(["/usr/bin/time", "-v", *cmd], capture_output=True, text=True, env=env)
    if proc.returncode != 0:
        sys.exit(f"failed: {' '.join(cmd)}\n{proc.stderr[-3000:]}")
    subprocess.run(["sync"], check=True)
    on_disk = time.monotonic() - start
    wall = re.search(r"Elapsed \(wall clock\) time \(h:mm:ss or m:ss\): (\S+)", proc.stderr).group(1)
    seconds = sum(float(x) * 60**i for i, x in enumerate(reversed(wall.split(":"))))
    rss_kb = int(re.search(r"Maximum resident set size \(kbytes\): (\d+)", proc.stderr).group(1))
    return seconds, on_disk, rss_kb / 1e6


def raw_dcp_copy(shards: Path, raw: Path, config: Path) -> None:
    """The checkpoint as ``dcp.save(model.state_dict())`` writes it: the same records (a record holds only the
    tensor), linked, and a .metadata naming them without accelerate's "model." namespace; config.json beside."""
    import pickle

    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import MetadataIndex

    raw.mkdir(parents=True)
    metadata = dcp.FileSystemReader(str(shards)).read_metadata()
    metadata.state_dict_metadata = {k.removeprefix("model."): v for k, v in metadata.state_dict_metadata.items()}
    metadata.storage_data = {
        MetadataIndex(i.fqn.removeprefix("model."), i.offset, i.index): info
        for i, info in metadata.storage_data.items()
    }
    (raw / ".metadata").write_bytes(pickle.dumps(metadata))
    # hard links: no copy, and the files lie inside the folder (a symlink out is refused)
    for record in shards.glob("*.distcp"):
        os.link(record, raw / record.name)
    shutil.copy(config, raw / "config.json")


def bench(
    size: str,
    ranks: int,
    workdir: Path,
    memory_budget: str,
    repeats: int,
    hidden: int = 2048,
    vocab: int = 32000,
    baseline: Path | None = None,
) -> list[tuple]:
    work = workdir / size
    # an earlier run's, marked by make_folder
    remove(work, BENCH_WORK, missing_ok=True)
    make_folder(work, BENCH_WORK)
    target = internals.get("huggingface_hub.serialization._base.parse_size_to_int")(size)
    ckpt = make_checkpoint(work / "run", target, ranks=ranks, hidden=hidden, vocab=vocab)
    shards = ckpt / "pytorch_model_fsdp_0"
    nbytes = sum(f.stat().st_size for f in shards.iterdir())
    # the same shards as another tool leaves them: config and tokenizer, no manifest (transformers checks them)
    bare = work / "bare" / ckpt.name
    shutil.copytree(ckpt, bare, ignore=shutil.ignore_patterns(MANIFEST, shards.name))
    (bare / shards.name).symlink_to(shards)
    raw = work / "raw-dcp"
    raw_dcp_copy(shards, raw, ckpt / "config.json")
    config_only = work / "config-only"
    config_only.mkdir()
    shutil.copy(ckpt / "config.json", config_only)
    rows = []
    commands = {
        "cp -r (copy of the shards)": (["cp", "-r", str(shards), str(work / "cp")], work / "cp", None),
        "accelerate merge-weights": (
            ["accelerate", "merge-weights", str(shards), str(work / "merge-weights")],
            work / "merge-weights",
            None,
        ),
    }
    inputs = {
        "our checkpoint": [str(ckpt)],
        "no manifest": [str(bare)],
        "raw torch DCP, config.json only": [str(raw)],
        "raw torch DCP, --base-model": [str(raw), "--base-model", str(config_only)],
    }
    for tree in [REPO] if baseline is None else [REPO, baseline]:
        # its own package, not ours
        env = None if tree == REPO else {**os.environ, "PYTHONPATH": str(tree)}
        for i, (what, args) in enumerate(inputs.items()):
            out = work / f"merged-{i}{'' if tree == REPO else '-baseline'}"
            name = f"tools/merge_checkpoint.py ({what}){'' if tree == REPO else f' [{tree}]'}"
            cmd = [sys.executable, str(tree / "tools" / "merge_checkpoint.py"), args[0], str(out), *args[1:]]
            commands[name] = ([*cmd, "--memory-budget", memory_budget], out, env)
    results = {}
    # best of `repeats`, commands interleaved so drifts in disk speed hit all alike
    for _ in range(repeats):
        for name, (cmd, out, env) in commands.items():
            wall, on_disk, rss = timed(cmd, list(shards.iterdir()), env)
            best = results.get(name, (float("inf"), float("inf"), 0.0))
            results[name] = (min(best[0], wall), min(best[1], on_disk), max(best[2], rss))
            remove_inside(work, out.name, BENCH_WORK)
    base_mw, base_cp = results["accelerate merge-weights"], results["cp -r (copy of the shards)"]
    for name, (wall, on_disk, rss) in results.items():
        rows.append(
            (
                f"{nbytes / 1e9:.2f} GB, {ranks} ranks",
                name,
                wall,
                rss,
                wall / base_mw[0],
                wall / base_cp[0],
                rss / base_mw[2],
                on_disk,
                on_disk / base_cp[1],
            )
        )
    remove(work, BENCH_WORK)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0], formatter_class=HelpFormatter)
    parser.add_argument("--size", action="append", help="checkpoint size (fp32), e.g. 1GB; repeatable (default: 1GB)")
    parser.add_argument("--ranks", type=int, default=2, help="ranks that wrote the checkpoint")
    parser.add_argument(
        "--workdir", type=Path, default=Path("/tmp/merge-bench"), help="folder for the checkpoints and merged models"
    )
    parser.add_argument("--memory-budget", default="512MB", help="passed to merge_checkpoint.py")
    parser.add_argument("--repeats", type=int, default=2, help="runs of each command; the fastest is reported")
    parser.add_argument(
        "--baseline", type=Path, help="another checkout (git worktree add): its converter runs beside this one's"
    )
    parser.add_argument(
        "--hidden", type=int, default=2048, help="model width: with --vocab, sets the smallest checkpoint (one layer)"
    )
    parser.add_argument(
        "--vocab", type=int, default=32000, help="vocabulary: the embeddings alone are 2 x vocab x hidden x 4 bytes"
    )
    args = parser.parse_args()
    rows = [
        row
        for size in (args.size or ["1GB"])
        for row in bench(
            size,
            args.ranks,
            args.workdir,
            args.memory_budget,
            args.repeats,
            args.hidden,
            args.vocab,
            None if args.baseline is None else args.baseline.resolve(),
        )
    ]
    print(
        "| checkpoint | command | wall s | peak RSS GB | time vs merge-weights | time vs cp | RSS vs "
        "merge-weights | on disk s (+sync) | on disk vs cp |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for ckpt, name, wall, rss, r_mw, r_cp, r_rss, on_disk, r_disk in rows:
        print(
            f"| {ckpt} | {name} | {wall:.1f} | {rss:.2f} | {r_mw:.2f}x | {r_cp:.2f}x | {r_rss:.2f}x | "
            f"{on_disk:.1f} | {r_disk:.2f}x |"
        )


if __name__ == "__main__":
    main()
