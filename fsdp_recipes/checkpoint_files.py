"""Names and layout of the checkpoints the tools read and training writes. Imports nothing beyond the standard
library: training code, tools/check_checkpoint.py and the merge all start from here, and none of them should pay
for torch or transformers to learn a file name."""

from __future__ import annotations

import os
import re
from pathlib import Path

DCP_MODEL_DIR = "pytorch_model_fsdp_0"  # accelerate's sharded model folder in a checkpoint-N
OPTIMIZER_DIR = "optimizer_0"
FULL_MODEL_FILE = "pytorch_model_fsdp.bin"  # accelerate's FULL_STATE_DICT model
FULL_OPTIMIZER_FILE = "optimizer.bin"
FULL_FILES = ("model.safetensors.index.json", "model.safetensors", FULL_MODEL_FILE)
PLAIN_OPTIMIZER_FILE = "optimizer.pt"  # the Trainer's own layout without FSDP (DDP, ZeRO-1 consolidated, one process)
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")
ADAPTER_CONFIG = "adapter_config.json"  # peft
REPORT_NAME = "fsdp_report.json"  # the proof of sharding, per run and per checkpoint (fsdp_recipes.checks)
MANIFEST = "model_description.json"  # written into each checkpoint by the training run (fsdp_recipes.description)
INCOMPLETE_PREFIX = "incomplete-"  # outside the Trainer's `checkpoint-*` glob: never rotated, never resumed
REPLACED_PREFIX = "replaced-"  # a checkpoint of a step a resumed run trains again (another branch of the run)
# FSDP1, torch.compile and activation checkpointing put these inside parameter names
WRAPPER_PREFIXES = ("_fsdp_wrapped_module.", "_orig_mod.", "_checkpoint_wrapped_module.")


class CheckpointError(ValueError):
    """Bad input: the message names the problem and the fix, on one line."""


def checkpoint_steps(run_dir: Path) -> list[Path]:
    """A run folder's checkpoint-N folders, newest first."""
    found = [p for p in Path(run_dir).glob("checkpoint-*") if p.is_dir() and re.fullmatch(r"checkpoint-\d+", p.name)]
    return sorted(found, key=lambda p: int(p.name.split("-")[1]), reverse=True)


def training_content(folder: Path) -> str | None:
    """What in ``folder`` a training run or checkpoint would lose if the folder were replaced (None: nothing).
    Looks one level deep: a run folder holds checkpoint-N folders, a checkpoint holds shards and trainer state."""
    folder = Path(folder)
    if not folder.is_dir():
        return None
    if steps := checkpoint_steps(folder):
        return f"training checkpoints ({steps[0].name}, ...)"
    for name in (DCP_MODEL_DIR, OPTIMIZER_DIR, "trainer_state.json", FULL_MODEL_FILE, FULL_OPTIMIZER_FILE, PLAIN_OPTIMIZER_FILE, ".metadata"):
        if (folder / name).exists():
            return f"a training checkpoint ({name})"
    if any(folder.glob("*.distcp")) or any(folder.glob(f"{INCOMPLETE_PREFIX}checkpoint-*")) or any(folder.glob(f"{REPLACED_PREFIX}checkpoint-*")):
        return "training checkpoint files"
    return None


def real(path: str | os.PathLike) -> Path:
    """The path with every symlink and `..` resolved, also when it does not exist yet."""
    return Path(os.path.realpath(os.path.expanduser(path)))


def overlap(a: Path, b: Path) -> bool:
    """Real paths a and b are the same folder, or one holds the other."""
    return a == b or a in b.parents or b in a.parents
