"""What this repository's per-step additions cost, measured inside a real run: tokens/s logging, the precision and
sharding contract check, and the preemption flag's all-reduce, against the run's own step time.

    python bench/overhead.py [--steps 30] [--hidden 512 --layers 8] [--config accelerate_configs/zero3.yaml]

It launches train_fsdp.py (2 processes, FSDP over gloo on CPU, or the GPUs) through a wrapper that times each
of those pieces with perf_counter on every rank, logging at every step (the worst case), on a Llama built from a
config (default ~20M parameters, so the step does real work; --hidden 64 --layers 4 is the tiny default model).
It prints one row per piece: seconds over the run on the slowest rank and the share of the training time.
Target: the logging and the contract check together under 1% of step time.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from fsdp_recipes.console import RawHelpFormatter

REPO = Path(__file__).resolve().parent.parent
# what is timed: class path -> method
TIMED = {
    "throughput logging": [
        ("fsdp_recipes.train.metrics", "Throughput", "count"),
        ("fsdp_recipes.train.metrics", "Throughput", "window"),
    ],
    "contract check (start, first step)": [
        ("fsdp_recipes.train.sharding", "ShardingReport", "on_train_begin"),
        ("fsdp_recipes.train.sharding", "ShardingReport", "on_pre_optimizer_step"),
        ("fsdp_recipes.train.sharding", "ShardingReport", "on_step_end"),
    ],
    "preemption flag all-reduce": [("fsdp_recipes.train.preemption", "Preemption", "on_step_end")],
}
WRAPPER = """
import atexit, importlib, json, os, runpy, sys, time
timings = {}
for piece, targets in json.loads(os.environ["OVERHEAD_TIMED"]).items():
    for module, cls, name in targets:
        owner = getattr(importlib.import_module(module), cls)
        original = getattr(owner, name)
        def timed(*args, __original=original, __piece=piece, **kwargs):
            start = time.perf_counter()
            try:
                return __original(*args, **kwargs)
            finally:
                timings[__piece] = timings.get(__piece, 0.0) + time.perf_counter() - start
        setattr(owner, name, timed)
import fsdp_recipes.train.trainer as trainer_module
train = trainer_module.FSDPTrainer.train
def timed_train(self, *args, **kwargs):
    start = time.perf_counter()
    try:
        return train(self, *args, **kwargs)
    finally:
        timings["training (the whole train() call)"] = time.perf_counter() - start
        path = os.path.join(os.environ["OVERHEAD_OUT"], f"rank{os.environ['RANK']}.json")
        open(path, "w").write(json.dumps(timings))
trainer_module.FSDPTrainer.train = timed_train
sys.argv[0] = os.path.join(os.environ["OVERHEAD_REPO"], "train_fsdp.py")
runpy.run_path(sys.argv[0], run_name="__main__")
"""


def model_config(folder: Path, hidden: int, layers: int) -> Path:
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(REPO / "assets" / "tiny-llama")
    config.hidden_size, config.num_hidden_layers = hidden, layers
    config.intermediate_size = hidden * 8 // 3 // 16 * 16
    config.num_attention_heads = config.num_key_value_heads = max(1, hidden // 64)
    config.save_pretrained(folder)
    return folder


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__.splitlines()[0], formatter_class=RawHelpFormatter, epilog=__doc__
    )
    parser.add_argument(
        "--config",
        default="accelerate_configs/zero3.yaml",
        help="accelerate config of the run, relative to the repository",
    )
    parser.add_argument("--steps", type=int, default=30, help="optimizer steps of the run")
    parser.add_argument("--hidden", type=int, default=512, help="model width (the Llama of assets/tiny-llama, resized)")
    parser.add_argument("--layers", type=int, default=8, help="decoder layers")
    parser.add_argument("--nproc", type=int, default=2, help="processes")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        (tmp / "timings").mkdir()
        (tmp / "wrapper.py").write_text(WRAPPER)
        config = model_config(tmp / "model", args.hidden, args.layers)
        env = {
            **os.environ,
            "OVERHEAD_TIMED": json.dumps(TIMED),
            "OVERHEAD_OUT": str(tmp / "timings"),
            "OVERHEAD_REPO": str(REPO),
        }
        cmd = [
            "accelerate",
            "launch",
            "--config_file",
            str(REPO / args.config),
            "--num_processes",
            str(args.nproc),
            str(tmp / "wrapper.py"),
            "--config_name",
            str(config),
            "--tokenizer_name",
            str(REPO / "assets" / "tiny-llama"),
            "--max_steps",
            str(args.steps),
            "--logging_steps",
            "1",
            "--save_steps",
            str(10 * args.steps),
            "--output_dir",
            str(tmp / "run"),
        ]
        proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True)
        if proc.returncode != 0:
            print(proc.stderr[-4000:], file=sys.stderr)
            return 1
        ranks = [json.loads(p.read_text()) for p in sorted((tmp / "timings").glob("rank*.json"))]
        params = json.loads((tmp / "run" / "fsdp_report.json").read_text())["total_param_elements"]
    total = max(r["training (the whole train() call)"] for r in ranks)
    print(
        f"{args.config}, {args.nproc} processes, Llama {params / 1e6:.1f}M parameters (hidden {args.hidden}, "
        f"{args.layers} layers), "
        f"{args.steps} steps logged at every step; training took {total:.2f} s ({total / args.steps * 1000:.0f} "
        "ms per step)\n"
    )
    print("| piece | seconds (slowest rank) | share of training time |")
    print("| --- | --- | --- |")
    for piece in TIMED:
        seconds = max(r.get(piece, 0.0) for r in ranks)
        print(f"| {piece} | {seconds:.4f} | {seconds / total:.3%} |")
    ours = max(sum(r.get(p, 0.0) for p in ("throughput logging", "contract check (start, first step)")) for r in ranks)
    print(f"\nthroughput logging + contract check: {ours / total:.3%} of training time (target: under 1%)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
