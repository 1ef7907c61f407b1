"""The line a run that stopped before its end closes with: what to run next as its output_dir is now
(``how_to_go_on``), and, for a save that ran out of disk, how much space a checkpoint takes (``disk_full_problem``).
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from fsdp_recipes.ckpt.status import newest_resumable


def how_to_go_on(output_dir: str | os.PathLike) -> str:
    """What to run after a run stopped before its end, as its output_dir is now: resume from the newest complete
    checkpoint, or, with none complete (the first save was cut short), start again (a resume would find nothing, and a
    plain start refuses a folder holding checkpoints)."""
    chosen, skipped = newest_resumable(Path(output_dir))
    # one that may be good stops `--resume_from_checkpoint true` (fsdp_recipes.ckpt.resume) and is never offered
    # for deletion
    if maybe := next((s for s in skipped if s.may_be_good), None):
        earlier = (
            f"; or resume {Path(chosen.path).name} by its path: --resume_from_checkpoint {chosen.path}"
            if chosen
            else ""
        )
        if maybe.weights_only:
            return f"{maybe.weights_only_line()}{earlier}"
        return (
            f"{Path(maybe.path).name} may be complete but is unreadable by this version ({maybe.unreadable}): resume "
            f"it with the torch version that wrote it{earlier}, or choose a new --output_dir"
        )
    if chosen is not None:
        return f"run the same command with --resume_from_checkpoint true to continue from {Path(chosen.path).name}"
    if not skipped:
        return "no checkpoint was saved yet: run the same command again to start over"
    cut = ", ".join(Path(s.path).name for s in skipped)
    return (
        f"no checkpoint is complete ({cut} cut short): run the same command with --overwrite_output_dir true to "
        "start over (it deletes only those and our run's records there), or choose a new --output_dir"
    )


def disk_full_problem(err: BaseException, output_dir: str | os.PathLike, export: bool = False) -> str | None:
    """The one line for a save that ran out of disk (None when ``err`` is something else): torch.save reports it as
    "unexpected pos" from its zip writer, DCP wraps the OSError of one of its writer threads. ``export``: it was the
    final model's (training had finished; a resume of the finished run writes it again without training)."""
    import errno

    text = f"{err!r} {getattr(err, '__cause__', None)!r}"
    full = (
        (isinstance(err, OSError) and err.errno == errno.ENOSPC) or "No space left" in text or "unexpected pos" in text
    )
    if not full:
        return None
    out = Path(output_dir)
    free = shutil.disk_usage(out).free
    chosen, _ = newest_resumable(out)
    size = sum(f.stat().st_size for f in Path(chosen.path).rglob("*") if f.is_file()) if chosen else 0
    need = (
        f"a checkpoint takes {size / 1e6:.1f} MB, {free / 1e6:.1f} MB is free: {max(size - free, 0) / 1e6:.1f} MB more"
        if chosen
        else f"{free / 1e6:.1f} MB is free"
    )
    kept = f"{Path(chosen.path).name} is intact" if chosen else "no complete checkpoint was written yet"
    if export:
        return (
            f"no space left on {out} while writing the final model ({free / 1e6:.1f} MB free); training had "
            "finished and "
            f"{kept}: free space, then run the same command with --resume_from_checkpoint true (it writes the model "
            "again, without training)"
        )
    if chosen is None:
        return f"no space left on {out}: {need} and {kept}; free space, then {how_to_go_on(out)}"
    return (
        f"no space left on {out}: {need}; {kept}: free space (or move output_dir), then run the same command "
        "with --resume_from_checkpoint true"
    )
