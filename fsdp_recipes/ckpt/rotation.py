"""Checkpoints moved out of a run's way: ``set_aside`` (an incomplete one, renamed beside it, nothing deleted) and
``rotate`` (save_total_limit: the oldest complete ones deleted by step, never the best nor the newest, and only
folders that hold nothing but a checkpoint).
"""

from __future__ import annotations

import os
from pathlib import Path

from fsdp_recipes.ckpt.layout import (
    CHECKPOINT_PURPOSE,
    INCOMPLETE_PREFIX,
    checkpoint_steps,
    checkpoint_unlike,
    is_checkpoint_folder,
    real,
)
from fsdp_recipes.errors import RefusedRemoval
from fsdp_recipes.removal import move, remove


def set_aside(ckpt: Path, prefix: str = INCOMPLETE_PREFIX) -> Path:
    """Move a checkpoint out of the Trainer's way (a resumed run rewrites that step into a clean folder, and
    rotation never counts it). Nothing is deleted: an earlier folder set aside for the same step stays beside it
    (an "incomplete" one may still be the only copy of something; the user decides)."""
    target = ckpt.parent / f"{prefix}{ckpt.name}"
    n = 1
    while target.exists() or target.is_symlink():
        target = ckpt.parent / f"{prefix}{ckpt.name}.{n}"
        n += 1
    return move(ckpt, target)


def rotate(
    run_dir: str | os.PathLike, limit: int | None, keep: str | None = None, warn=print, keep_newest: bool = True
) -> list[Path]:
    """Delete the oldest checkpoints beyond ``limit`` by step (mtime misleads on fuse and network filesystems), never
    ``keep``
    (the best) nor, with ``keep_newest``, the newest; only checkpoints holding nothing else
    (layout.is_checkpoint_folder).
    Any other folder, or one that will not go, is kept and named through ``warn``, never stopping a run. Returns what
    went."""
    if not limit or limit <= 0:
        return []
    steps = []
    # newest first; another folder does not cost a checkpoint its place
    for ckpt in checkpoint_steps(Path(run_dir)):
        if (why := checkpoint_unlike(ckpt)) is None:
            steps.append(ckpt)
        else:
            warn(f"save_total_limit: kept {ckpt.name}, not a checkpoint holding nothing else ({why}); move it away")
    protected = {steps[0]} if steps and keep_newest else set()
    if keep:
        protected |= {p for p in steps if real(p) == real(keep)}
    deleted, tried = [], 0
    for ckpt in reversed(steps):
        if len(steps) - tried <= max(limit, len(protected)):
            break
        if ckpt not in protected:
            # a folder that would not go still counts: a newer one is never deleted in its place
            tried += 1
            try:
                remove(ckpt, CHECKPOINT_PURPOSE, shape=is_checkpoint_folder)
                deleted.append(ckpt)
            # a file held open over NFS, a permission: never worth a run
            except (OSError, RefusedRemoval) as err:
                warn(f"save_total_limit: could not delete {ckpt.name} ({err}); delete it yourself")
    return deleted
