"""Which checkpoint a run resumes from, and what the run may do to the checkpoints already in its output_dir.

Decides only: a later checkpoint a resume replaces, an incomplete one it skips, the checkpoints
``--overwrite_output_dir`` deletes come back as lists (``SetAside``, paths) that the training script's preflight
(fsdp_recipes.train.preflight) carries out on rank 0 once every check on every rank has passed. Nothing here
moves or deletes anything.

A checkpoint this version cannot read (a dtype or class another torch version wrote: ``status.may_be_complete``) may
be good: a resume stops at it, in one line, rather than passing over it or setting it aside, and no message offers
the flag that deletes it. So does one holding model weights only (``status.weights_only``: save_only_model's), which is
a model and cannot resume a run; neither kind (``status.may_be_good``) is ever on ``--overwrite_output_dir``'s list.

A launch makes one resume decision: ``decide`` (every file of the checkpoints it weighs, every rank's RNG state
once) runs on global rank 0 after the process group starts, and the other ranks take it. Each rank then compares
what it sees without reading a file (``sight``: the newest checkpoint-N name, the chosen folder), and
``disagreement`` turns the ranks' sights into the one line every rank stops with when they differ (a network
filesystem's attribute cache can show nodes different folders).
"""

from __future__ import annotations

import os
import socket
from pathlib import Path
from typing import NamedTuple

from fsdp_recipes.bounded import load_json
from fsdp_recipes.ckpt.hub_source import is_local
from fsdp_recipes.ckpt.layout import (
    HARD_LINK,
    INCOMPLETE_PREFIX,
    REPLACED_PREFIX,
    RUN_RECORD,
    another_tools_run,
    checkpoint_steps,
    checkpoint_unlike,
    foreign_entries,
    is_checkpoint_folder,
    overlap,
    real,
    step_of_name,
)
from fsdp_recipes.ckpt.status import checkpoint_status, newest_resumable
from fsdp_recipes.console import say
from fsdp_recipes.errors import RecipeError


class SetAside(NamedTuple):
    """A checkpoint to move out of the way (renamed with ``prefix``; nothing is deleted), and why."""

    path: Path
    prefix: str
    why: str


class Resume(NamedTuple):
    """What ``--resume_from_checkpoint`` decided: the checkpoint (None: no resume) and what to set aside first."""

    path: str | None
    set_aside: list[SetAside]


def requested(value: str | None) -> bool:
    """``--resume_from_checkpoint`` asks for a resume (true, or a path)."""
    return value is not None and str(value).lower() != "false"


def explicit(value: str | None) -> str | None:
    """The checkpoint path ``--resume_from_checkpoint`` names, None for true, false or unset."""
    return str(value) if requested(value) and str(value).lower() != "true" else None


def resolve_resume(value: str | None, output_dir: str, trainer_fsdp: bool = False, say=say) -> Resume:
    """``true``: the newest complete checkpoint-N in output_dir (newer, incomplete ones are named and set aside);
    a path: that checkpoint, which must be complete (an earlier one of output_dir sets the later ones aside);
    ``false`` or unset: no resume. Reads every file of each checkpoint it weighs: in a launch, global rank 0 alone
    calls it (``decide``)."""
    if not requested(value):
        return Resume(None, [])
    if str(value).lower() == "true":
        chosen, skipped = newest_resumable(output_dir) if Path(output_dir).is_dir() else (None, [])
        # never passed over for an older one
        if blocked := next((s for s in skipped if s.may_be_good), None):
            earlier = (
                (
                    f", or resume an earlier checkpoint explicitly with --resume_from_checkpoint {chosen.path} (later "
                    "checkpoints are then moved aside, never deleted)"
                )
                if chosen
                else ""
            )
            if blocked.weights_only:
                raise RecipeError(
                    f"--resume_from_checkpoint true: the newest checkpoint in {output_dir!r} cannot resume: "
                    f"{blocked.weights_only_line()}{earlier}; nothing was skipped, set aside or deleted"
                )
            raise RecipeError(
                f"--resume_from_checkpoint true: {Path(blocked.path).name} in {output_dir!r} is unreadable by "
                "this version "
                f"({blocked.unreadable}); another torch version wrote it, and it may be complete, so nothing "
                "was skipped, "
                f"set aside or deleted: resume with the torch version that wrote it{earlier}"
            )
        refuse_moving_aside([Path(s.path) for s in skipped], output_dir)
        for status in skipped:
            say(f"skipping {status.summary()}")
        if chosen is None:
            what = f" (incomplete: {', '.join(Path(s.path).name for s in skipped)})" if skipped else ""
            raise RecipeError(
                f"--resume_from_checkpoint true: no complete checkpoint-N folder in output_dir {output_dir!r}{what}; "
                "start without --resume_from_checkpoint"
            )
        return Resume(
            _resumable(chosen, trainer_fsdp, say),
            [SetAside(Path(s.path), INCOMPLETE_PREFIX, "incomplete") for s in skipped],
        )
    if not Path(value).is_dir():
        raise RecipeError(
            f"--resume_from_checkpoint {value!r} is not a folder: give a checkpoint-N folder, or true for the latest"
        )
    status = checkpoint_status(value)
    if status.weights_only:
        raise RecipeError(f"cannot resume from {value}: {status.weights_only_line()}")
    if not status.resumable:
        chosen, _ = newest_resumable(Path(value).parent)
        # summary(): why this version cannot read it, and the fix
        if status.may_be_complete:
            instead = f"; or resume from {chosen.path}, the newest checkpoint this version reads" if chosen else ""
            raise RecipeError(f"cannot resume from {status.summary()}{instead}")
        instead = f"resume from {chosen.path} (the newest complete one) or" if chosen else "start"
        raise RecipeError(f"cannot resume from {status.summary()}; {instead} without it")
    later = later_checkpoints(Path(value), output_dir)
    refuse_moving_aside([aside.path for aside in later], output_dir)
    return Resume(_resumable(status, trainer_fsdp, say), later)


def refuse_moving_aside(folders: list[Path], output_dir: str) -> None:
    """An incomplete or replaced checkpoint is renamed out of the way; a folder that only has a checkpoint's name (a
    user's notes, a saved model, a link) is not one to rename: the resume stops, naming it, before anything moves. An
    empty one (a save killed before its first file) is still a checkpoint's."""
    for folder in folders:
        if (unlike := checkpoint_unlike(folder)) and unlike != "it is empty":
            raise RecipeError(
                f"{folder} is named like a checkpoint but is not one ({unlike}): a resume would move it aside "
                f"with the incomplete ones; move it out of output_dir {output_dir!r} and run again (nothing was moved)"
            )


# output_dir: the newest checkpoint each requeued attempt of a job started from
REQUEUE_RECORD = "requeue_progress.json"


MAX_STALLED_REQUEUES = 3


def check_requeue(output_dir: str, resume: str | None) -> dict | None:
    """A job SLURM requeued (SLURM_RESTART_COUNT > 0) that starts from the same checkpoint as its last attempt made no
    progress: after MAX_STALLED_REQUEUES such starts in a row it stops instead of looping forever (the time limit
    is too short to reach the next checkpoint, or the job fails before its first step). Returns the record preflight
    writes (rank 0); None outside a requeued job."""
    restart = os.environ.get("SLURM_RESTART_COUNT", "0")
    if not restart.isdigit() or int(restart) == 0:
        return None
    step = (step_of_name(resume) or 0) if resume else 0
    try:
        last = load_json(Path(output_dir) / REQUEUE_RECORD, REQUEUE_RECORD, 4096)
        last_step, stalled = int(last["step"]), int(last["stalled"])
    except (OSError, ValueError, KeyError, TypeError):
        last_step, stalled = -1, 0
    stalled = stalled + 1 if step <= last_step else 0
    if stalled >= MAX_STALLED_REQUEUES:
        raise RecipeError(
            f"requeued {stalled} times in a row without a new checkpoint (each attempt started from "
            f"{Path(resume).name if resume else 'no checkpoint'}): not starting again; give the job a longer "
            "time limit "
            f"or checkpoint more often (save_steps), then delete {Path(output_dir) / REQUEUE_RECORD} and resubmit"
        )
    return {"restart": int(restart), "step": step, "stalled": stalled}


class Decision(NamedTuple):
    """Global rank 0's resume decision, which every rank of the launch takes (``decide``)."""

    # the checkpoint to resume from; None: no resume
    path: str | None
    set_aside: list[SetAside]
    # check_requeue's record, written to output_dir by rank 0
    requeue_record: dict | None
    # what the decision has to say (checkpoints skipped, a resharded resume), said once it stands
    notes: list[str]
    # the one line the launch stops with (a RecipeError's text); None when it may go on
    error: str | None


def decide(value: str | None, output_dir: str, trainer_fsdp: bool = False) -> Decision:
    """``resolve_resume`` and ``check_requeue`` as one Decision: what they say is kept for later (the other ranks may
    yet disagree), a refusal becomes ``error``. The reading part of a resume: run it on global rank 0 only."""
    notes: list[str] = []
    try:
        resume = resolve_resume(value, output_dir, trainer_fsdp, say=notes.append)
        return Decision(resume.path, resume.set_aside, check_requeue(output_dir, resume.path), notes, None)
    except RecipeError as err:
        return Decision(None, [], None, notes, str(err))
    # rank 0 alone decides: whatever stops it must reach every rank as the decision's error
    except Exception as err:
        return Decision(
            None,
            [],
            None,
            notes,
            f"the resume could not be decided ({type(err).__name__}: {err}); "
            "check output_dir and --resume_from_checkpoint",
        )


class Sight(NamedTuple):
    """What one rank sees of a resume, from folder names alone (no file is read): compared across ranks."""

    host: str
    # ``true``: the newest checkpoint-N folder in output_dir (None: none)
    newest: str | None
    # the checkpoint rank 0 chose (or the path given) is a folder here
    found: bool


def sight(value: str | None, output_dir: str, chosen: str | None) -> Sight:
    """This rank's Sight of the resume ``value`` asks for, given rank 0's choice ``chosen``."""
    if explicit(value) is not None:
        return Sight(socket.gethostname(), None, Path(value).is_dir())
    out = Path(output_dir)
    steps = checkpoint_steps(out) if out.is_dir() else []
    return Sight(socket.gethostname(), steps[0].name if steps else None, chosen is not None and Path(chosen).is_dir())


def disagreement(value: str | None, output_dir: str, chosen: str | None, sights: list[Sight]) -> str | None:
    """The one line for ranks that do not see the resume as global rank 0 does (``sights[r]``: rank r's), or None.
    Every rank computes it from the same gathered sights, so all stop alike, before anything is moved."""
    first = sights[0]
    others = [(rank, s) for rank, s in enumerate(sights) if (s.newest, s.found) != (first.newest, first.found)]
    if not others:
        return None
    rank, other = others[0]
    more = f" (and {len(others) - 1} more rank(s))" if len(others) > 1 else ""
    (seen, seen_host), (unseen, unseen_host) = ((0, first.host), (rank, other.host))[:: 1 if first.found else -1]
    if (path := explicit(value)) is not None:
        what = (
            f"--resume_from_checkpoint {path!r} is a folder for rank {seen} ({seen_host}) and not for rank {unseen} "
            f"({unseen_host}){more}"
        )
    elif other.newest != first.newest:
        what = (
            f"--resume_from_checkpoint true: in output_dir {output_dir!r} rank 0 ({first.host}) sees "
            f"{first.newest or 'no checkpoint-N folder'} as the newest checkpoint, rank {rank} ({other.host}) sees "
            f"{other.newest or 'no checkpoint-N folder'}{more}"
        )
    else:
        what = (
            f"--resume_from_checkpoint true: rank 0 ({first.host}) chose {Path(chosen).name} in output_dir "
            f"{output_dir!r}, which rank {seen} ({seen_host}) sees and rank {unseen} ({unseen_host}) does not{more}"
        )
    return (
        f"{what}: the ranks must see the same checkpoints (a network filesystem's attribute cache can show nodes "
        "an older folder: wait for it, or mount output_dir without attribute caching, e.g. NFS actimeo=0), then run "
        "the same command again; nothing was moved or deleted"
    )


def later_checkpoints(ckpt: Path, output_dir: str) -> list[SetAside]:
    """Resuming an earlier checkpoint of this output_dir starts another branch of the run: its later checkpoints
    would be rewritten in place (the Trainer saves into checkpoint-N as it finds it) or, being newer, picked by
    the next `--resume_from_checkpoint true`. They are moved aside as replaced-checkpoint-N; nothing is deleted."""
    if real(ckpt.parent) != real(output_dir) or step_of_name(ckpt) is None:
        return []
    step = int(ckpt.name.split("-")[1])
    return [
        SetAside(later, REPLACED_PREFIX, f"resuming {ckpt.name} starts a new branch of the run")
        for later in checkpoint_steps(Path(output_dir))
        if int(later.name.split("-")[1]) > step
    ]


def _resumable(status, trainer_fsdp: bool, say=say) -> str:
    """The checkpoint path, after checking it fits this launch."""
    # imports torch: not at the toolkit's import time
    from fsdp_recipes.compat import cpu_fsdp

    world = int(os.environ.get("WORLD_SIZE", "1"))
    if status.state_dict_type == "SHARDED_STATE_DICT" and not (cpu_fsdp.fsdp_requested() or trainer_fsdp):
        raise RecipeError(
            f"{status.path} holds FSDP shards: resume it under FSDP (`accelerate launch --config_file "
            "accelerate_configs/<config>.yaml train_fsdp.py ...`), or merge it with tools/merge_checkpoint.py and "
            "fine-tune from the merged folder"
        )
    if status.state_dict_type == "PLAIN" and (cpu_fsdp.fsdp_requested() or trainer_fsdp):
        raise RecipeError(
            f"{status.path} was saved without FSDP (DDP or ZeRO-1): resume it with the same launch (`accelerate launch "
            "--config_file accelerate_configs/ddp.yaml train_fsdp.py ...`), or start an FSDP run from its weights with "
            f"--model_name_or_path {status.path}"
        )
    if status.world_size and status.world_size != world:
        say(
            f"{Path(status.path).name} was saved by {status.world_size} processes, this run has {world}: the shards "
            "are resharded on load; ranks without a saved RNG state start from the seed, and the data order follows "
            "the new global batch size (keep per_device_train_batch_size x processes equal to continue the same order)"
        )
    return status.path


def check_output_dir(
    output_dir: str,
    resuming: bool,
    overwrite: bool,
    resume: str | None = None,
    inputs: dict[str, str | None] | None = None,
) -> list[Path]:
    """A new run must not write into another run's checkpoints: a later `resume true` would pick theirs, rotation
    would delete them. Nor may output_dir be, hold or lie inside a local input (the final model would replace the
    model it was trained from). A resume from a checkpoint outside output_dir is a new run for this check.
    Returns the checkpoint folders of an earlier run that ``--overwrite_output_dir`` deletes (checked here to hold
    only checkpoint files; the preflight deletes them)."""
    if not str(output_dir).strip():
        raise RecipeError(
            "output_dir is empty: give a folder for checkpoints and the final model, e.g. --output_dir runs/my-run"
        )
    out = Path(output_dir)
    if out.exists() and not out.is_dir():
        raise RecipeError(f"output_dir {output_dir!r} is a file: choose a folder (it is created if missing)")
    existing = next(p for p in (out, *out.absolute().parents) if p.exists())
    if not os.access(existing, os.W_OK | os.X_OK):
        raise RecipeError(f"output_dir {output_dir!r}: {existing} is not writable: choose a folder you can write to")
    for key, source in (inputs or {}).items():
        if source and is_local(source) and overlap(real(output_dir), real(source)):
            how = (
                "is"
                if real(output_dir) == real(source)
                else "is inside"
                if real(source) in real(output_dir).parents
                else "holds"
            )
            raise RecipeError(
                f"output_dir {output_dir!r} {how} {key} {source!r}: the run's model folder would replace or "
                "mix with its input; choose another --output_dir"
            )
    if out.is_dir() and (foreign := foreign_entries(out)):
        shown = ", ".join(foreign[:4]) + (f" and {len(foreign) - 4} more" if len(foreign) > 4 else "")
        if another_tools_run(out):
            raise RecipeError(
                f"output_dir {output_dir!r} holds another tool's model or run ({shown}; no {RUN_RECORD}, which "
                "every run of this repository writes first): this run would overwrite its records and mix its model "
                "with this one's; choose an empty or new --output_dir (the folder is left as it is)"
            )
        linked = [e.removesuffix(f" ({HARD_LINK})") for e in foreign if e.endswith(f" ({HARD_LINK})")]
        # its own records, linked to files elsewhere (cp -al run run.bak)
        if len(linked) == len(foreign):
            raise RecipeError(
                f"output_dir {output_dir!r} holds records that are hard links ({', '.join(linked[:4])}"
                f"{' and more' if len(linked) > 4 else ''}): this run would rewrite them, and the other names' "
                "files with "
                "them; give each a file of its own (cp F F.tmp && mv F.tmp F), or choose a new --output_dir"
            )
        raise RecipeError(
            f"output_dir {output_dir!r} holds files a training run does not write ({shown}): the run "
            "would write (or replace) its checkpoints, model/ and adapter/ among them; move them out of "
            f"output_dir{' (a hard link: give it a file of its own)' if linked else ''}, or choose an empty or "
            "new --output_dir"
        )
    if resuming and resume is not None and real(resume).parent != real(output_dir):
        # another folder's checkpoint: this output_dir starts a new line of checkpoints
        resuming = False
    if resuming or not out.is_dir():
        return []
    earlier = (
        checkpoint_steps(out)
        + sorted(out.glob(f"{INCOMPLETE_PREFIX}checkpoint-*"))
        + sorted(out.glob(f"{REPLACED_PREFIX}checkpoint-*"))
    )
    if not earlier:
        return []
    if resume is not None:
        raise RecipeError(
            f"output_dir {output_dir!r} holds another run's checkpoints ({earlier[0].name}, ...) and the resume "
            "comes from "
            f"{resume}: its new checkpoints would mix with them (and rotation delete them); resume into the "
            "checkpoint's "
            "own folder, or choose an empty --output_dir"
        )
    foreign = [p for p in earlier if not is_checkpoint_folder(p)]
    if not overwrite:
        names = ", ".join(p.name for p in earlier[:3]) + (", ..." if len(earlier) > 3 else "")
        statuses = [checkpoint_status(p) for p in earlier]
        # a model: never offered for deletion
        if model := next((s for s in statuses if s.weights_only), None):
            good = next((s for s in statuses if s.resumable), None)
            resume = f"; or resume {good.path} by its path (--resume_from_checkpoint {good.path})" if good else ""
            raise RecipeError(
                f"output_dir {output_dir!r} already holds another run's checkpoints ({names}); "
                f"{model.weights_only_line()}"
                f"{resume}; or choose a new --output_dir (nothing was deleted)"
            )
        # never offer to delete what may be good
        if unread := next((s for s in statuses if s.may_be_complete), None):
            raise RecipeError(
                f"output_dir {output_dir!r} already holds another run's checkpoints ({names}); "
                f"{Path(unread.path).name} "
                f"may be complete but is unreadable by this version ({unread.unreadable}): resume it with the torch "
                "version that wrote it, or choose a new --output_dir"
            )
        if good := [s for s in statuses if s.resumable]:
            # what `true` looks at; a folder set aside is resumed by its path
            newest = set(checkpoint_steps(out))
            how = "true" if any(Path(s.path) in newest for s in good) else good[0].path
            raise RecipeError(
                f"output_dir {output_dir!r} already holds another run's checkpoints ({names}): resume it with "
                f"--resume_from_checkpoint {how}, or choose a new --output_dir"
            )
        # only what that flag would delete
        delete = "" if foreign else ", or pass --overwrite_output_dir true to delete them"
        raise RecipeError(
            f"output_dir {output_dir!r} already holds another run's checkpoints ({names}), none of them "
            "complete: resume "
            f"is not possible; choose a new --output_dir{delete}"
        )
    if foreign:
        raise RecipeError(
            f"--overwrite_output_dir: {foreign[0]} is not a training checkpoint holding nothing else "
            f"({checkpoint_unlike(foreign[0])}): "
            "refusing to delete it; move what you want to keep out of it, or choose a new --output_dir"
        )
    # what may be good is never on the list: the run stops, nothing deleted
    for status in map(checkpoint_status, earlier):
        if status.weights_only:
            raise RecipeError(
                f"--overwrite_output_dir: refusing to delete {status.path}, which may be a good model: "
                f"{status.weights_only_line()}; or move it out of output_dir {output_dir!r}, or choose a new "
                "--output_dir (nothing was deleted)"
            )
        if status.may_be_complete:
            raise RecipeError(
                f"--overwrite_output_dir: refusing to delete {status.path}, which may be complete: it is unreadable "
                f"by this version ({status.unreadable}); resume it with the torch version that wrote it, move it "
                f"out of output_dir {output_dir!r}, or choose a new --output_dir (nothing was deleted)"
            )
    return earlier
