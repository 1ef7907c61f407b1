"""Training checkpoints: is a ``checkpoint-N`` folder complete and resumable (``checkpoint_status``, one
``CheckpointStatus`` verdict), and which one a resume uses (``newest_resumable``).

The Trainer writes a checkpoint in place, in this order: model shards (every rank, then ``.metadata``),
optimizer shards (likewise), ``scheduler.pt`` (rank 0), one ``rng_state_<rank>.pth`` per rank, then
``trainer_state.json`` (rank 0), and our ``fsdp_report.json`` once every rank is done. A job killed
in between leaves a folder that looks like a checkpoint; resuming from it would either crash or, worse,
silently restart the optimizer (the Trainer skips optimizer files it does not find). Completeness is
therefore judged file by file (fsdp_recipes.ckpt.checkpoint_files), against the DCP metadata's own list of shards
and byte ranges.

A checkpoint whose metadata names a dtype or DCP class the installed torch does not know (another torch version
wrote it) is neither: it is "unreadable by this version" (``CheckpointStatus.unreadable``). Nothing says it is
incomplete, and a resume stops at it rather than passing over it (fsdp_recipes.ckpt.resume).

A checkpoint holding complete model weights (safetensors: ``model.safetensors``, or an index and every shard it
names, each header as safetensors reads it and matching the folder's config.json; or peft's adapter) and no optimizer
state at all is "weights only" (``CheckpointStatus.weights_only``): what ``save_only_model`` writes, the stock
Trainer's and ours. It cannot resume a run (the optimizer would start from nothing), and it is a model: never passed
over or set aside by a resume, never offered to or deleted by ``--overwrite_output_dir`` (``may_be_good``). That
verdict comes from the weights alone (checkpoint_files.weights_problems): a trainer_state.json that is missing, cut
short or not a mapping is listed among the problems, and changes nothing of it. One whose weights are not all there
or not what their headers or config say stays incomplete.
"""

from __future__ import annotations

import os
import re
from dataclasses import asdict, dataclass, field
from pathlib import Path

from fsdp_recipes.bounded import REPORT_LIMIT, STATE_LIMIT, load_json, short_json
from fsdp_recipes.ckpt.checkpoint_files import (
    PICKLED_SHARD,
    PICKLED_WEIGHTS,
    RNG_KEYS,
    WEIGHTS_ONLY,
    adapter_only,
    dcp_problems,
    torch_file_problem,
    weights_only_layout,
    weights_problems,
)
from fsdp_recipes.ckpt.layout import (
    DCP_MODEL_DIR,
    FULL_MODEL_FILE,
    FULL_OPTIMIZER_FILE,
    OPTIMIZER_DIR,
    PLAIN_OPTIMIZER_FILE,
    REPORT_NAME,
    checkpoint_steps,
    step_of_name,
)
from fsdp_recipes.ckpt.shard_digests import digest_problems
from fsdp_recipes.errors import CheckpointError, UnknownToThisVersion, UnreadableFile


@dataclass
class CheckpointStatus:
    path: str
    step: int | None = None
    # SHARDED_STATE_DICT, FULL_STATE_DICT or PLAIN (saved without FSDP: DDP, ZeRO-1)
    state_dict_type: str | None = None
    # from our fsdp_report.json; None for checkpoints other scripts wrote
    fsdp_version: int | None = None
    sharding_strategy: str | None = None
    world_size: int | None = None
    problems: list[str] = field(default_factory=list)
    # why this version cannot read it (UnknownToThisVersion.reason): another torch version wrote it; not a problem
    unreadable: str | None = None
    # a LoRA run's sharded model: "adapter only" (the frozen base is the base model's) or "whole model"; None otherwise
    lora: str | None = None
    # an adapter-only checkpoint's base, as the run recorded it (ckpt.base_identity)
    base_model: str | None = None
    # complete model weights and no optimizer state (state_dict_type WEIGHTS_ONLY, save_only_model's): a model,
    # not resumable
    weights_only: bool = False

    @property
    def resumable(self) -> bool:
        return not self.problems and not self.unreadable and not self.weights_only

    @property
    def may_be_complete(self) -> bool:
        """Nothing found missing or damaged, but this version cannot read all of it: never skipped or set aside."""
        return bool(self.unreadable) and not self.problems

    @property
    def may_be_good(self) -> bool:
        """Not resumable, yet it may be good: never passed over, set aside, offered to or deleted by
        --overwrite_output_dir."""
        return self.may_be_complete or self.weights_only

    def weights_only_fix(self) -> str:
        """What to do with a weights-only checkpoint instead of resuming it (no deleting flag)."""
        if adapter_only(Path(self.path)):
            return (
                "it is a LoRA adapter: load it onto its base model with peft "
                f"(PeftModel.from_pretrained(base, {str(self.path)!r}))"
            )
        start = (
            f"start a new run from it with --model_name_or_path {self.path} (and a new --output_dir), or "
            if (Path(self.path) / "config.json").is_file()
            else ""
        )
        return f"it is a model: {start}merge it into a model folder with tools/merge_checkpoint.py {self.path} OUT"

    def weights_only_line(self) -> str:
        """Why a weights-only checkpoint does not resume, and what to do with it instead (one line)."""
        return (
            f"{Path(self.path).name} holds model weights only, no optimizer state (as save_only_model writes), "
            "so it cannot "
            f"resume a run; {self.weights_only_fix()}"
        )

    def summary(self) -> str:
        name = Path(self.path).name
        what = ", ".join(
            part
            for part in (
                f"step {self.step}" if self.step is not None else None,
                f"FSDP{self.fsdp_version}" if self.fsdp_version else None,
                self.sharding_strategy,
                self.state_dict_type,
                f"LoRA {self.lora}" + (f" (base {self.base_model})" if self.base_model else "") if self.lora else None,
                f"{self.world_size} rank(s)" if self.world_size else None,
            )
            if part
        )
        if self.resumable:
            verdict = "resumable"
        elif self.weights_only:
            verdict = (
                f"WEIGHTS ONLY (complete model weights, no optimizer state, as save_only_model writes): cannot resume "
                f"a run; {self.weights_only_fix()}"
            )
            if self.problems:
                verdict += f"; also: {'; '.join(self.problems)}"
        elif self.problems:
            verdict = (
                "INCOMPLETE: "
                + "; ".join(self.problems)
                + (f"; and unreadable by this version: {self.unreadable}" if self.unreadable else "")
            )
        else:
            verdict = (
                f"UNREADABLE BY THIS VERSION ({self.unreadable}): another torch version wrote it, and it "
                f"may be complete; {UnknownToThisVersion.FIX}"
            )
        return f"{name} ({what}): {verdict}" if what else f"{name}: {verdict}"

    def to_dict(self) -> dict:
        return {
            **asdict(self),
            "resumable": self.resumable,
            "may_be_complete": self.may_be_complete,
            "may_be_good": self.may_be_good,
        }


def checkpoint_status(ckpt: str | os.PathLike) -> CheckpointStatus:
    """Everything a resume needs, checked without loading a tensor."""
    ckpt = Path(ckpt)
    status = CheckpointStatus(str(ckpt))
    if not ckpt.is_dir():
        status.problems.append(f"{ckpt} is not a folder")
        return status
    try:
        _check(ckpt, status)
    # a file vanished while we looked (another rank set the folder aside)
    except OSError as err:
        status.problems.append(f"unreadable: {err.strerror} ({Path(err.filename or ckpt).name})")
    return status


# processes; the rank files checked below are named from it, one per rank
MAX_WORLD_SIZE = 65536


def _whole(value, low: int, high: int | None) -> bool:
    """A JSON whole number (not true/false, not 2.0) in low..high."""
    return type(value) is int and value >= low and (high is None or value <= high)


def _read_report(path: Path, status: CheckpointStatus) -> str | None:
    """fsdp_report.json's fsdp_version, world_size and sharding_strategy into ``status``, each checked for its type
    and range first (world_size names the rank files looked for); or the problem, with nothing taken from it."""
    try:
        info = load_json(path, REPORT_NAME, REPORT_LIMIT)
    except UnreadableFile as err:
        return f"unreadable {REPORT_NAME} ({err.reason})"
    version, world, strategy = info.get("fsdp_version"), info.get("world_size"), info.get("sharding_strategy")
    if version is not None and not _whole(version, 1, 2):
        return f"unreadable {REPORT_NAME} (fsdp_version {short_json(version)} is not 1 or 2)"
    if "world_size" in info and not _whole(world, 1, MAX_WORLD_SIZE):
        return (
            f"unreadable {REPORT_NAME} (world_size {short_json(world)} is not a number of processes from 1 "
            f"to {MAX_WORLD_SIZE})"
        )
    if strategy is not None and not (isinstance(strategy, str) and len(strategy) <= 40):
        return f"unreadable {REPORT_NAME} (sharding_strategy {short_json(strategy)} is not a strategy name)"
    status.fsdp_version, status.world_size, status.sharding_strategy = version, world, strategy
    return None


def _check(ckpt: Path, status: CheckpointStatus) -> None:
    if not weights_only_layout(ckpt) and not any(
        (ckpt / name).exists()
        for name in ("trainer_state.json", DCP_MODEL_DIR, OPTIMIZER_DIR, FULL_MODEL_FILE, PLAIN_OPTIMIZER_FILE)
    ):
        status.problems.append("not a training checkpoint (no trainer_state.json, model or optimizer state)")
        return
    report = ckpt / REPORT_NAME
    # optional, but when there, sound
    if os.path.lexists(report) and (problem := _read_report(report, status)):
        status.problems.append(problem)

    state = ckpt / "trainer_state.json"
    # trainer_state.json, which the Trainer writes last, is there and readable: the save finished
    finished = False
    if not os.path.lexists(state):
        status.problems.append("missing trainer_state.json (the Trainer writes it last: the save did not finish)")
    else:
        try:
            trainer_state = load_json(state, "trainer_state.json", STATE_LIMIT)
        except UnreadableFile as err:
            status.problems.append(f"unreadable trainer_state.json ({err.reason})")
        else:
            finished = True
            step = trainer_state.get("global_step")
            if _whole(step, 0, None):
                status.step = step
            elif "global_step" not in trainer_state:
                status.problems.append("unreadable trainer_state.json (no global_step)")
            else:
                status.problems.append(
                    f"unreadable trainer_state.json (global_step {short_json(step)} is not a step number, a "
                    "whole number of at least 0)"
                )
        name_step = step_of_name(ckpt)
        if status.step is not None and name_step is not None and status.step != name_step:
            status.problems.append(f"trainer_state.json says step {status.step}, the folder name step {name_step}")

    ranks: set[int] = set()
    fsdp_files = (
        (ckpt / DCP_MODEL_DIR).is_dir() or (ckpt / OPTIMIZER_DIR).is_dir() or (ckpt / FULL_MODEL_FILE).is_file()
    )
    pickled = sorted(p.name for p in ckpt.iterdir() if p.name in PICKLED_WEIGHTS or PICKLED_SHARD.fullmatch(p.name))
    if pickled and finished and not fsdp_files:
        # transformers 4's save_safetensors=false, or peft's .bin adapter: a model we never unpickle, so
        # cannot judge; it
        # may be good, so never skipped, set aside or deleted (may_be_complete)
        status.state_dict_type = "PICKLED_WEIGHTS"
        status.unreadable = (
            f"its weights are pickle files ({', '.join(pickled[:2])}), which this repository never unpickles; "
            "convert them to safetensors where you trust the file, or move the checkpoint out of output_dir"
        )
        return
    # save_only_model's: judged by its weights alone (no scheduler or RNG state either)
    if weights_only_layout(ckpt):
        status.state_dict_type = WEIGHTS_ONLY
        if weights := weights_problems(ckpt):
            status.problems += [f"model weights: {p}" for p in weights]
        # from the weights alone: a trainer_state.json missing or unreadable is said, and protects nothing less
        else:
            status.weights_only = True
        if changes := _recorded_changes(ckpt):
            status.problems.append(changes)
        return
    if not fsdp_files and (
        (ckpt / PLAIN_OPTIMIZER_FILE).exists() or (report.is_file() and status.fsdp_version is None)
    ):
        # the Trainer's own files: model.safetensors (+ index), optimizer.pt
        status.state_dict_type = "PLAIN"
        from fsdp_recipes.ckpt.readers import SafetensorsSource

        try:
            SafetensorsSource(ckpt)
        except CheckpointError as err:
            status.problems.append(f"model weights: {str(err).split(': copy')[0].replace(f'{ckpt}/', '')}")
        if problem := torch_file_problem(ckpt / PLAIN_OPTIMIZER_FILE):
            status.problems.append(problem)
    elif (ckpt / DCP_MODEL_DIR).is_dir() or not (ckpt / FULL_MODEL_FILE).is_file():
        status.state_dict_type = "SHARDED_STATE_DICT"
        for folder, what in ((ckpt / DCP_MODEL_DIR, "model shards"), (ckpt / OPTIMIZER_DIR, "optimizer shards")):
            problems, found = dcp_problems(folder, what, status)
            status.problems += problems
            ranks |= found
        if not status.problems:
            status.problems += digest_problems(ckpt, (DCP_MODEL_DIR, OPTIMIZER_DIR))
    else:
        status.state_dict_type = "FULL_STATE_DICT"
        status.problems += [
            p for p in (torch_file_problem(ckpt / FULL_MODEL_FILE), torch_file_problem(ckpt / FULL_OPTIMIZER_FILE)) if p
        ]

    if problem := torch_file_problem(ckpt / "scheduler.pt", load=True):
        status.problems.append(problem)
    if changes := _recorded_changes(ckpt):
        status.problems.append(changes)

    rng_files = {
        int(m.group(1)) for p in ckpt.glob("rng_state_*.pth") if (m := re.fullmatch(r"rng_state_(\d+)\.pth", p.name))
    }
    if status.world_size is None and (ranks or rng_files):
        status.world_size = max(ranks | rng_files) + 1
    if status.world_size and status.world_size > 1:
        rng_names = [f"rng_state_{r}.pth" for r in range(status.world_size)]
    else:
        rng_names = ["rng_state.pth"]
    status.problems += [p for p in (torch_file_problem(ckpt / n, load=True, keys=RNG_KEYS) for n in rng_names) if p]


def _recorded_changes(ckpt: Path) -> str | None:
    from fsdp_recipes.ckpt.description import read_files, recorded_changes

    return recorded_changes(read_files(ckpt))


def newest_resumable(run_dir: str | os.PathLike) -> tuple[CheckpointStatus | None, list[CheckpointStatus]]:
    """(the newest resumable checkpoint in run_dir or None, the newer ones it passed over). Resumable: every file a
    resume reads is there and sound (checkpoint_status); a merge asks less
    (fsdp_recipes.ckpt.resolve.weight_problems)."""
    skipped = []
    for ckpt in checkpoint_steps(Path(run_dir)):
        status = checkpoint_status(ckpt)
        if status.resumable:
            return status, skipped
        skipped.append(status)
    return None, skipped
