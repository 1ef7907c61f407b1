"""Calibrate tools/estimate_memory.py against real FSDP (and DDP, ZeRO-1) training on CPU.

    python bench/estimate_calibration.py [--nproc 2 --nproc 4] [--config accelerate_configs/zero3.yaml ...]

For each shipped config and process count it trains the tiny default model for 2 steps (real FSDP over gloo),
reads each rank's measured bytes of parameters, gradients and optimizer state from fsdp_report.json, and
prints them beside the estimate (16 bytes per parameter split by the strategy) with the ratio. Target:
model-state bytes within 5% of measured for every strategy. About 15 s per launch.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import yaml

from fsdp_recipes.config.memory import Setup, estimate, model_shape
from fsdp_recipes.config.strategy import strategy_of
from fsdp_recipes.console import HelpFormatter

REPO = Path(__file__).resolve().parent.parent

CONFIGS = sorted(p.relative_to(REPO).as_posix() for p in (REPO / "accelerate_configs").rglob("*.yaml"))


def launch_args(config: str, nproc: int) -> list[str]:
    cfg = yaml.safe_load((REPO / config).read_text())
    args = ["--num_processes", str(nproc), "--num_machines", "1"]
    # FSDP2 HSDP: 2 replicas of nproc/2 shards
    if cfg.get("parallelism_config"):
        args += ["--parallelism_config_dp_replicate_size", "2", "--parallelism_config_dp_shard_size", str(nproc // 2)]
    return args


def cpu_setup(config: str, nproc: int, zero1: bool = False) -> tuple[Setup, str]:
    """The setup the estimate should describe on this CPU machine, and a note where it differs from a GPU node."""
    cfg = yaml.safe_load((REPO / config).read_text())
    # accelerate_configs/ddp.yaml
    if "fsdp_config" not in cfg:
        return Setup(strategy=strategy_of(cfg, zero1).name, nproc_per_node=nproc), ""
    # as launch_args launches it: 2 replicas of nproc/2 shards
    if cfg.get("parallelism_config"):
        cfg = {
            **cfg,
            "parallelism_config": {
                "parallelism_config_dp_replicate_size": 2,
                "parallelism_config_dp_shard_size": nproc // 2,
            },
        }
    strategy = strategy_of(cfg)
    name, note = strategy.memory_strategy, ""
    if strategy.fsdp_version == 2:
        if name == "HYBRID_SHARD":
            note = "2 replicas on one machine: shard group nproc/2"
        setup = Setup(
            strategy=name,
            nproc_per_node=nproc // 2 if name == "HYBRID_SHARD" else nproc,
            nnodes=2 if name == "HYBRID_SHARD" else 1,
        )
    # FSDP1 HYBRID_SHARD on one machine: its node's processes are the shard group (cpu_fsdp on CPU)
    else:
        setup = Setup(strategy=strategy.memory_strategy_on(nproc, nproc), nproc_per_node=nproc)
    if strategy.offload:
        note = (note + "; " if note else "") + "offload: the states are on CPU either way here"
    return setup, note


def measure(config: str, nproc: int, out: Path, zero1: bool = False) -> dict:
    cmd = [
        "accelerate",
        "launch",
        "--config_file",
        str(REPO / config),
        *launch_args(config, nproc),
        str(REPO / "train_fsdp.py"),
        "--max_steps",
        "2",
        "--save_steps",
        "1000",
        "--logging_steps",
        "1",
        "--output_dir",
        str(out),
        *(["--zero1", "true"] if zero1 else []),
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    if proc.returncode != 0:
        sys.exit(f"failed: {' '.join(cmd)}\n{proc.stderr[-3000:]}")
    return json.loads((out / "fsdp_report.json").read_text())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0], formatter_class=HelpFormatter)
    parser.add_argument("--nproc", type=int, action="append", help="processes (repeatable; default 2 and 4)")
    parser.add_argument("--config", action="append", help="configs to run (default: all shipped)")
    args = parser.parse_args()
    shape = model_shape(str(REPO / "assets" / "tiny-llama"))
    print(
        "| config | N | measured params / grads / optimizer per rank (bytes) | estimate | model states ratio | note |"
    )
    print("|---|---|---|---|---|---|")
    worst = 0.0
    with tempfile.TemporaryDirectory() as tmp:
        for config in args.config or CONFIGS:
            cfg = yaml.safe_load((REPO / config).read_text())
            for nproc, zero1 in [
                (n, z) for n in args.nproc or [2, 4] for z in ([False, True] if "fsdp_config" not in cfg else [False])
            ]:
                if cfg.get("parallelism_config") and nproc < 4:
                    # HSDP needs 2 replicas x 2+ shards
                    continue
                report = measure(config, nproc, Path(tmp) / f"{config.replace('/', '_')}-{nproc}-{zero1}", zero1)
                setup, note = cpu_setup(config, nproc, zero1)
                note = "--zero1 true" + (f"; {note}" if note else "") if zero1 else note
                est = estimate(shape, setup)
                measured = max(
                    r["bytes"]["params"] + r["bytes"]["grads"] + r["bytes"]["optimizer"] for r in report["ranks"]
                )
                rank = max(report["ranks"], key=lambda r: sum(r["bytes"].values()))["bytes"]
                predicted = est.params + est.grads + est.optimizer
                ratio = predicted / measured
                worst = max(worst, abs(ratio - 1))
                print(
                    f"| {config} | {nproc} | {rank['params']:,} / {rank['grads']:,} / {rank['optimizer']:,} | "
                    f"{est.params:,.0f} / {est.grads:,.0f} / {est.optimizer:,.0f} | {ratio:.4f} | {note} |"
                )
    print(f"\nlargest deviation of the model-state estimate: {worst * 100:.2f}% (target: 5%)")


if __name__ == "__main__":
    main()
