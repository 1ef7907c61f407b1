"""Time the final export of a real training run of a model of a chosen size, under a short --ddp_timeout.

    python bench/export_benchmark.py --size 3GB [--ranks 2] [--save_dtype bfloat16] [--ddp_timeout 60] [--workdir DIR]

Writes a Llama config of about --size of fp32 weights (bench/synthetic.py's shapes, the tiny tokenizer's
vocabulary), trains it for one SGD step with `accelerate launch --config_file accelerate_configs/zero3.yaml
--num_processes R --mixed_precision no train_fsdp.py ... --ddp_timeout T` (SGD: no Adam state, so the model
fits where Adam's would not; 8 tokens, fp32 compute: the step stays short on a CPU), then prints the launch's exit
status, wall time, the export's own numbers from fsdp_report.json (dtype,
ranks that wrote shards, shards, bytes, seconds; per rank: its files and seconds) and whether
AutoModelForCausalLM.from_pretrained loads the folder. Before issue 21 the export of a model whose conversion
took longer than T ended in a collective timeout after training had succeeded. Needs about 3x the size in free
disk (the DCP copy and the folder) and memory for the fp32 weights and gradients on the machine.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from synthetic import TINY, llama_config

from fsdp_recipes.console import HelpFormatter

REPO = Path(__file__).resolve().parent.parent


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=HelpFormatter)
    parser.add_argument("--size", default="3GB", help="fp32 weight bytes, e.g. 3GB")
    parser.add_argument("--ranks", type=int, default=2, help="processes of the run that writes the checkpoint")
    parser.add_argument("--save_dtype", default="auto", help="train_fsdp.py --save_dtype of the exported model")
    parser.add_argument(
        "--ddp_timeout", type=int, default=60, help="train_fsdp.py --ddp_timeout, seconds a collective may wait"
    )
    parser.add_argument("--hidden", type=int, default=2048, help="model width; the layer count follows from --size")
    parser.add_argument("--mixed_precision", default="no", help="bf16 compute is slow on CPUs without bf16 units")
    parser.add_argument("--workdir", default="/tmp/export-bench", help="folder for the model and the run")
    args = parser.parse_args()
    from transformers import AutoTokenizer

    from fsdp_recipes.compat import internals

    work = Path(args.workdir)
    if work.exists():
        sys.exit(f"export_benchmark.py: error: {work} exists: choose another --workdir")
    config_dir, out = work / "config", work / "run"
    config = llama_config(
        internals.get("huggingface_hub.serialization._base.parse_size_to_int")(args.size),
        hidden=args.hidden,
        vocab=len(AutoTokenizer.from_pretrained(TINY)),
    )
    config.max_position_embeddings = 128
    config.save_pretrained(config_dir)
    cmd = [
        "accelerate",
        "launch",
        "--config_file",
        str(REPO / "accelerate_configs" / "zero3.yaml"),
        "--num_processes",
        str(args.ranks),
        "--mixed_precision",
        args.mixed_precision,
        str(REPO / "train_fsdp.py"),
        "--config_name",
        str(config_dir),
        "--tokenizer_name",
        str(TINY),
        "--output_dir",
        str(out),
        "--max_steps",
        "1",
        "--save_steps",
        "1000",
        "--optim",
        "sgd",
        "--warmup_steps",
        "0",
        "--per_device_train_batch_size",
        "1",
        "--block_size",
        "8",
        "--logging_steps",
        "1",
        "--ddp_timeout",
        str(args.ddp_timeout),
        "--save_dtype",
        args.save_dtype,
    ]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p)}
    started = time.monotonic()
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
    wall = time.monotonic() - started
    (work / "launch.log").write_text(proc.stdout + proc.stderr)
    report = json.loads((out / "fsdp_report.json").read_text()) if (out / "fsdp_report.json").is_file() else {}
    params = report.get("total_param_elements")
    print(
        f"model: {params:,} parameters ({config.num_hidden_layers} layers, hidden {config.hidden_size}), "
        f"{args.ranks} ranks, "
        f"--ddp_timeout {args.ddp_timeout}, --save_dtype {args.save_dtype}"
        if params
        else f"model: {config.num_hidden_layers} layers"
    )
    print(f"launch: exit {proc.returncode} in {wall:.0f} s (log: {work / 'launch.log'})")
    print("export: " + json.dumps(report.get("export")))
    if proc.returncode == 0:
        from transformers import AutoModelForCausalLM

        started = time.monotonic()
        model = AutoModelForCausalLM.from_pretrained(out / "model")
        print(
            f"from_pretrained: loads, {model.dtype}, {sum(p.numel() for p in model.parameters()):,} parameters, "
            f"in {time.monotonic() - started:.0f} s"
        )
    sys.exit(proc.returncode)


if __name__ == "__main__":
    main()
