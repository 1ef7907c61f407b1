"""Ground truth on one GPU: everything a person needs to judge this repository there, written under one folder.

    # here, with network: what the GPU image lacks -> bench/wheels/
    bash bench/gpu_wheels.sh
    # on the GPU: environment, pytest -m gpu, FSDP2 configs
    python3 bench/gpu_check.py --part 1 --install-wheels --output OUT
    # FSDP1 and DDP configs, LoRA, QLoRA, scaling, the stall
    python3 bench/gpu_check.py --part 2 --output OUT
    # a visit of one command: both, what matters most first
    python3 bench/gpu_check.py --part all --install-wheels --output OUT

Each part stays under --budget seconds (default 560: one device command may run 600) and skips, with the reason,
what would not fit. The GPU machine has no network: `bench/wheels/` (carried beside the tree) holds the pinned
wheels its image lacks or holds in another version, installed with --install-wheels (--no-index --no-deps); what is
still
another version than requirements.txt pins (torch 2.11 against 2.13, say) is one line in the report, as is any
private name of a library that moved (fsdp_recipes.compat.internals).

Per config, a ~1B Llama built from a config (Llama-3.2-1B's shape, the tiny tokenizer's vocabulary) trains 20
steps in bf16 on one GPU: tokens/s and MFU (the median of the logging windows after the first), peak CUDA memory
allocated and reserved against tools/estimate_memory.py's figure, the model-state bytes against the formula, and
for the zero3 configs a merge of the last checkpoint that must load with the trained weights. Checks, each against
a number and each able to fail: model states within 10% of the formula, peak allocated within 10% of the estimate,
MFU between 5% and 85% of the device's bf16 peak (offload: 0.2%, the host's Adam bounds it), offload's peak below the
same config without it, the merge equal to the final model, background checkpoints (zero3 and zero3_offload save at
step 10 and 20) written from a host copy of GPU shards and from the offloaded shards themselves (no copy) with
offload; the offload runs profile step 1 and the report lists what was live at its peak. Part 2's "stall" runs
bench/checkpoint_benchmark.py (issue 22: a background save's stall at most 20% of a synchronous one). OUT holds at
most 7 files (environment.json, results.json, report.md, pytest.txt, logs.txt, and scaling.md/scaling.json for
part 2) and the checkpoint-stall folder: what one device command brings back.

The speed rows (`--runs speed`, first in parts 1 and all; issue 50) train Llama-3.2-1B's own shape, its 128,256-token
vocabulary and tied embeddings included (random weights, the tiny tokenizer's tokens: nothing downloaded), under
zero3.yaml with no checkpoint written, at batch 4 and at per_device_train_batch_size auto (the estimator's choice):
tokens/s and MFU as torchtitan counts it (LM head in, a tied head once, the attention term), the first logging window
(warm-up) left out; the peak against the estimate at the batch trained.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from importlib import metadata
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from fsdp_recipes.console import RawHelpFormatter  # noqa: E402

WHEELS = REPO / "bench" / "wheels"
# What the wheels hold: the packages the GPU image ('cuda', as /work/.library/device/KINDS.md lists it on
# 2026-11-17) lacks, or holds in another version than requirements.txt pins, with the dependencies of those that
# the image lacks too. None: the version requirements.txt pins. bitsandbytes (QLoRA) is 43 MB of the 64 MiB that
# travel with the tree; the rest about 20 MB.
CARRY: dict[str, str | None] = {
    "datasets": None,
    "dill": "0.4.1",
    "multiprocess": "0.70.19",
    "transformers": None,
    "tokenizers": None,
    "peft": None,
    "huggingface_hub": None,
    "httpx2": "2.16.2",
    "httpcore2": "2.16.2",
    "truststore": "0.10.5",
    "bitsandbytes": "0.50.2",
    # the speed rows' Liger kernels (Triton, which the image has): not in requirements.txt
    "liger_kernel": "0.8.5",
}
GPU_IMAGE = frozenset(
    """
absl-py accelerate aiohttp anyio attrs certifi charset-normalizer click filelock fonttools fsspec h11 hf-xet httpcore
httpx huggingface-hub idna jinja2 markupsafe matplotlib networkx numpy packaging pandas peft pillow pip pluggy psutil
pyarrow pydantic pygments pytest python-dateutil pytorch-lightning pyyaml regex requests rich safetensors sentencepiece
setuptools shellingham six sympy tensorboard tokenizers torch tqdm transformers triton typer typing-extensions urllib3
xxhash annotated-doc
""".split()
)
PINNED = ("torch", "transformers", "accelerate", "datasets", "peft", "safetensors", "huggingface_hub", "tokenizers")

# The model: Llama-3.2-1B's layers (hidden 2048, 16 layers, MLP 8192, 32 heads, 8 KV heads), 0.97B parameters with
# the tiny tokenizer's vocabulary; 20 steps of 4 x 1024 tokens.
MODEL = {
    "hidden_size": 2048,
    "num_hidden_layers": 16,
    "intermediate_size": 8192,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "max_position_embeddings": 2048,
}
STEPS, BATCH, SEQ = 20, 4, 1024
# The speed rows (issue 50): Llama-3.2-1B's own shape, its 128,256-token vocabulary and tied embeddings included
# (1,235,814,400 parameters, the head a fifth of them: with the tiny vocabulary the head and the loss cost nothing),
# random weights and the tiny tokenizer's tokens of the repository's corpus: nothing is downloaded. Under zero3.yaml
# with no checkpoint written (no write overlaps the timed steps), the first logging window (warm-up) left out
# (log_metrics), MFU as torchtitan counts it (fsdp_recipes.train.metrics.flops_per_token).
LLAMA_1B = {**MODEL, "vocab_size": 128256, "tie_word_embeddings": True}
SPEED_CONFIG = "accelerate_configs/zero3.yaml"
# Regional compilation through accelerate's dynamo settings: each decoder layer compiled in place (module.compile,
# accelerate's compile_regions_fsdp2), so FSDP2's hooks run around each layer's compiled code
COMPILE = ("--dynamo_backend", "inductor", "--dynamo_use_regional_compilation")
LIGER = ("--use_liger_kernel", "true")
# label -> (per_device_train_batch_size, the run's flags, accelerate launch's flags), what matters most first: the
# eager baseline and the fast settings at the estimator's batch side by side, then each lever alone
SPEED_ROWS: dict[str, tuple[str, tuple[str, ...], tuple[str, ...]]] = {
    "speed: zero3, eager, batch auto": ("auto", (), ()),
    "speed: zero3, compiled + liger, batch auto": ("auto", LIGER, COMPILE),
    "speed: zero3, compiled, batch auto": ("auto", (), COMPILE),
    "speed: zero3, liger, batch auto": ("auto", LIGER, ()),
    "speed: zero3, eager, batch 4": (str(BATCH), (), ()),
}
# the one GPU (the CPU test of this script runs 2: FSDP over gloo needs 2)
PROCESSES = 1
FSDP2 = [
    "accelerate_configs/zero3.yaml",
    "accelerate_configs/zero2.yaml",
    "accelerate_configs/zero3_offload.yaml",
    "accelerate_configs/hybrid_shard.yaml",
]
FSDP1 = [
    "accelerate_configs/fsdp1/zero3.yaml",
    "accelerate_configs/fsdp1/zero2.yaml",
    "accelerate_configs/fsdp1/zero3_offload.yaml",
    "accelerate_configs/fsdp1/no_shard.yaml",
    "accelerate_configs/fsdp1/hybrid_shard.yaml",
    "accelerate_configs/ddp.yaml",
]
# these also save and merge a checkpoint
MERGED = {"accelerate_configs/zero3.yaml", "accelerate_configs/fsdp1/zero3.yaml"}
# these save in the background, the first checkpoint mid-run: from a host copy of the GPU shards (zero3) and from
# the offloaded shards themselves, no copy, the next optimizer step waiting for the write (zero3_offload)
BACKGROUND_SAVES = {"accelerate_configs/zero3.yaml", "accelerate_configs/zero3_offload.yaml"}
OFFLOAD_PAIRS = [
    ("accelerate_configs/zero3.yaml", "accelerate_configs/zero3_offload.yaml"),
    ("accelerate_configs/fsdp1/zero3.yaml", "accelerate_configs/fsdp1/zero3_offload.yaml"),
]
TOLERANCE, MFU_BAND = 0.10, (0.05, 0.85)
# With CPU offload the step waits for the host: Adam over every fp32 parameter in host memory (28 bytes of memory
# traffic per parameter) and each step's weights up and gradients down over PCIe. On an H200 with 16 host cores the
# 0.97B model stepped in 2.3 s, 1.1% MFU (bench/results/h200/gpu-check-7), which is what that host allows
# (6 * P * 4096 tokens / (2.3 s * 989 TFLOP/s)); below 0.2% something more than the host's work would be waiting.
OFFLOAD_MFU_BAND = (0.002, 0.85)
# tokens/s and MFU are the median of 2-step logging windows: the one a background save's optimizer wait falls in and
# the profiled one are 2 of 9 (with 5-step windows they were 2 of 3, and the median of zero3 on an H200 was the
# checkpoint's cost, not training's: bench/results/h200/gpu-check-1); the checkpoint's cost has its own columns
LOGGING_STEPS = 2
# seconds between looks at what a running command has started (Check.run)
TREE_POLL = 1.0
# seconds a command has after SIGINT at the deadline to print what it has (pytest: its failures)
INTERRUPT_GRACE = 20
# what one config's run takes at most on an H100 (start, 20 steps, export): below this, it is skipped
RUN_SECONDS = 75
# --part all: one command for a visit shorter than two (15 minutes of device time, the start included), what matters
# most first: the speed rows (issue 50), the FSDP2 pair that shows offload and both background-save paths,
# LoRA/QLoRA, the FSDP1 pair, pytest -m gpu, then the remaining configs and scaling, each skipped with its reason when
# the budget is spent
ALL_FIRST = ["accelerate_configs/zero3.yaml", "accelerate_configs/zero3_offload.yaml"]
ALL_THEN = ["accelerate_configs/fsdp1/zero3.yaml", "accelerate_configs/fsdp1/zero3_offload.yaml"]
ALL_LAST = [c for c in FSDP2 + FSDP1 if c not in ALL_FIRST + ALL_THEN]


def model_config(shape: dict | None = None):
    """The ~1B Llama's config: assets/tiny-llama's, with MODEL's shape (or ``shape``: LLAMA_1B)."""
    from transformers import AutoConfig

    shape = MODEL if shape is None else shape
    return AutoConfig.from_pretrained(
        REPO / "assets" / "tiny-llama", **shape, head_dim=shape["hidden_size"] // shape["num_attention_heads"]
    )


# ---------- the wheels and the versions (no GPU needed: tested on CPU) ----------


def pins(requirements: Path = REPO / "requirements.txt") -> dict[str, str]:
    """``name==version`` lines of requirements.txt, by normalised name."""
    found = {}
    for line in requirements.read_text().splitlines():
        if match := re.match(r"\s*([A-Za-z0-9_.-]+)==([^\s#;]+)", line):
            found[norm(match[1])] = match[2]
    return found


def norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def wheel_list() -> list[str]:
    """``name==version`` of every wheel bench/gpu_wheels.sh downloads."""
    pinned = pins()
    return [f"{name}=={version or pinned[norm(name)]}" for name, version in CARRY.items()]


def installed_versions(names=PINNED) -> dict[str, str | None]:
    found = {}
    for name in names:
        try:
            found[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            found[name] = None
    return found


def version_lines(installed: dict[str, str | None], pinned: dict[str, str]) -> list[str]:
    """One line per package that is not the version requirements.txt pins, saying what that means here."""
    lines = []
    for name, version in installed.items():
        want = pinned.get(norm(name))
        if want is None or version == want:
            continue
        if version is None:
            lines.append(
                f"{name}: not installed (requirements.txt pins {want}): put its wheel in bench/wheels "
                "(bench/gpu_wheels.sh)"
            )
        elif name == "torch":
            lines.append(
                f"torch {version} here, requirements.txt pins {want}: the tests and figures of this check are "
                f"of {version}; "
                "fsdp_recipes/compat/cpu_fsdp.py's CPU patches are not used with a GPU"
            )
        else:
            lines.append(
                f"{name} {version} here, requirements.txt pins {want}: bench/wheels lacks the pinned wheel, or "
                "it did not install"
            )
    return lines


def install_wheels(log) -> list[str]:
    """Install the carried wheels the environment lacks or holds in another version; lines saying what happened."""
    wheels = sorted(WHEELS.glob("*.whl")) if WHEELS.is_dir() else []
    if not wheels:
        return [
            f"no wheels in {WHEELS}: nothing installed (run bench/gpu_wheels.sh where there is network, and "
            "carry bench/wheels)"
        ]
    wanted = []
    for wheel in wheels:
        name, version = wheel.name.split("-")[:2]
        try:
            have = metadata.version(name)
        except metadata.PackageNotFoundError:
            have = None
        if have != version:
            wanted.append(wheel)
    if not wanted:
        return ["every carried wheel is installed already"]
    proc = subprocess.run(
        [sys.executable, "-m", "pip", "install", "--quiet", "--no-index", "--no-deps", *map(str, wanted)],
        capture_output=True,
        text=True,
    )
    log(proc.stdout + proc.stderr)
    names = ", ".join(w.name.split("-")[0] + " " + w.name.split("-")[1] for w in wanted)
    if proc.returncode != 0:
        return [f"pip could not install the carried wheels ({names}): {tail(proc.stderr, 1)}"]
    return [f"installed from bench/wheels: {names}"]


# ---------- the table and the checks (no GPU needed: tested on CPU) ----------


def check(name: str, value: float | None, low: float | None, high: float | None, detail: str) -> dict:
    """A named comparison against a number: passed only when the value is there and inside [low, high]."""
    passed = value is not None and (low is None or value >= low) and (high is None or value <= high)
    return {"check": name, "value": value, "low": low, "high": high, "passed": passed, "detail": detail}


def config_checks(row: dict) -> list[dict]:
    """What one config's run must show: states against the formula, peak against the estimate, MFU in its band."""
    found = []
    name = row["config"]
    if row.get("estimate_states") and not row.get("offload"):
        ratio = row["states_bytes"] / row["estimate_states"]
        found.append(
            check(
                f"{name}: model states / formula",
                round(ratio, 3),
                1 - TOLERANCE,
                1 + TOLERANCE,
                f"{gib(row['states_bytes'])} against {gib(row['estimate_states'])}",
            )
        )
    if row.get("estimate_peak"):
        ratio = row["peak_allocated"] / row["estimate_peak"] if row.get("peak_allocated") else None
        found.append(
            check(
                f"{name}: peak allocated / estimate",
                ratio and round(ratio, 3),
                # the estimate counts eager activations: a bound
                None if row.get("levers") else 1 - TOLERANCE,
                1 + TOLERANCE,
                f"{gib(row.get('peak_allocated'))} against {gib(row['estimate_peak'])}",
            )
        )
    if row.get("fsdp_version") or "ddp" in name:
        if row.get("offload"):
            found.append(
                check(
                    f"{name}: MFU",
                    row.get("mfu"),
                    *OFFLOAD_MFU_BAND,
                    "model FLOPs utilisation against the bf16 peak; with offload the host's Adam bounds it",
                )
            )
        else:
            found.append(
                check(f"{name}: MFU", row.get("mfu"), *MFU_BAND, "model FLOPs utilisation against the bf16 peak")
            )
    if "merge_equal" in row:
        found.append(
            check(
                f"{name}: merged checkpoint loads with the final weights",
                float(row["merge_equal"]),
                1.0,
                1.0,
                row.get("merge_detail", ""),
            )
        )
    return found


def staging_checks(row: dict, on_gpu: bool) -> list[dict]:
    """A run that saved in the background: from the live shards where they live in host memory (offload, or a CPU
    run), with no host copy; from a host copy where they live on the GPU (fsdp_recipes.compat.async_dcp)."""
    writes = row.get("checkpoint_writes") or {}
    if writes.get("mode") != "background":
        return []
    saves, in_place = writes.get("saves", 0), writes.get("in_place_saves", 0)
    expect_in_place = bool(row.get("offload")) or not on_gpu
    detail = (
        f"{in_place} of {saves} saves in place, host copy {gib(writes.get('staged_bytes_max'))}, longest write "
        f"{writes.get('seconds_max')} s, longest optimizer wait {writes.get('optimizer_wait_seconds_max')} s"
    )
    share = round(in_place / saves, 3) if saves else None
    # the share of the saves written in place
    wanted = 1.0 if expect_in_place else 0.0
    found = [
        check(
            f"{row['config']}: background saves written {'in place' if expect_in_place else 'from a host copy'}",
            share,
            wanted,
            wanted,
            detail,
        )
    ]
    if expect_in_place:
        found.append(
            check(f"{row['config']}: host copy bytes of in-place saves", writes.get("staged_bytes_max"), 0, 0, detail)
        )
    return found


STALL_ARGS = ["--gigabytes", "1.0", "--saves", "4", "--save-steps", "100", "--training", "full", "--nprocs", "1"]
# On an H200 with 6 saves 100 steps apart the launches took 51 s (no saves), 85 s (sync), 71 s (background, from a
# host copy as a GPU's default is, so the benchmark does not launch the host-copy run again): 4 saves and the model
# fit 200 s
STALL_SECONDS = 200
# issue 22: a background save's stall at most 20% of the synchronous save's
STALL_TARGET = 0.20


def stall_checks(rows: list[dict]) -> list[dict]:
    """The background stall against the synchronous save, for the default (auto) and the host-copy background saves;
    a write that outlasted the training it could overlap measured the write, not the overlap: not a result."""
    found = []
    for row in rows:
        for mode, key in (("async", "async_stall_vs_sync_save"), ("async-copy", "async_copy_stall_vs_sync_save")):
            detail = (
                f"stall {row[mode]['stall_per_save_seconds']} s per save against a synchronous save's "
                f"{row['sync']['save_seconds']} s, "
                f"its write {row[mode]['save_seconds']} s, {row['training_between_saves_seconds']} s of "
                "training between saves"
                + (
                    ""
                    if row[mode].get("stall_first_save_seconds") is None
                    else f"; the first save {row[mode]['stall_first_save_seconds']} s"
                )
                + (
                    ""
                    if row[mode].get("stall_later_saves_median_seconds") is None
                    else f", the later ones {row[mode]['stall_later_saves_median_seconds']} s (median)"
                )
            )
            queued = (row.get("queued") or {}).get(mode)
            found.append(
                check(
                    f"checkpoint stall ({row['training']}, "
                    f"{'background' if mode == 'async' else 'from a host copy'}) / sync save",
                    None if queued else row.get(key),
                    None,
                    STALL_TARGET,
                    queued or detail,
                )
            )
    return found


def offload_checks(rows: dict[str, dict]) -> list[dict]:
    """Offload's peak against the same config's without it, where this call ran both (a --runs visit may run one; a run
    that failed or was skipped fails its own "ran" check, not this one)."""
    found = []
    for plain, offload in OFFLOAD_PAIRS:
        a, b = rows.get(plain, {}).get("peak_allocated"), rows.get(offload, {}).get("peak_allocated")
        if plain in rows and offload in rows and not (rows[plain].get("error") or rows[offload].get("error")):
            found.append(
                check(
                    f"{offload}: peak / {plain}'s peak",
                    round(b / a, 3) if a and b else None,
                    None,
                    0.99,
                    f"{gib(b)} with offload, {gib(a)} without",
                )
            )
    return found


# Where a run's CUDA peak is reached: (label, the peak so far then, what was allocated then), from fsdp_report.json's
# peak_memory (fsdp_recipes.train.sharding: cuda_memory_now). A peak over the estimate is then placed in loading, the
# first forward+backward, the first optimizer step, the steps before the first checkpoint or the checkpoint itself.
PHASE_LABELS = {
    "before_training": "loading and prepare",
    "after_first_backward": "step 1 forward+backward",
    "after_first_step": "step 1 with its optimizer step",
    "before_first_save": "steps before the first save",
    "after_first_save": "the first save",
}


def peak_phases() -> list[tuple[str, str, str]]:
    from fsdp_recipes.train.sharding import CUDA_PHASES, phase_keys

    return [(PHASE_LABELS[phase], *phase_keys(phase)) for phase in CUDA_PHASES]


def phase_table(rows: list[dict]) -> list[str]:
    """For the runs that recorded them: the peak so far / what was allocated, at the end of each phase."""
    measured = [r for r in rows if r.get("phases")]
    if not measured:
        return []
    phases = peak_phases()
    head = ["run"] + [label for label, *_ in phases] + ["end of training"]
    lines = [
        "",
        "Where the CUDA peak is reached: peak so far / allocated, at the end of each phase",
        "",
        "| " + " | ".join(head) + " |",
        "|" + "---|" * len(head),
    ]
    for r in measured:
        cells = [f"{gib(r['phases'].get(peak))} / {gib(r['phases'].get(held))}" for _, peak, held in phases]
        lines.append("| " + " | ".join([r["config"], *cells, gib(r.get("peak_allocated"))]) + " |")
    return lines


def peak_table(rows: list[dict], top: int = 8) -> list[str]:
    """For the profiled runs: what was live at the profiled steps' CUDA peak, by the code that allocated it
    (fsdp_recipes.train.profiling.live_at_peak): offload's peak over its estimate is placed by this."""
    lines = []
    for r in rows:
        at_peak = (r.get("profile") or {}).get("cuda_memory_at_peak")
        if not at_peak:
            continue
        steps = "-".join(str(s) for s in r["profile"].get("steps", []))
        truncated = "; the recorder kept only the newest: the peak may be earlier" if at_peak.get("truncated") else ""
        lines += [
            "",
            f"{r['config']}: live at the CUDA peak of profiled step(s) {steps}, {gib(at_peak['peak_bytes'])} "
            f"allocated, {gib(at_peak['before_recording_bytes'])} of it from before those steps ({at_peak['events']:,} "
            f"allocator events{truncated})",
            "",
            "| bytes | blocks | allocated in | for |",
            "|---|---|---|---|",
        ]
        lines += [
            f"| {gib(g['bytes'])} | {g['blocks']} | {g['allocated_in']} | {g['for']} |" for g in at_peak["groups"][:top]
        ]
        rest = at_peak.get("other_bytes", 0) + sum(g["bytes"] for g in at_peak["groups"][top:])
        if rest:
            lines.append(f"| {gib(rest)} | | elsewhere | |")
    return lines


def gib(n) -> str:
    return "-" if n is None else f"{n / 2**30:.2f} GiB"


def markdown(rows: list[dict], checks: list[dict], notes: list[str]) -> str:
    """report.md: the per-run table, every check with its verdict, and the notes (versions, skips, errors)."""
    head = [
        "run",
        "wrapper",
        "tokens/s",
        "MFU",
        "peak allocated",
        "peak reserved",
        "estimate",
        "states",
        "formula",
        "seconds",
    ]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        cells = [
            r["config"] + (f" ({r['batch']} x {SEQ} tokens)" if r.get("batch") else ""),
            r.get("wrapper") or "-",
            f"{r['tokens_per_second']:,.0f}" if r.get("tokens_per_second") else "-",
            f"{r['mfu']:.1%}" if r.get("mfu") is not None else "-",
            gib(r.get("peak_allocated")),
            gib(r.get("peak_reserved")),
            gib(r.get("estimate_peak")),
            gib(r.get("states_bytes")),
            gib(r.get("estimate_states")),
            f"{r['seconds']:.0f}" if r.get("seconds") else "-",
        ]
        if r.get("error"):
            cells[1:] = [f"FAILED: {r['error']}"] + [""] * (len(head) - 2)
        lines.append("| " + " | ".join(cells) + " |")
    lines += phase_table(rows)
    lines += peak_table(rows)
    lines += ["", "| check | value | wanted | verdict | detail |", "|---|---|---|---|---|"]
    for c in checks:
        wanted = f"{'' if c['low'] is None else c['low']} .. {'' if c['high'] is None else c['high']}".strip()
        lines.append(
            f"| {c['check']} | {'-' if c['value'] is None else c['value']} | {wanted} | "
            f"{'pass' if c['passed'] else 'FAIL'} | {c['detail']} |"
        )
    if notes:
        lines += [""] + [f"- {n}" for n in notes]
    return "\n".join(lines) + "\n"


def log_metrics(log_history: list[dict]) -> tuple[float | None, float | None]:
    """(tokens/s, MFU): medians of the logging windows after the first (which holds the compilation and warm-up)."""
    windows = [e for e in log_history if "tokens_per_second" in e]
    windows = windows[1:] or windows
    tps = statistics.median(e["tokens_per_second"] for e in windows) if windows else None
    mfus = [e["mfu"] for e in windows if e.get("mfu") is not None]
    return tps, statistics.median(mfus) if mfus else None


def tail(text: str, lines: int = 1) -> str:
    """A failed command's own one-line error when it printed one ("...: error: ..."), else its last lines of text."""
    kept = [
        line.strip()
        for line in text.strip().splitlines()
        if re.search(r"[A-Za-z]", line) and not line.startswith(("W1", "I1", "E1"))
    ]
    errors = [line for line in kept if re.match(r"[\w./-]+: error: ", line)]
    return " / ".join((errors or kept)[-lines:])[:400]


def _started(pid: int) -> str | None:
    """A process's start time (field 22 of /proc/PID/stat), which tells it from a later process given its pid."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return None


def signal_group(pgid: int, sig: int) -> None:
    """Signal a process group that may have ended meanwhile (the command finished just at its deadline)."""
    try:
        os.killpg(pgid, sig)
    except ProcessLookupError:
        pass


def process_tree(root: int) -> list[tuple[int, str]]:
    """``root`` and all its descendants now, as (pid, start time), whatever session they started: torch elastic
    starts each worker of accelerate launch and torchrun in a session of its own, out of reach of the group."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                parent = int(Path(entry, "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(parent, []).append(int(entry.name))
    found, todo = [], [root]
    while todo:
        pid = todo.pop()
        if (started := _started(pid)) is not None:
            found.append((pid, started))
            todo += children.get(pid, [])
    return found


def signal_processes(processes: list[tuple[int, str]], sig: int) -> None:
    """Signal each process still the one listed (same pid and start time); one that has ended is no error."""
    for pid, started in processes:
        if _started(pid) == started:
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass


# ---------- the runs (need CUDA) ----------


class Check:
    def __init__(self, output: Path, budget: float):
        self.output, self.deadline = output, time.monotonic() + budget
        self.rows: list[dict] = []
        self.checks: list[dict] = []
        self.notes: list[str] = []
        self.environment: dict = {}
        self.work = Path(tempfile.mkdtemp(prefix="gpu-check-"))
        # --runs: these alone
        self.only: set[str] | None = None
        output.mkdir(parents=True, exist_ok=True)
        (output / "logs.txt").write_text("")

    def left(self) -> float:
        return self.deadline - time.monotonic()

    def log(self, text: str) -> None:
        with open(self.output / "logs.txt", "a") as f:
            f.write(text if text.endswith("\n") else text + "\n")

    def save(self) -> None:
        (self.output / "environment.json").write_text(json.dumps(self.environment, indent=2) + "\n")
        (self.output / "results.json").write_text(
            json.dumps({"rows": self.rows, "checks": self.checks, "notes": self.notes}, indent=2) + "\n"
        )
        title = f"# GPU check: {self.environment.get('gpu', 'no GPU')}\n\n"
        (self.output / "report.md").write_text(title + markdown(self.rows, self.checks, self.notes))

    def run(self, cmd: list[str], seconds: float, cwd: Path = REPO) -> subprocess.CompletedProcess:
        """Run ``cmd`` for at most ``seconds`` (INTERRUPT_GRACE included). At the deadline the command and everything
        it started get SIGINT, so that pytest prints its failures and summary (a kill left "FFFFFFsFF" and no reason:
        bench/results/h200/gpu-check-5), then SIGKILL after the grace; whatever way this returns or raises (Ctrl-C
        included), nothing it started is left running to hold the GPU."""
        env = {
            **os.environ,
            "PYTHONPATH": f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
            "HF_HUB_OFFLINE": "1",
        }
        self.log(f"$ {' '.join(cmd)}")
        # SIGINT as a terminal would deliver it: a check started in the background (`cmd &` in a script) inherits
        # SIGINT ignored, and so would pytest, which then could not print its failures at the deadline
        child = subprocess.Popen(
            cmd,
            cwd=cwd,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            errors="replace",
            start_new_session=True,
            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
        )
        # everything it has started, looked up every TREE_POLL seconds: a launcher that
        seen: dict[int, str] = {}
        # exits leaves its workers without a parent
        deadline = time.monotonic() + max(seconds - INTERRUPT_GRACE, 1)
        try:
            while True:
                seen.update(process_tree(child.pid))
                try:
                    out, err = child.communicate(timeout=max(min(TREE_POLL, deadline - time.monotonic()), 0.01))
                    proc = subprocess.CompletedProcess(cmd, child.returncode, out, err)
                    break
                except subprocess.TimeoutExpired:
                    if time.monotonic() < deadline:
                        continue
                seen.update(process_tree(child.pid))
                signal_processes(seen.items(), signal.SIGINT)
                try:
                    out, err = child.communicate(timeout=INTERRUPT_GRACE)
                except subprocess.TimeoutExpired:
                    seen.update(process_tree(child.pid))
                    signal_processes(seen.items(), signal.SIGKILL)
                    try:
                        out, err = child.communicate(timeout=10)
                    # a process outside the tree holds the pipes: its output is lost
                    except subprocess.TimeoutExpired:
                        child.kill()
                        out, err = "", "its output was lost: a process it started outside its tree held the pipes"
                own = (
                    f" (it exited {child.returncode} on the interrupt)"
                    if child.returncode not in (None, -signal.SIGKILL)
                    else ""
                )
                proc = subprocess.CompletedProcess(
                    cmd, 124, out, err + f"\ntimed out after {seconds:.0f} s (this part's budget){own}"
                )
                break
        finally:
            # what it left running
            signal_processes(list(seen.items()) + process_tree(child.pid), signal.SIGKILL)
            signal_group(child.pid, signal.SIGKILL)
            if child.poll() is None:
                child.kill()
                child.wait()
        self.log(proc.stdout[-4000:] + proc.stderr[-4000:])
        return proc

    # ----- steps -----
    def describe_environment(self) -> None:
        import torch

        env = {
            "python": platform.python_version(),
            # the speed rows' kernels too: not pinned by requirements.txt, recorded as found
            "versions": installed_versions((*PINNED, "liger_kernel", "triton")),
            "pinned": {n: pins().get(norm(n)) for n in PINNED},
            "cuda_available": torch.cuda.is_available(),
            "torch_cuda": torch.version.cuda,
        }
        if torch.cuda.is_available():
            env["gpu"] = torch.cuda.get_device_name()
            env["gpu_memory_bytes"] = torch.cuda.get_device_properties(0).total_memory
            env["bf16"] = torch.cuda.is_bf16_supported()
        if shutil.which("nvidia-smi"):
            smi = subprocess.run(
                ["nvidia-smi", "--query-gpu=name,driver_version,memory.total", "--format=csv,noheader"],
                capture_output=True,
                text=True,
            )
            env["nvidia_smi"] = smi.stdout.strip()
        from fsdp_recipes.compat import internals

        env["moved_private_names"] = internals.check_all()
        self.environment = env
        self.notes += version_lines(env["versions"], pins())
        self.notes += [f"a private name this repository uses moved: {p}" for p in env["moved_private_names"]]

    def pytest_gpu(self, seconds: float) -> None:
        if not self.wanted("pytest"):
            return
        if seconds < 30:
            self.checks.append(
                check("pytest -m gpu: exit status", None, 0, 0, f"not run: {self.left():.0f} s left of the budget")
            )
            return
        proc = self.run(
            [
                sys.executable,
                "-m",
                "pytest",
                "-q",
                "-m",
                "gpu",
                "tests",
                "-p",
                "no:cacheprovider",
                "-rfE",
                "--tb=short",
            ],
            seconds,
        )
        (self.output / "pytest.txt").write_text(proc.stdout[-200_000:] + proc.stderr[-20_000:])
        summary = next(
            (
                line
                for line in reversed(proc.stdout.splitlines())
                if re.search(r"\d+ (passed|failed|error|skipped)", line)
            ),
            "no summary",
        )
        self.checks.append(check("pytest -m gpu: exit status", float(proc.returncode), 0, 0, summary.strip("= ")))

    def model_folder(self) -> Path:
        folder = self.work / "model-1b"
        if not folder.is_dir():
            model_config().save_pretrained(folder)
        return folder

    def train(
        self, label: str, config: str, *args: str, launch: tuple[str, ...] = (), batch: str | None = None
    ) -> tuple[dict, Path | None]:
        row = {"config": label}
        if self.left() < RUN_SECONDS:
            row["error"] = f"not run: {self.left():.0f} s left of this part's budget"
            return row, None
        out = self.work / re.sub(r"[^a-z0-9]+", "-", label.lower())
        cmd = [
            "accelerate",
            "launch",
            "--config_file",
            str(REPO / config),
            "--num_machines",
            "1",
            "--num_processes",
            str(PROCESSES),
            *launch,
            str(REPO / "train_fsdp.py"),
            "--tokenizer_name",
            str(REPO / "assets" / "tiny-llama"),
            "--max_steps",
            str(STEPS),
            "--logging_steps",
            str(LOGGING_STEPS),
            "--per_device_train_batch_size",
            str(BATCH) if batch is None else batch,
            "--block_size",
            str(SEQ),
            "--output_dir",
            str(out),
            "--report_to",
            "none",
            *args,
        ]
        started = time.monotonic()
        proc = self.run(cmd, self.left() - 5)
        row["seconds"] = round(time.monotonic() - started, 1)
        if proc.returncode != 0:
            row["error"] = tail(proc.stderr) or f"exit status {proc.returncode}"
            return row, None
        report = json.loads((out / "fsdp_report.json").read_text())
        rank = report["ranks"][0]
        peak = rank.get("peak_memory", {})
        row.update(
            wrapper=rank.get("wrapper"),
            compiled_modules=rank.get("compiled_modules"),
            fsdp_version=report.get("fsdp_version"),
            states_bytes=sum(rank["bytes"].values()),
            peak_allocated=peak.get("cuda_max_allocated_bytes"),
            peak_reserved=peak.get("cuda_max_reserved_bytes"),
            phases={k: v for k, v in peak.items() if any(k in keys for _, *keys in peak_phases())},
            parameters=report["total_param_elements"],
            checkpoint_writes=report.get("checkpoint_writes"),
        )
        history = json.loads((out / "trainer_state.json").read_text())["log_history"]
        row["tokens_per_second"], row["mfu"] = log_metrics(history)
        if (summary := out / "profile" / "summary.json").is_file():
            row["profile"] = json.loads(summary.read_text())
        return row, out

    def estimate(
        self,
        row: dict,
        config: str,
        lora: bool = False,
        folder: Path | None = None,
        batch: int | None = None,
        fused_loss: bool = False,
    ) -> None:
        import yaml

        from fsdp_recipes.config.memory import Setup, estimate, model_shape
        from fsdp_recipes.config.strategy import strategy_of

        if lora:
            # the formula counts full fine-tuning
            return
        strategy = strategy_of(yaml.safe_load((REPO / config).read_text()))
        est = estimate(
            model_shape(str(folder or self.model_folder())),
            Setup(
                strategy=strategy.memory_strategy_on(PROCESSES),
                nproc_per_node=PROCESSES,
                nnodes=1,
                offload=strategy.offload,
                micro_batch=BATCH if batch is None else batch,
                seq_len=SEQ,
                fused_loss=fused_loss,
            ),
        )
        row.update(
            offload=strategy.offload,
            estimate_peak=est.gpu_total,
            estimate_states=est.params + est.grads + est.optimizer,
        )

    def merge(self, row: dict, out: Path) -> None:
        import torch
        from safetensors.torch import load_file
        from transformers import AutoModelForCausalLM

        from fsdp_recipes.ckpt.merge import merge_checkpoint

        merged = self.work / "merged"
        try:
            merge_checkpoint(out / f"checkpoint-{STEPS}", merged, overwrite=True, log=lambda *_: None)
            model = AutoModelForCausalLM.from_pretrained(merged).state_dict()
            final = load_file(out / "model" / "model.safetensors")
            differ = [n for n in final if not torch.equal(model[n], final[n])]
            row["merge_equal"] = not differ and set(final) <= set(model)
            row["merge_detail"] = f"{len(final)} tensors" + (
                f", {len(differ)} differ ({differ[0]}, ...)" if differ else ", all equal"
            )
        # a check that failed, not a crash of the check
        except Exception as err:
            row["merge_equal"], row["merge_detail"] = False, f"{type(err).__name__}: {str(err)[:300]}"

    def configs(self, configs: list[str]) -> None:
        import torch

        for config in configs:
            if not self.wanted(config):
                continue
            if (
                "hybrid_shard" in config
                and not config.startswith("accelerate_configs/fsdp1")
                and torch.cuda.device_count() < 4
            ):
                self.rows.append({"config": config, "error": "not run: FSDP2 HSDP is 2 replicas x 2+ shards (4 GPUs)"})
                continue
            args = ["--config_name", str(self.model_folder())]
            saves = config in MERGED or config in BACKGROUND_SAVES
            # one checkpoint on disk at a time: ~12 GB each for the 1B model
            args += (
                ["--save_steps", str(STEPS // 2 if config in BACKGROUND_SAVES else STEPS), "--save_total_limit", "1"]
                if saves
                else ["--save_strategy", "no"]
            )
            if config == "accelerate_configs/zero3.yaml":
                # the trace summary: the last timed window is left out
                args += ["--profile_steps", f"{STEPS - 3}-{STEPS - 2}"]
            elif "offload" in config:
                # offload peaks in step 1's forward+backward, about the fp32 model over its estimate (gpu-check-7):
                # the profile of that step says what was live then (its window is left out of tokens/s and MFU)
                args += ["--profile_steps", "1-1"]
            row, out = self.train(config, config, *args)
            if out is not None:
                self.estimate(row, config)
                if config in MERGED:
                    self.merge(row, out)
            self.rows.append(row)
            self.checks += (
                config_checks(row) + staging_checks(row, torch.cuda.is_available())
                if not row.get("error")
                else [check(f"{config}: ran", None, None, None, row["error"])]
            )
            self.remove_run(out)
            self.save()

    def speed(self) -> None:
        """Issue 50's rows: the Llama-3.2-1B shape under SPEED_CONFIG, one run per SPEED_ROWS setting, no checkpoint
        written; tokens/s and MFU of the windows after the first, the batch trained (auto: the estimator's choice),
        the peak against the estimate at that batch, the model states against the formula."""
        if not self.wanted("speed"):
            return
        folder = self.work / "llama-3.2-1b-shape"
        if not folder.is_dir():
            model_config(LLAMA_1B).save_pretrained(folder)
        for label, (batch, flags, launch) in SPEED_ROWS.items():
            row, out = self.train(
                label,
                SPEED_CONFIG,
                "--config_name",
                str(folder),
                "--save_strategy",
                "no",
                *flags,
                launch=launch,
                batch=batch,
            )
            row["levers"] = [name for name, on in (("compile", launch), ("liger", LIGER[0] in flags)) if on]
            if out is not None:
                state = json.loads((out / "trainer_state.json").read_text())
                row["batch"] = state.get("train_batch_size")
                liger = "liger" in row["levers"]
                self.estimate(row, SPEED_CONFIG, folder=folder, batch=row["batch"] or BATCH, fused_loss=liger)
            self.rows.append(row)
            self.checks += (
                config_checks(row) if not row.get("error") else [check(f"{label}: ran", None, None, None, row["error"])]
            )
            # compiled in place: FSDP2's hooks still run around each layer
            if launch and not row.get("error"):
                self.checks.append(
                    check(f"{label}: layers compiled", row["compiled_modules"], 1, None, "modules compiled in place")
                )
            self.remove_run(out)
            self.save()

    def lora(self) -> None:
        if self.wanted("lora"):
            row, out = self.train(
                "LoRA (zero3)",
                "accelerate_configs/zero3.yaml",
                "--config_name",
                str(self.model_folder()),
                "--use_peft",
                "true",
                "--lora_r",
                "16",
                "--lora_alpha",
                "32",
                "--save_strategy",
                "no",
            )
            self.rows.append(row)
            self.checks.append(check("LoRA: ran", 1.0 if out else None, 1, 1, row.get("error", "trained and exported")))
            self.remove_run(out)
            self.save()
        if not self.wanted("qlora"):
            return
        try:
            import bitsandbytes  # noqa: F401
        except ImportError:
            self.rows.append(
                {
                    "config": "QLoRA (zero3)",
                    "error": "not run: bitsandbytes is not installed (its wheel: bench/gpu_wheels.sh)",
                }
            )
            return
        # QLoRA quantizes pre-trained weights: a bf16 folder of the model's (random) weights, as a hub model is
        row, out = self.train(
            "QLoRA (zero3)",
            "accelerate_configs/zero3.yaml",
            "--model_name_or_path",
            str(self.weights_folder()),
            "--dtype",
            "bfloat16",
            "--load_in_4bit",
            "true",
            "--bnb_4bit_quant_type",
            "nf4",
            "--bnb_4bit_compute_dtype",
            "bfloat16",
            "--bnb_4bit_quant_storage",
            "bfloat16",
            "--use_peft",
            "true",
            "--lora_r",
            "16",
            "--lora_alpha",
            "32",
            # the export merges the final sharded save
            "--save_strategy",
            "no",
        )
        self.rows.append(row)
        self.checks.append(check("QLoRA: ran", None if row.get("error") else 1.0, 1, 1, row.get("error", "trained")))
        if out is not None:
            self.qlora_export(row, out)
        self.remove_run(out)
        self.save()

    def qlora_export(self, row: dict, out: Path) -> None:
        """The QLoRA run's model/ is the unquantized base with the adapter merged: it loads without bitsandbytes, and
        equals peft's merge of the exported adapter into that base."""
        import torch
        from peft import PeftModel
        from transformers import AutoModelForCausalLM

        try:
            merged = AutoModelForCausalLM.from_pretrained(out / "model", dtype=torch.bfloat16).state_dict()
            base = AutoModelForCausalLM.from_pretrained(self.weights_folder(), dtype=torch.bfloat16)
            before = {n: t.clone() for n, t in base.state_dict().items()}
            truth = PeftModel.from_pretrained(base, out / "adapter").merge_and_unload().state_dict()
            differ = [n for n in truth if not torch.equal(merged[n], truth[n])]
            moved = sum(not torch.equal(before[n], truth[n]) for n in truth)
            value, detail = (
                float(len(differ)),
                (
                    f"{len(truth)} tensors, {moved} changed by the adapter; "
                    + (
                        f"{len(differ)} differ from peft's merge ({differ[0]}, ...)"
                        if differ
                        else "all equal peft's merge"
                    )
                ),
            )
        # a check that failed, not a crash of the check
        except Exception as err:
            value, detail = None, f"{type(err).__name__}: {str(err)[:300]}"
        self.checks.append(
            check(
                "QLoRA: model/ is the unquantized base + the adapter, as peft merges it (tensors that differ)",
                value,
                0,
                0,
                detail,
            )
        )

    def weights_folder(self) -> Path:
        folder = self.work / "model-1b-weights"
        if not folder.is_dir():
            import torch
            from transformers import AutoModelForCausalLM

            torch.manual_seed(0)
            # 1B parameters initialised in seconds
            with torch.device("cuda" if torch.cuda.is_available() else "cpu"):
                model = AutoModelForCausalLM.from_config(model_config(), dtype=torch.bfloat16)
            model.save_pretrained(folder)
        return folder

    def wanted(self, name: str) -> bool:
        return self.only is None or name in self.only

    def scaling(self) -> None:
        if not self.wanted("scaling"):
            return
        if self.left() < 120:
            self.notes.append(f"bench/scaling.py not run: {self.left():.0f} s left of this part's budget")
            return
        folder = self.work / "scaling"
        proc = self.run(
            [
                sys.executable,
                str(REPO / "bench" / "scaling.py"),
                "--output",
                str(folder),
                "--quick",
                "--nproc",
                "1",
                "--strategy",
                "accelerate_configs/zero3.yaml",
                "--strategy",
                "accelerate_configs/ddp.yaml",
                "--no-overhead",
            ],
            self.left() - 5,
        )
        for name in ("scaling.md", "scaling.json"):
            if (folder / name).is_file():
                shutil.copy(folder / name, self.output / name)
        self.checks.append(
            check(
                "bench/scaling.py on 1 GPU: exit status",
                float(proc.returncode),
                0,
                0,
                tail(proc.stderr) if proc.returncode else "scaling.md",
            )
        )

    def stall(self) -> None:
        """Issue 22's target on a GPU: a background save's stall at most 20% of a synchronous save's, measured by
        bench/checkpoint_benchmark.py with room between saves for the write (1.06 GB model, a save every 100 steps)."""
        if not self.wanted("stall"):
            return
        if self.left() < STALL_SECONDS:
            self.notes.append(
                f"bench/checkpoint_benchmark.py not run: {self.left():.0f} s left of this part's budget, it "
                f"needs {STALL_SECONDS}"
            )
            return
        folder = self.output / "checkpoint-stall"
        proc = self.run(
            [
                sys.executable,
                str(REPO / "bench" / "checkpoint_benchmark.py"),
                *STALL_ARGS,
                "--output",
                str(folder),
                "--work",
                str(self.work / "stall"),
            ],
            self.left() - 5,
        )
        results = folder / "results.json"
        if proc.returncode != 0 or not results.is_file():
            self.checks.append(
                check("checkpoint stall: ran", None, None, None, tail(proc.stderr) or f"exit status {proc.returncode}")
            )
            return
        self.checks += stall_checks(json.loads(results.read_text()))

    def remove_run(self, out: Path | None) -> None:
        """A run's checkpoints and exported model take GBs of the machine's 64: only the numbers are kept."""
        from fsdp_recipes.removal import remove_inside

        if out is not None:
            remove_inside(self.work, out.name, "gpu check work")


def make_work(check_run: Check) -> None:
    from fsdp_recipes.removal import make_folder

    make_folder(check_run.work, "gpu check work", exist_ok=True)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], epilog=__doc__.split("\n\n", 1)[1], formatter_class=RawHelpFormatter
    )
    parser.add_argument(
        "--part",
        choices=("1", "2", "all"),
        help="1: environment, the speed rows, pytest -m gpu, FSDP2 configs; 2: FSDP1 and DDP "
        "configs, LoRA, QLoRA, scaling, the checkpoint stall; all: both in one budget, what matters most first "
        "(a visit of one command)",
    )
    parser.add_argument("--output", type=Path, help="folder for the report (e.g. $OUT on the device machine)")
    parser.add_argument(
        "--budget",
        type=float,
        default=560,
        help="seconds this part may take; what would not fit is skipped, with the reason",
    )
    parser.add_argument(
        "--runs",
        help="comma-separated: only these of the part's runs (config paths as listed in this file, speed: issue 50's "
        "1B-shape rows, lora, qlora, pytest, scaling, stall: issue 22's checkpoint stall), for a short second visit",
    )
    parser.add_argument(
        "--wheel-list",
        action="store_true",
        help="print the wheels bench/gpu_wheels.sh downloads, one per line, and exit",
    )
    parser.add_argument(
        "--install-wheels",
        action="store_true",
        help="first pip-install (--no-index --no-deps) the carried wheels of "
        "bench/wheels that this Python lacks or holds in another version (default: install nothing)",
    )
    args = parser.parse_args(argv)
    if args.wheel_list:
        print("\n".join(wheel_list()))
        return 0
    runs = {"speed", "lora", "qlora", "pytest", "scaling", "stall", *FSDP2, *FSDP1}
    asked = None if args.runs is None else {r.strip() for r in args.runs.split(",") if r.strip()}
    if asked is not None and (unknown := sorted(asked - runs) or ([] if asked else ["(none)"])):
        parser.error(f"--runs: {unknown[0]!r} is not one of the runs: {', '.join(sorted(runs))}")
    if args.part is None or args.output is None:
        parser.error("give --part 1, 2 or all and --output FOLDER (or --wheel-list)")
    part_runs = {"1": {"speed", "pytest", *FSDP2}, "2": {"lora", "qlora", "scaling", "stall", *FSDP1}, "all": runs}[
        args.part
    ]
    if asked and (elsewhere := sorted(asked - part_runs)):
        parser.error(
            f"--runs: {elsewhere[0]!r} is not run by --part {args.part}: give --part all, or the part that runs it"
        )
    # NaN is not equal to itself
    if not (args.budget == args.budget and 0 < args.budget < float("inf")):
        parser.error(f"--budget {args.budget}: give the seconds this part may take, a positive number (e.g. 560)")
    if args.output.is_symlink() or (args.output.exists() and not args.output.is_dir()):
        parser.error(f"--output {args.output} is not a folder: give a new or empty folder for the report")
    if args.output.is_dir() and any(args.output.iterdir()):
        parser.error(
            f"--output {args.output} is not empty: give a new or empty folder (the report's files would mix "
            "with what is there)"
        )

    import torch

    from fsdp_recipes.removal import is_ours, remove

    # before anything is installed: the wheels are for the GPU machine's Python
    if not torch.cuda.is_available():
        print(
            "gpu_check.py: error: no CUDA device here: run it on the GPU machine (the device tool); the CPU "
            "tests cover the rest",
            file=sys.stderr,
        )
        return 1
    check_run = Check(args.output, args.budget)
    check_run.only = asked
    try:
        make_work(check_run)
        if args.install_wheels:
            check_run.notes += install_wheels(check_run.log)
        check_run.describe_environment()
        check_run.save()
        if args.part == "1":
            check_run.speed()
            check_run.pytest_gpu(
                check_run.left() - 10 if asked == {"pytest"} else min(300, check_run.left() - 3 * RUN_SECONDS)
            )
            check_run.configs(FSDP2)
        elif args.part == "2":
            check_run.configs(FSDP1)
            check_run.lora()
            check_run.scaling()
            check_run.stall()
        else:
            check_run.speed()
            check_run.configs(ALL_FIRST)
            check_run.lora()
            check_run.configs(ALL_THEN)
            check_run.pytest_gpu(check_run.left() - 10 if asked == {"pytest"} else min(240, check_run.left() - 10))
            check_run.configs(ALL_LAST)
            check_run.scaling()
            check_run.stall()
        check_run.checks += offload_checks({r["config"]: r for r in check_run.rows})
        check_run.save()
    finally:
        if is_ours(check_run.work, "gpu check work"):
            remove(check_run.work, "gpu check work")
    failed = [c["check"] for c in check_run.checks if not c["passed"]]
    print(
        f"gpu_check part {args.part}: {len(check_run.checks) - len(failed)} of {len(check_run.checks)} checks "
        f"passed; report: {args.output / 'report.md'}"
    )
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
