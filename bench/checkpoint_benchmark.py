"""What a checkpoint costs a training run: the stall per save, its size, and memory over many saves.

    PYTHONPATH=. python bench/checkpoint_benchmark.py                      # ~1 GB fp32 model, 2 ranks, 20 saves
    PYTHONPATH=. python bench/checkpoint_benchmark.py --gigabytes 0.1 --saves 5   # a check: about 2 minutes

It builds a model folder (random Llama weights saved with save_pretrained, bench/load_memory.py's builder) and
launches train_fsdp.py (through bench/timed_run.py, which records when each optimizer step ends) under
zero3.yaml, for full fine-tuning and for LoRA, four times each: without saves, and with a SHARDED_STATE_DICT
checkpoint every ``--save-steps`` steps (``--save_total_limit 2``) written synchronously
(``--async_checkpoints false``: training waits for the files), in the background as by default (on CPU: from the
live shards, the next optimizer step waiting for the write) and in the background from a host copy
(``--async_checkpoint_staging copy``, what GPU runs do); shard files
written past the page cache (O_DIRECT, the default where the filesystem takes it), and with ``--page-cache`` also
through it (``--direct_io_checkpoints false``), each mode then twice. Reported, side by side:

- the stall per save: the time the steps after the warm-up took with saves minus the same steps without, divided
  by the saves among them (a background save's cost is spread over the steps its write overlaps, so a median step
  would miss it); for synchronous saves this is also the save's wall time; a background save's wall time (from the
  save's start to every rank's files written) is the median the run logs for its saves;
- the checkpoint's size on disk (``du``-like sum of its files), against the base model's weights: a LoRA checkpoint
  holds the adapter and its Adam state alone (fsdp_recipes/compat/trainer_checkpoints.py), where one holding the
  whole model would add the frozen base's bytes;
- each rank's private memory (RssAnon, /proc/<pid>/status, sampled every ``--interval`` s) over the saves: its peak
  over the first quarter of the saves against the last quarter, so growth from save to save shows.

Targets (issue 22): a background save's stall at most 20% of the synchronous save's; a LoRA checkpoint at most 5%
of the base's size; no growth of RssAnon from the first to the last quarter of the saves.
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import os
import re
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from bench.load_memory import TINY, build_model, rank_pids  # noqa: E402
from fsdp_recipes.console import HelpFormatter  # noqa: E402
from fsdp_recipes.removal import make_folder, remove  # noqa: E402

BENCH_WORK = "checkpoint benchmark"

CONFIG = REPO / "accelerate_configs" / "zero3.yaml"


def rss_anon(pid: int) -> int:
    """RssAnon of ``pid`` in bytes: its private memory (tensors), not the file pages it maps."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("RssAnon:"):
            return int(line.split()[1]) * 1024
    raise KeyError("RssAnon")


def folder_bytes(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file())


def run(
    model: Path, lora: bool, mode: str, steps: int, nprocs: int, work: Path, interval: float, save_steps: int = 1
) -> dict:
    """One launch (``mode``: nosave, sync, async, async-copy; ``-cache``: through the page cache); returns step times,
    per-rank RssAnon samples and the last checkpoint's size."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    saves = mode != "nosave"
    name = f"{'lora' if lora else 'full'}-{mode}"
    out, times = work / name, work / f"{name}-steps.json"
    cmd = [
        "accelerate",
        "launch",
        "--config_file",
        str(CONFIG),
        "--num_processes",
        str(nprocs),
        "--num_machines",
        "1",
        "--main_process_port",
        str(port),
        str(REPO / "bench" / "timed_run.py"),
        "--model_name_or_path",
        str(model),
        "--tokenizer_name",
        str(TINY),
        "--use_peft",
        str(lora).lower(),
        "--train_file",
        str(REPO / "assets" / "data" / "tiny_corpus.txt"),
        "--block_size",
        "32",
        "--per_device_train_batch_size",
        "1",
        "--max_steps",
        str(steps),
        "--logging_steps",
        str(steps),
        "--save_strategy",
        "steps" if saves else "no",
        "--save_steps",
        str(save_steps),
        "--save_total_limit",
        "2",
        "--report_to",
        "none",
        "--dataloader_pin_memory",
        "false",
        "--output_dir",
        str(out),
        "--overwrite_output_dir",
        "true",
        "--async_checkpoints",
        str(mode.startswith("async")).lower(),
        "--direct_io_checkpoints",
        str(not mode.endswith("-cache")).lower(),
        "--async_checkpoint_staging",
        "copy" if mode.startswith("async-copy") else "auto",
    ]
    env = {**os.environ, "TOKENIZERS_PARALLELISM": "false", "SCALING_STEP_TIMES": str(times)}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), str(REPO / "bench"), env.get("PYTHONPATH")]))
    log_path = work / f"{name}.log"
    samples: dict[int, list[tuple[float, int]]] = {}
    pids: dict[int, int] = {}
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT)
        while proc.poll() is None:
            if len(pids) < nprocs:
                pids.update(rank_pids(proc.pid, b"timed_run.py"))
            for rank, pid in pids.items():
                try:
                    samples.setdefault(rank, []).append((time.time(), rss_anon(pid)))
                except (OSError, KeyError, ValueError):
                    pass
            time.sleep(interval)
    if proc.returncode:
        raise SystemExit(f"launch failed ({proc.returncode}); see {log_path}:\n" + log_path.read_text()[-3000:])
    ends = json.loads(times.read_text())["step_end"]
    last = max(out.glob("checkpoint-*"), key=lambda p: int(p.name.split("-")[1]), default=None)
    background = [float(x) for x in re.findall(r"written in the background in ([\d.]+) s", log_path.read_text())]
    report = json.loads((out / "fsdp_report.json").read_text())
    device, writes = report["device"], report.get("checkpoint_writes") or {}
    return {
        "in_place": bool(writes.get("in_place_saves")),
        "step_end": ends,
        "samples": samples,
        "checkpoint_bytes": folder_bytes(last) if last else None,
        "background_seconds": background,
        "checkpoint_model_bytes": folder_bytes(last / "pytorch_model_fsdp_0") if last else None,
        "device": device,
    }


def ranks_label(nprocs: int, device: str) -> str:
    """What trained, as the run's fsdp_report.json says: "2 CPU ranks (... over gloo" or "1 GPU rank (NVIDIA H200, ...
    over nccl"."""
    if device.startswith("cuda"):
        import torch

        name = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "CUDA"
        return f"{nprocs} GPU rank{'s' * (nprocs > 1)} ({name}, FSDP2 FULL_SHARD over nccl"
    return f"{nprocs} CPU rank{'s' * (nprocs > 1)} (FSDP2 FULL_SHARD over gloo"


def queued(write_seconds: float | None, step_seconds: float, save_steps: int, in_place: bool = False) -> str | None:
    """When a background write outlasts the training it can overlap, training waits for it, and its stall is at least
    the write less that training, however well the two run side by side: the note says so. From a host copy the
    write can overlap the training up to the next save (one save in flight), so more --save-steps give it room; in
    place (the live shards in host memory) the next optimizer step waits for the write, so it overlaps one step at
    most, whatever --save-steps is."""
    if write_seconds is None or step_seconds <= 0:
        return None
    window = step_seconds if in_place else step_seconds * save_steps
    if write_seconds <= window:
        return None
    if in_place:
        return (
            f"the background write ({write_seconds:.2f} s) outlasts the step it can overlap ({window:.2f} s): "
            "written in place, "
            f"the next optimizer step waits for it, so this stall measures the write less one step"
        )
    need = math.ceil(write_seconds / step_seconds)
    return (
        f"the background write ({write_seconds:.2f} s) outlasts the training between saves ({window:.2f} s): "
        "the next save "
        f"waited for it, so this stall measures the write, not its overlap with training; --save-steps {need} or more "
        "leaves the write time to overlap"
    )


def step_seconds(ends: list[float], skip: int) -> list[float]:
    """Durations of the steps after the first ``skip`` (the first steps warm up)."""
    return [b - a for a, b in zip(ends[skip:], ends[skip + 1 :])]


def stall_per_save(got: dict, nosave: dict, a: argparse.Namespace) -> float:
    """The steps after the warm-up with saves less the same steps without, over the saves among them."""
    times = step_seconds(got["step_end"], a.warmup)
    return (sum(times) - sum(step_seconds(nosave["step_end"], a.warmup))) / (len(times) // a.save_steps)


def stall_of_each_save(got: dict, nosave: dict, a: argparse.Namespace) -> dict[int, float]:
    """Per save (numbered from 1), the --save-steps steps that end with it, after the warm-up, with saves less the same
    steps without: the first save's stall apart from the later ones' (on a GPU the first makes the pinned host copy
    that every later one reuses: of the 0.95 s an H100's 6 saves stalled on average, bench/results/h100/
    checkpoint-stall-1, most was the first's). A save runs after its step's on_step_end, so its cost is in the next
    step's time; a save inside the warm-up is not measured."""
    times, plain = step_seconds(got["step_end"], a.warmup), step_seconds(nosave["step_end"], a.warmup)
    k, stalls = a.save_steps, {}
    for m in itertools.count(1):
        # the time of step m*k+1 (index into times), which holds save m
        last = m * k - 1 - a.warmup
        if last >= min(len(times), len(plain)):
            break
        if last >= 0:
            first = max(0, last - k + 1)
            stalls[m] = sum(times[first : last + 1]) - sum(plain[first : last + 1])
    return stalls


def first_and_later(stalls: dict[int, float]) -> dict:
    """The first save's stall (None when it fell in the warm-up) and the median of the later ones'."""
    later = [v for m, v in stalls.items() if m > 1]
    return {
        "stall_first_save_seconds": round(stalls[1], 4) if 1 in stalls else None,
        "stall_later_saves_median_seconds": round(statistics.median(later), 4) if later else None,
    }


def split(m: dict) -> str:
    """ "first / later" stall seconds for the table ("-" where not measured)."""
    first, later = m.get("stall_first_save_seconds"), m.get("stall_later_saves_median_seconds")
    return ("-" if first is None else f"{first:.2f}") + " / " + ("-" if later is None else f"{later:.2f}")


def rss_growth(ends: list[float], samples: dict[int, list[tuple[float, int]]]) -> dict[int, dict[str, int]]:
    """Per rank: peak RssAnon over the first and the last quarter of the steps (each step a save)."""
    n = len(ends)
    quarter = max(1, n // 4)
    first, last = (ends[0], ends[quarter]), (ends[n - 1 - quarter], ends[-1])
    out = {}
    for rank, rows in samples.items():
        early = [v for t, v in rows if first[0] <= t <= first[1]]
        late = [v for t, v in rows if last[0] <= t <= last[1]]
        if early and late:
            out[rank] = {"first_quarter_peak": max(early), "last_quarter_peak": max(late)}
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=HelpFormatter)
    p.add_argument("--gigabytes", type=float, default=1.0, help="model size in fp32, gigabytes")
    p.add_argument("--saves", type=int, default=20, help="checkpoints written by each run with saves")
    p.add_argument("--save-steps", type=int, default=1, help="steps between checkpoints (1: a save after every step)")
    p.add_argument(
        "--training",
        choices=["full", "lora", "both"],
        default="both",
        help="which runs: full fine-tuning, LoRA or both",
    )
    p.add_argument("--warmup", type=int, default=2, help="steps left out of the step times")
    p.add_argument("--nprocs", type=int, default=2, help="processes (ranks)")
    p.add_argument("--interval", type=float, default=0.05, help="seconds between memory samples")
    p.add_argument(
        "--page-cache", action="store_true", help="also run both save modes with --direct_io_checkpoints false"
    )
    p.add_argument(
        "--work",
        type=Path,
        help="folder for the model and the runs, kept (default: a temporary one, removed at the end)",
    )
    p.add_argument("--output", type=Path, help="write results.json and README.md (a table) into this folder")
    a = p.parse_args(argv)
    for flag, value, least in (
        ("--saves", a.saves, 1),
        ("--save-steps", a.save_steps, 1),
        ("--warmup", a.warmup, 0),
        ("--nprocs", a.nprocs, 1),
    ):
        # (review) --save-steps 0 made stall_of_each_save loop for good
        if value < least:
            p.error(f"{flag} must be at least {least}, got {value}")
    if a.save_steps <= a.warmup:
        print(
            f"note: with --save-steps {a.save_steps} and --warmup {a.warmup} the first save falls in the warm-up: its "
            "stall is not told apart from the later ones' (- in the table); --save-steps above --warmup measures it",
            flush=True,
        )
    # kept: the model built there is reused by the next run given the same folder
    if a.work is not None:
        return measure(a, a.work, argv)
    # a temporary folder holds the model and four runs' checkpoints, GBs each: removed however the runs end
    work = make_folder(tempfile.mkdtemp(prefix="checkpoint_benchmark-"), BENCH_WORK, exist_ok=True)
    try:
        return measure(a, work, argv)
    finally:
        remove(work, BENCH_WORK)


def measure(a: argparse.Namespace, work: Path, argv) -> int:
    model = work / f"model-{a.gigabytes}"
    if not (model / "nbytes").exists():
        model.mkdir(parents=True, exist_ok=True)
        (model / "nbytes").write_text(str(build_model(model, int(a.gigabytes * 1e9), "float32", tied=False)))
    base_bytes = int((model / "nbytes").read_text())
    steps = a.saves * a.save_steps + a.warmup
    print(
        f"model {model}: {base_bytes / 1e9:.2f} GB of fp32 weights; {a.nprocs} ranks, {steps} steps, a "
        "checkpoint after "
        f"every {a.save_steps} step(s) in the runs with saves ({CONFIG.relative_to(REPO)}, SHARDED_STATE_DICT)",
        flush=True,
    )
    rows = []
    # the shard files' writes
    kinds = [("direct", "")] + ([("page cache", "-cache")] if a.page_cache else [])
    for lora in {"full": (False,), "lora": (True,), "both": (False, True)}[a.training]:
        measured = {}
        for mode in ["nosave", *(m + suffix for _, suffix in kinds for m in ("sync", "async", "async-copy"))]:
            if mode.startswith("async-copy") and not measured[mode.replace("async-copy", "async")]["in_place"]:
                # the default staging already wrote from a host copy (a GPU run): the same launch
                # again would only cost time
                measured[mode] = measured[mode.replace("async-copy", "async")]
                print(
                    f"  {'LoRA' if lora else 'full'} {mode}: not run, the background saves were already written "
                    "from a host copy",
                    flush=True,
                )
                continue
            began = time.time()
            measured[mode] = run(model, lora, mode, steps, a.nprocs, work, a.interval, a.save_steps)
            # each launch's stall as soon as it is known: a run cut short (a device's time limit) still shows it
            print(
                f"  {'LoRA' if lora else 'full'} {mode}: {time.time() - began:.0f} s"
                + (
                    ""
                    if mode == "nosave"
                    else f"; stall per save {stall_per_save(measured[mode], measured['nosave'], a):.2f} s"
                ),
                flush=True,
            )
        plain = statistics.median(step_seconds(measured["nosave"]["step_end"], a.warmup))
        for writes, suffix in kinds:
            row = {
                "training": "LoRA" if lora else "full",
                "shard_files": writes,
                "nprocs": a.nprocs,
                "saves": a.saves,
                "base_bytes": base_bytes,
                "step_seconds_without_saves": round(plain, 4),
            }
            for mode in ("sync", "async", "async-copy"):
                got = measured[mode + suffix]
                times = step_seconds(got["step_end"], a.warmup)
                saving = sum(times) / len(times)
                stall = stall_per_save(got, measured["nosave"], a)
                row[mode] = {
                    "step_seconds_with_saves": round(saving, 4),
                    "stall_per_save_seconds": round(stall, 4),
                    **first_and_later(stall_of_each_save(got, measured["nosave"], a)),
                    "rss": {str(r): v for r, v in sorted(rss_growth(got["step_end"], got["samples"]).items())},
                }
            background = measured["async" + suffix]
            row["sync"]["save_seconds"] = row["sync"]["stall_per_save_seconds"]
            for mode in ("async", "async-copy"):
                written = measured[mode + suffix]["background_seconds"]
                row[mode]["save_seconds"] = round(statistics.median(written), 4) if written else None
                row[f"{mode}_stall_vs_sync_save".replace("-", "_")] = (
                    round(row[mode]["stall_per_save_seconds"] / row["sync"]["save_seconds"], 4)
                    if row["sync"]["save_seconds"] > 0
                    else None
                )
            row["training_between_saves_seconds"] = round(plain * a.save_steps, 4)
            row["device"] = background["device"]
            row["queued"] = {
                mode: note
                for mode in ("async", "async-copy")
                if (note := queued(row[mode]["save_seconds"], plain, a.save_steps, measured[mode + suffix]["in_place"]))
            }
            row["host_copy_was_the_default"] = measured["async-copy" + suffix] is background
            row["checkpoint_bytes"] = background["checkpoint_bytes"]
            row["checkpoint_model_bytes"] = background["checkpoint_model_bytes"]
            row["checkpoint_vs_base"] = round(row["checkpoint_bytes"] / base_bytes, 4)
            rows.append(row)
            print(
                f"    {writes}: stall per save: sync {row['sync']['stall_per_save_seconds']:.2f} s, background "
                f"{row['async']['stall_per_save_seconds']:.2f} s "
                f"(first / later saves {split(row['async'])} s, its write {row['async']['save_seconds']} s), "
                f"background from a host copy {row['async-copy']['stall_per_save_seconds']:.2f} s; checkpoint "
                f"{row['checkpoint_bytes'] / 1e6:,.1f} MB = {row['checkpoint_vs_base']:.1%} of the base",
                flush=True,
            )
            for mode, note in row["queued"].items():
                print(f"    note ({mode}): {note}", flush=True)

    def rss(r):
        return "; ".join(
            f"rank {k}: {v['first_quarter_peak'] / 2**20:,.0f} -> {v['last_quarter_peak'] / 2**20:,.0f}"
            for k, v in r["rss"].items()
        )

    def ratio(r, key="async_stall_vs_sync_save"):
        return "n/a (the synchronous save cost nothing measurable)" if r[key] is None else f"{r[key]:.0%}"

    lines = [
        f"Checkpoint cost, {base_bytes / 1e9:.2f} GB fp32 model, {ranks_label(a.nprocs, rows[0]['device'])}, "
        f"SHARDED_STATE_DICT), {a.saves} saves (one every {a.save_steps} step(s)), synchronous "
        "(--async_checkpoints false), in the background "
        "(the default: from the live shards where they are in host memory, else from a host copy) and in the "
        "background from a host "
        "copy (--async_checkpoint_staging copy):",
        "",
        "| training | shard files written | median step without saves (s) | training between saves (s) | sync: "
        "mean step (s) | sync: stall = save (s) | background: mean step (s) | background: stall (s) | "
        "background: first save / later (median) stall (s) | background: its write (s) | background stall vs "
        "sync save | host copy: stall (s) | host copy: stall vs sync save | checkpoint (MB) | vs base "
        "weights |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['training']} | {r['shard_files']} | {r['step_seconds_without_saves']:.2f} | "
            f"{r['training_between_saves_seconds']:.2f} | {r['sync']['step_seconds_with_saves']:.2f} | "
            f"{r['sync']['stall_per_save_seconds']:.2f} | "
            f"{r['async']['step_seconds_with_saves']:.2f} | {r['async']['stall_per_save_seconds']:.2f} | "
            f"{split(r['async'])} | {r['async']['save_seconds']} | {ratio(r)} | "
            f"{r['async-copy']['stall_per_save_seconds']:.2f} | {ratio(r, 'async_copy_stall_vs_sync_save')} | "
            f"{r['checkpoint_bytes'] / 1e6:,.1f} | {r['checkpoint_vs_base']:.1%} |"
        )
    lines += [
        f"\nNote ({r['training']}, {r['shard_files']}, "
        f"{'background' if mode == 'async' else 'from a host copy'}): {note}."
        for r in rows
        for mode, note in r["queued"].items()
    ]
    lines += [
        f"\nNote ({r['training']}, {r['shard_files']}): the default background saves were written from a host "
        "copy already, so the "
        "host copy columns repeat them (one launch, not run twice)."
        for r in rows
        if r["host_copy_was_the_default"]
    ]
    lines += [
        "",
        "RssAnon peak, first -> last quarter of the saves (MiB):",
        "",
        "| training | shard files written | sync | background | background, host copy |",
        "|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['training']} | {r['shard_files']} | {rss(r['sync'])} | {rss(r['async'])} | {rss(r['async-copy'])} |"
        )
    print("\n" + "\n".join(lines))
    if a.output:
        a.output.mkdir(parents=True, exist_ok=True)
        (a.output / "results.json").write_text(json.dumps(rows, indent=1) + "\n")
        cmd = "PYTHONPATH=. python bench/checkpoint_benchmark.py " + " ".join(
            argv if argv is not None else sys.argv[1:]
        )
        (a.output / "README.md").write_text("\n".join([*lines, "", f"Command: `{cmd}`", ""]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
