"""Training checkpoints: is a ``checkpoint-N`` folder complete and resumable, and which one does a resume use.

The Trainer writes a checkpoint in place, in this order: model shards (every rank, then ``.metadata``),
optimizer shards (likewise), ``scheduler.pt`` (rank 0), one ``rng_state_<rank>.pth`` per rank, then
``trainer_state.json`` (rank 0), and our ``fsdp_report.json`` once every rank is done. A job killed
in between leaves a folder that looks like a checkpoint; resuming from it would either crash or, worse,
silently restart the optimizer (the Trainer skips optimizer files it does not find). Completeness is
therefore judged file by file, against the DCP metadata's own list of shards and byte ranges.

A checkpoint whose metadata names a dtype or DCP class the installed torch does not know (another torch version
wrote it) is neither: it is "unreadable by this version" (``CheckpointStatus.unreadable``). Nothing says it is
incomplete, and a resume stops at it rather than passing over it (fsdp_recipes.ckpt.resume).

A finished save (trainer_state.json, written last, is there) holding complete model weights (safetensors:
``model.safetensors``, or an index and every shard it names; or peft's adapter) and no optimizer state at all is
"weights only" (``CheckpointStatus.weights_only``): what ``save_only_model`` writes, the stock Trainer's and ours.
It cannot resume a run (the optimizer would start from nothing), and it is a model: never called incomplete, never
passed over or set aside by a resume, never offered to or deleted by ``--overwrite_output_dir`` (``may_be_good``).
One whose weights are not all there, or whose save was cut short before trainer_state.json, stays incomplete.

Size: one module (about 510 lines) on purpose: every kind of checkpoint (sharded, full, plain, weights only) is judged
here, file by file, into the one verdict that decides what a resume may use, what it passes over and what the deleting
flag may be offered; rotation and the line a stopped run ends with read that verdict beside it.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import zipfile
from dataclasses import asdict, dataclass, field
from pathlib import Path

from fsdp_recipes.bounded import JSON_LIMIT, REPORT_LIMIT, STATE_LIMIT, load_json
from fsdp_recipes.ckpt.dcp_check import check_folder
from fsdp_recipes.ckpt.layout import (
    ADAPTER_CONFIG,
    CHECKPOINT_PURPOSE,
    DCP_MODEL_DIR,
    FULL_MODEL_FILE,
    FULL_OPTIMIZER_FILE,
    INCOMPLETE_PREFIX,
    OPTIMIZER_DIR,
    PLAIN_OPTIMIZER_FILE,
    REPORT_NAME,
    checkpoint_steps,
    checkpoint_unlike,
    is_checkpoint_folder,
    real,
    step_of_name,
)
from fsdp_recipes.ckpt.shard_digests import digest_problems
from fsdp_recipes.ckpt.torch_names import require_this_torch
from fsdp_recipes.compat import internals
from fsdp_recipes.errors import CheckpointError, RefusedRemoval, UnknownToThisVersion, UnreadableFile
from fsdp_recipes.removal import move, remove


@dataclass
class CheckpointStatus:
    path: str
    step: int | None = None
    state_dict_type: str | None = None  # SHARDED_STATE_DICT, FULL_STATE_DICT or PLAIN (saved without FSDP: DDP, ZeRO-1)
    fsdp_version: int | None = None  # from our fsdp_report.json; None for checkpoints other scripts wrote
    sharding_strategy: str | None = None
    world_size: int | None = None
    problems: list[str] = field(default_factory=list)
    # why this version cannot read it (UnknownToThisVersion.reason): another torch version wrote it; not a problem
    unreadable: str | None = None
    # a LoRA run's sharded model: "adapter only" (the frozen base is the base model's) or "whole model"; None otherwise
    lora: str | None = None
    base_model: str | None = None  # an adapter-only checkpoint's base, as the run recorded it (ckpt.base_identity)
    # complete model weights and no optimizer state (state_dict_type WEIGHTS_ONLY, save_only_model's): a model, not resumable
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
        """Not resumable, yet it may be good: never passed over, set aside, offered to or deleted by --overwrite_output_dir."""
        return self.may_be_complete or self.weights_only

    def weights_only_fix(self) -> str:
        """What to do with a weights-only checkpoint instead of resuming it (no deleting flag)."""
        if _adapter_only(Path(self.path)):
            return f"it is a LoRA adapter: load it onto its base model with peft (PeftModel.from_pretrained(base, {str(self.path)!r}))"
        start = (
            f"start a new run from it with --model_name_or_path {self.path} (and a new --output_dir), or "
            if (Path(self.path) / "config.json").is_file()
            else ""
        )
        return f"it is a model: {start}merge it into a model folder with tools/merge_checkpoint.py {self.path} OUT"

    def weights_only_line(self) -> str:
        """Why a weights-only checkpoint does not resume, and what to do with it instead (one line)."""
        return (
            f"{Path(self.path).name} holds model weights only, no optimizer state (as save_only_model writes), so it cannot "
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
            verdict = f"UNREADABLE BY THIS VERSION ({self.unreadable}): another torch version wrote it, and it may be complete; {UnknownToThisVersion.FIX}"
        return f"{name} ({what}): {verdict}" if what else f"{name}: {verdict}"

    def to_dict(self) -> dict:
        return {
            **asdict(self),
            "resumable": self.resumable,
            "may_be_complete": self.may_be_complete,
            "may_be_good": self.may_be_good,
        }


# The files a resume loads whole (scheduler.pt, rng_state_*.pth: a few KB each): a larger one is not what the Trainer
# writes, and its claimed tensors would be read into memory before anything else is known about it
LOADED_LIMIT = 16 << 20
RNG_KEYS = ("python", "numpy", "cpu")  # what the Trainer's _load_rng_state reads from every rank's file


def _torch_file_problem(path: Path, load: bool = False, keys: tuple[str, ...] = ()) -> str | None:
    """torch.save files are zip archives whose directory sits at the end: a cut-off file has none. ``load``: the
    file is also loaded as the Trainer will load it (weights_only, numpy's RNG state allowed), so one naming code
    is refused here, in one line, rather than deep inside a resumed run; it must be under LOADED_LIMIT and, when
    ``keys`` are given, a mapping holding them. The file is opened once for all (a resume's check reads each
    rank's RNG state once: fsdp_recipes.ckpt.resume.decide)."""
    if not path.is_file():
        return f"missing {path.name}"
    try:
        file = open(path, "rb")  # noqa: SIM115 (closed below, after the load)
    except OSError:
        return f"truncated or unreadable {path.name}"
    with file:
        if load and (size := os.fstat(file.fileno()).st_size) > LOADED_LIMIT:
            return f"refused {path.name}: {size / 2**20:,.0f} MiB, where the Trainer writes a few KB (over {LOADED_LIMIT >> 20} MiB is not read)"
        try:
            zipfile.ZipFile(file).close()  # leaves ``file`` open
        except (zipfile.BadZipFile, OSError):
            return f"truncated or unreadable {path.name}"
        if load:
            import numpy as np
            import torch

            allowed = [
                internals.get("numpy._core.multiarray._reconstruct"),
                np.ndarray,
                np.dtype,
                type(np.dtype(np.uint32)),
            ]  # as the Trainer
            file.seek(0)
            try:
                with torch.serialization.safe_globals(allowed):
                    loaded = torch.load(file, map_location="cpu", weights_only=True)
            except Exception as err:  # noqa: BLE001 (UnpicklingError, RuntimeError ...: refused either way)
                return f"refused {path.name}: it holds more than tensors and plain data ({type(err).__name__}); a pickle can run code"
            if keys and not (isinstance(loaded, dict) and all(k in loaded for k in keys)):
                return f"refused {path.name}: not an RNG state the Trainer wrote (it needs {', '.join(keys)})"
    return None


def _dcp_problems(folder: Path, what: str, status: CheckpointStatus) -> tuple[list[str], set[int]]:
    """Problems of a DCP folder and the ranks whose shard files its metadata names; what this version cannot read
    goes to ``status.unreadable``, not among the problems."""
    if not folder.is_dir():
        return [f"missing {folder.name}/ ({what})"], set()
    ckpt = folder.parent
    try:
        layout, problems = check_folder(folder)
    except UnknownToThisVersion as err:
        status.unreadable = status.unreadable or err.reason.replace(f"{ckpt}/", "")
        return [], set()
    try:
        if layout is not None:  # torch's reader, which the resume uses, must find each class where it is named
            require_this_torch(layout, folder / ".metadata")
    except UnknownToThisVersion as err:
        status.unreadable = status.unreadable or err.reason.replace(f"{ckpt}/", "")
    problems = [p.replace(f"{ckpt}/", "") for p in problems]
    if layout is not None and not problems:
        problems = _coverage_problems(folder, layout, status)
    ranks = set()
    if layout is not None:
        for info in layout.storage.values():
            if m := re.match(r"__(\d+)_\d+\.distcp$", info.relative_path):
                ranks.add(int(m.group(1)))
    return problems, ranks


def _coverage_problems(folder: Path, layout, status: CheckpointStatus) -> list[str]:
    """A model folder that holds no tensor; for the model, whether it is a LoRA adapter alone."""
    from fsdp_recipes.ckpt.lora_merge import LORA_WEIGHT

    if folder.name == DCP_MODEL_DIR:
        if not layout.tensors:
            return [
                f"{folder.name}/ holds no tensors (an adapter-only save that selected nothing): use an earlier checkpoint"
            ]
        if any(LORA_WEIGHT.match(name) for name in layout.tensors):
            status.lora = "adapter only" if all(LORA_WEIGHT.match(name) for name in layout.tensors) else "whole model"
            if status.lora == "adapter only":  # the frozen base comes from elsewhere: say which one the run recorded
                from fsdp_recipes.ckpt import base_identity

                try:
                    record = base_identity.read(folder.parent)
                except CheckpointError as err:
                    return [str(err)]
                status.base_model = (
                    record["base_model"] if record else f"not recorded: no {base_identity.BASE_IDENTITY}"
                )
    return []  # that the chunks make up each tensor (a rank's slice missing) is check_folder's (dcp_check.chunk_problems)


WEIGHTS_ONLY = (
    "WEIGHTS_ONLY"  # state_dict_type of a checkpoint holding safetensors model weights and no optimizer state
)
_WEIGHTS_FILES = ("model.safetensors", "model.safetensors.index.json")
ADAPTER_WEIGHTS = (
    "adapter_model.safetensors"  # peft's: a LoRA run's weights under the stock Trainer (beside ADAPTER_CONFIG)
)
_OPTIMIZER_STATE = (OPTIMIZER_DIR, PLAIN_OPTIMIZER_FILE, FULL_OPTIMIZER_FILE)
# model weights in pickle files (the stock Trainer's with save_safetensors=false, peft's .bin adapter): never unpickled
PICKLED_WEIGHTS = ("pytorch_model.bin", "pytorch_model.bin.index.json", "adapter_model.bin")
PICKLED_SHARD = re.compile(r"pytorch_model-\d+-of-\d+\.bin")


def _weights_only_layout(ckpt: Path) -> bool:
    """Safetensors model weights and no optimizer state, nor FSDP model files, under any name a save writes (a link or
    a file where one belongs counts as there): save_only_model's checkpoint, or one whose optimizer state was removed."""
    if any(os.path.lexists(ckpt / name) for name in (*_OPTIMIZER_STATE, DCP_MODEL_DIR, FULL_MODEL_FILE)):
        return False
    return any(os.path.lexists(ckpt / name) for name in (*_WEIGHTS_FILES, ADAPTER_WEIGHTS)) or any(
        ckpt.glob("model-*-of-*.safetensors")
    )


def _adapter_only(folder: Path) -> bool:
    """peft's adapter (and no model weights) is what a save_only_model checkpoint of a LoRA run holds."""
    return os.path.lexists(folder / ADAPTER_WEIGHTS) and not any(
        os.path.lexists(folder / name) for name in _WEIGHTS_FILES
    )


def weights_problems(folder: Path) -> list[str]:
    """Why the safetensors weights from_pretrained would read from ``folder`` are not all there: ``model.safetensors``
    (read first when a folder holds both), else every shard the index names, each a plain file of the folder
    (readers.is_shard_name) with a whole header (readers.safetensors_header) and every byte it describes, holding the
    tensors the index assigns it; or peft's adapter_model.safetensors beside its adapter_config.json. Dtypes are not
    judged: the file is whole whatever a merge converts."""
    from fsdp_recipes.ckpt.readers import is_shard_name, safetensors_header

    index = folder / "model.safetensors.index.json"
    expected: dict[str, set] = {}  # shard file: the tensors the index assigns it
    if _adapter_only(folder):
        if not (folder / ADAPTER_CONFIG).is_file():
            return [f"missing {ADAPTER_CONFIG} (peft needs it beside {ADAPTER_WEIGHTS})"]
        expected[ADAPTER_WEIGHTS] = set()
    elif (folder / "model.safetensors").is_file() or not os.path.lexists(index):
        expected["model.safetensors"] = set()
    else:
        try:
            weight_map = load_json(index, index.name, JSON_LIMIT).get("weight_map")
        except UnreadableFile as err:
            return [f"unreadable {index.name} ({err.reason})"]
        if not isinstance(weight_map, dict) or not weight_map:
            return [f"{index.name} has no weight_map of tensor names to shard files"]
        for tensor, shard in weight_map.items():
            if not isinstance(shard, str) or not is_shard_name(shard):
                return [
                    f"{index.name} names {short_json(shard)} as a shard, which is not a .safetensors file of the checkpoint"
                ]
            expected.setdefault(shard, set()).add(tensor)
    problems = []
    for shard, tensors in sorted(expected.items()):
        path = folder / shard
        named = f" ({index.name} names it)" if tensors else ""
        if not os.path.lexists(path):
            problems.append(f"missing {shard}{named}")
            continue
        try:
            length, entries, size = safetensors_header(path)
            end = max((entry["data_offsets"][1] for entry in entries.values()), default=0)
            if type(end) is not int:
                raise ValueError
        except OSError as err:
            problems.append(f"unreadable {shard} ({err.strerror})")
            continue
        except (ValueError, TypeError, IndexError, KeyError):
            problems.append(f"truncated or unreadable {shard} (no safetensors header)")
            continue
        if size < 8 + length + end:
            problems.append(f"truncated {shard} ({size:,} of the {8 + length + end:,} bytes its header describes)")
        elif lacking := tensors - set(entries):
            problems.append(
                f"{shard} lacks {len(lacking)} tensor(s) {index.name} assigns it ({short_json(sorted(lacking)[0])}, ...)"
            )
    return problems


def checkpoint_status(ckpt: str | os.PathLike) -> CheckpointStatus:
    """Everything a resume needs, checked without loading a tensor."""
    ckpt = Path(ckpt)
    status = CheckpointStatus(str(ckpt))
    if not ckpt.is_dir():
        status.problems.append(f"{ckpt} is not a folder")
        return status
    try:
        _check(ckpt, status)
    except OSError as err:  # a file vanished while we looked (another rank set the folder aside)
        status.problems.append(f"unreadable: {err.strerror} ({Path(err.filename or ckpt).name})")
    return status


MAX_WORLD_SIZE = 65536  # processes; the rank files checked below are named from it, one per rank


def _whole(value, low: int, high: int | None) -> bool:
    """A JSON whole number (not true/false, not 2.0) in low..high."""
    return type(value) is int and value >= low and (high is None or value <= high)


def short_json(value) -> str:
    """A value from a JSON file as a message shows it: short, on one line."""
    text = json.dumps(value)
    return text if len(text) <= 40 else text[:37] + "..."


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
        return f"unreadable {REPORT_NAME} (world_size {short_json(world)} is not a number of processes from 1 to {MAX_WORLD_SIZE})"
    if strategy is not None and not (isinstance(strategy, str) and len(strategy) <= 40):
        return f"unreadable {REPORT_NAME} (sharding_strategy {short_json(strategy)} is not a strategy name)"
    status.fsdp_version, status.world_size, status.sharding_strategy = version, world, strategy
    return None


def _check(ckpt: Path, status: CheckpointStatus) -> None:
    if not any(
        (ckpt / name).exists()
        for name in ("trainer_state.json", DCP_MODEL_DIR, OPTIMIZER_DIR, FULL_MODEL_FILE, PLAIN_OPTIMIZER_FILE)
    ):
        status.problems.append("not a training checkpoint (no trainer_state.json, model or optimizer state)")
        return
    report = ckpt / REPORT_NAME
    if os.path.lexists(report) and (problem := _read_report(report, status)):  # optional, but when there, sound
        status.problems.append(problem)

    state = ckpt / "trainer_state.json"
    finished = False  # trainer_state.json, which the Trainer writes last, is there and readable: the save finished
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
                    f"unreadable trainer_state.json (global_step {short_json(step)} is not a step number, a whole number of at least 0)"
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
        # transformers 4's save_safetensors=false, or peft's .bin adapter: a model we never unpickle, so cannot judge; it
        # may be good, so never skipped, set aside or deleted (may_be_complete)
        status.state_dict_type = "PICKLED_WEIGHTS"
        status.unreadable = (
            f"its weights are pickle files ({', '.join(pickled[:2])}), which this repository never unpickles; "
            "convert them to safetensors where you trust the file, or move the checkpoint out of output_dir"
        )
        return
    if _weights_only_layout(ckpt):  # save_only_model's: judged by its weights alone (no scheduler or RNG state either)
        status.state_dict_type = WEIGHTS_ONLY
        if weights := weights_problems(ckpt):
            status.problems += [f"model weights: {p}" for p in weights]
        else:  # a save cut short after the weights (no trainer_state.json yet) is incomplete, as any other
            status.weights_only = finished
        if changes := _recorded_changes(ckpt):
            status.problems.append(changes)
        return
    if not fsdp_files and (
        (ckpt / PLAIN_OPTIMIZER_FILE).exists() or (report.is_file() and status.fsdp_version is None)
    ):
        status.state_dict_type = "PLAIN"  # the Trainer's own files: model.safetensors (+ index), optimizer.pt
        from fsdp_recipes.ckpt.readers import SafetensorsSource

        try:
            SafetensorsSource(ckpt)
        except CheckpointError as err:
            status.problems.append(f"model weights: {str(err).split(': copy')[0].replace(f'{ckpt}/', '')}")
        if problem := _torch_file_problem(ckpt / PLAIN_OPTIMIZER_FILE):
            status.problems.append(problem)
    elif (ckpt / DCP_MODEL_DIR).is_dir() or not (ckpt / FULL_MODEL_FILE).is_file():
        status.state_dict_type = "SHARDED_STATE_DICT"
        for folder, what in ((ckpt / DCP_MODEL_DIR, "model shards"), (ckpt / OPTIMIZER_DIR, "optimizer shards")):
            problems, found = _dcp_problems(folder, what, status)
            status.problems += problems
            ranks |= found
        if not status.problems:
            status.problems += digest_problems(ckpt, (DCP_MODEL_DIR, OPTIMIZER_DIR))
    else:
        status.state_dict_type = "FULL_STATE_DICT"
        status.problems += [
            p
            for p in (_torch_file_problem(ckpt / FULL_MODEL_FILE), _torch_file_problem(ckpt / FULL_OPTIMIZER_FILE))
            if p
        ]

    if problem := _torch_file_problem(ckpt / "scheduler.pt", load=True):
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
    status.problems += [p for p in (_torch_file_problem(ckpt / n, load=True, keys=RNG_KEYS) for n in rng_names) if p]


def _recorded_changes(ckpt: Path) -> str | None:
    from fsdp_recipes.ckpt.description import recorded_changes

    return recorded_changes(ckpt)


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
    """Delete the oldest checkpoints beyond ``limit`` by step (mtime misleads on fuse and network filesystems), never ``keep``
    (the best) nor, with ``keep_newest``, the newest; only checkpoints holding nothing else (layout.is_checkpoint_folder).
    Any other folder, or one that will not go, is kept and named through ``warn``, never stopping a run. Returns what went."""
    if not limit or limit <= 0:
        return []
    steps = []
    for ckpt in checkpoint_steps(Path(run_dir)):  # newest first; another folder does not cost a checkpoint its place
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
            tried += 1  # a folder that would not go still counts: a newer one is never deleted in its place
            try:
                remove(ckpt, CHECKPOINT_PURPOSE, shape=is_checkpoint_folder)
                deleted.append(ckpt)
            except (OSError, RefusedRemoval) as err:  # a file held open over NFS, a permission: never worth a run
                warn(f"save_total_limit: could not delete {ckpt.name} ({err}); delete it yourself")
    return deleted


def newest_resumable(run_dir: str | os.PathLike) -> tuple[CheckpointStatus | None, list[CheckpointStatus]]:
    """(the newest resumable checkpoint in run_dir or None, the newer ones it passed over). Resumable: every file a
    resume reads is there and sound (checkpoint_status); a merge asks less (fsdp_recipes.ckpt.resolve.weight_problems)."""
    skipped = []
    for ckpt in checkpoint_steps(Path(run_dir)):
        status = checkpoint_status(ckpt)
        if status.resumable:
            return status, skipped
        skipped.append(status)
    return None, skipped


def how_to_go_on(output_dir: str | os.PathLike) -> str:
    """What to run after a run stopped before its end, as its output_dir is now: resume from the newest complete
    checkpoint, or, with none complete (the first save was cut short), start again (a resume would find nothing, and a
    plain start refuses a folder holding checkpoints)."""
    chosen, skipped = newest_resumable(Path(output_dir))
    # one that may be good stops `--resume_from_checkpoint true` (fsdp_recipes.ckpt.resume) and is never offered for deletion
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
            f"no space left on {out} while writing the final model ({free / 1e6:.1f} MB free); training had finished and "
            f"{kept}: free space, then run the same command with --resume_from_checkpoint true (it writes the model "
            "again, without training)"
        )
    if chosen is None:
        return f"no space left on {out}: {need} and {kept}; free space, then {how_to_go_on(out)}"
    return (
        f"no space left on {out}: {need}; {kept}: free space (or move output_dir), then run the same command "
        "with --resume_from_checkpoint true"
    )
