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


def _errors_inside(err: BaseException, out: Path) -> list[BaseException]:
    """``err``, its causes, each rank's error a CheckpointException holds (as (error, trace)) and a RuntimeError's
    context (torch.save's C++ writer raises its own over the write's OSError); not an OSError naming a file outside
    ``out`` (a full /dev/shm is not output_dir's disk)."""
    found, todo, root = [], [err], os.path.realpath(out)
    while todo:
        e = todo.pop()
        if not isinstance(e, BaseException) or any(e is f for f in found):
            continue
        name = e.filename if isinstance(e, OSError) else None
        elsewhere = isinstance(name, (str, bytes, os.PathLike)) and not Path(
            os.path.realpath(os.fsdecode(name))
        ).is_relative_to(root)
        if elsewhere:
            continue
        found.append(e)
        failures = getattr(e, "failures", None)
        ranks = failures.values() if isinstance(failures, dict) else ()
        todo += [e.__cause__, *(f[0] if isinstance(f, tuple) and f else f for f in ranks)]
        if isinstance(e, RuntimeError):
            todo.append(e.__context__)
    return found


def disk_full_problem(err: BaseException, output_dir: str | os.PathLike, export: bool = False) -> str | None:
    """The one line for a save that ran out of disk or of quota (None when ``err`` is something else), known by the
    write's errno. Where no errno is left, a full disk is a guess made only when less is free than a checkpoint takes
    (1 MB, before the first): safetensors keeps only the message, torch.save to a path not even that (its zip
    writer's "unexpected pos", or its stream's "iostream error"). ``export``: it was the final model's (training had
    finished; a resume of the finished run writes it again without training)."""
    import errno

    def mb(n: float) -> str:
        return f"{n / 1e6:.1f} MB"

    out = Path(output_dir)
    errors = _errors_inside(err, out)
    codes = {e.errno for e in errors if isinstance(e, OSError)}
    # not str: CheckpointException.__str__ fails on a failure not a pair
    said = " ".join(map(repr, errors))
    quota = errno.EDQUOT in codes or os.strerror(errno.EDQUOT) in said
    errno_less = os.strerror(errno.ENOSPC) in said or (
        not codes and ("unexpected pos" in said or "iostream error" in said)
    )
    if not (quota or errno.ENOSPC in codes or errno_less):
        # before reading output_dir: any other error of the run passes through here
        return None
    free = shutil.disk_usage(out).free
    chosen, _ = newest_resumable(out)
    size = sum(f.stat().st_size for f in Path(chosen.path).rglob("*") if f.is_file()) if chosen else 0
    kept = f"{Path(chosen.path).name} is intact" if chosen else "no complete checkpoint was written yet"
    # the filesystem's free space says nothing about a quota
    if quota:
        where, room, fix = f"disk quota exceeded on {out}", "", "free space within your quota (or move output_dir)"
        need = f"a checkpoint takes {mb(size)}"
    elif errno.ENOSPC in codes or (errno_less and free < max(size, 1e6)):
        where, room, fix = f"no space left on {out}", f" ({mb(free)} free)", "free space (or move output_dir)"
        need = f"a checkpoint takes {mb(size)}, {mb(free)} is free: {mb(max(size - free, 0))} more"
    else:
        return None
    if export:
        return (
            f"{where} while writing the final model{room}; training had finished and {kept}: {fix}, then run the "
            "same command with --resume_from_checkpoint true (it writes the model again, without training)"
        )
    if chosen is None:
        return f"{where}{room} and {kept}; {fix}, then {how_to_go_on(out)}"
    return f"{where}: {need}; {kept}: {fix}, then run the same command with --resume_from_checkpoint true"
