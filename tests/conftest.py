"""Shared helpers: real `accelerate launch` runs of train_fsdp.py on CPU, one at a time."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
CONFIG_DIR = REPO / "accelerate_configs"
ALL_CONFIGS = sorted(p.relative_to(REPO).as_posix() for p in CONFIG_DIR.rglob("*.yaml"))
# Fast test settings on top of the default recipe: enough steps for the loss to fall, one mid-run checkpoint.
QUICK = ["--max_steps", "12", "--save_steps", "6", "--logging_steps", "2", "--warmup_steps", "2", "--save_total_limit", "3"]


def run(cmd: list[str], cwd: Path = REPO, timeout: int = 600, env: dict | None = None) -> subprocess.CompletedProcess:
    full_env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false", **(env or {})}
    return subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=timeout, env=full_env)


def launch(config: str, *script_args: str, launch_args: tuple[str, ...] = (), cwd: Path = REPO, check: bool = True):
    """`accelerate launch --config_file CONFIG [launch_args] train_fsdp.py [script_args]`."""
    cmd = ["accelerate", "launch", "--config_file", str(REPO / config), *launch_args, str(REPO / "train_fsdp.py"), *script_args]
    proc = run(cmd, cwd=cwd)
    if check and proc.returncode != 0:
        pytest.fail(f"launch failed ({proc.returncode}): {' '.join(cmd)}\n--- stderr tail ---\n{proc.stderr[-6000:]}")
    return proc


def read_json(path: Path) -> dict:
    return json.loads(Path(path).read_text())


def logged_losses(output_dir: Path) -> list[float]:
    history = read_json(output_dir / "trainer_state.json")["log_history"]
    return [entry["loss"] for entry in history if "loss" in entry]


@pytest.fixture(scope="session")
def python() -> str:
    return sys.executable
