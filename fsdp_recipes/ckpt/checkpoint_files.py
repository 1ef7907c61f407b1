"""How each kind of file in a training checkpoint is judged, file by file, for fsdp_recipes.ckpt.status: torch.save
files (scheduler, RNG state, optimizer) read as the Trainer reads them, DCP folders (fsdp_recipes.ckpt.dcp_check)
and whose ranks they name, and the safetensors weights of a weights-only checkpoint. Each returns problem lines;
what this torch cannot read goes to the verdict's ``unreadable``, never among the problems.
"""

from __future__ import annotations

import os
import re
import zipfile
from pathlib import Path
from typing import TYPE_CHECKING

from fsdp_recipes.bounded import JSON_LIMIT, load_json, short_json
from fsdp_recipes.ckpt.dcp_check import check_folder
from fsdp_recipes.ckpt.layout import (
    ADAPTER_CONFIG,
    DCP_MODEL_DIR,
    FULL_MODEL_FILE,
    FULL_OPTIMIZER_FILE,
    OPTIMIZER_DIR,
    PLAIN_OPTIMIZER_FILE,
)
from fsdp_recipes.ckpt.torch_names import require_this_torch
from fsdp_recipes.compat import internals
from fsdp_recipes.errors import CheckpointError, UnknownToThisVersion, UnreadableFile

if TYPE_CHECKING:
    from fsdp_recipes.ckpt.status import CheckpointStatus


# The files a resume loads whole (scheduler.pt, rng_state_*.pth: a few KB each): a larger one is not what the Trainer
# writes, and its claimed tensors would be read into memory before anything else is known about it
LOADED_LIMIT = 16 << 20
# what the Trainer's _load_rng_state reads from every rank's file
RNG_KEYS = ("python", "numpy", "cpu")


def torch_file_problem(path: Path, load: bool = False, keys: tuple[str, ...] = ()) -> str | None:
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
            return (
                f"refused {path.name}: {size / 2**20:,.0f} MiB, where the Trainer writes a few KB (over "
                f"{LOADED_LIMIT >> 20} MiB is not read)"
            )
        try:
            # leaves ``file`` open
            zipfile.ZipFile(file).close()
        except (zipfile.BadZipFile, OSError):
            return f"truncated or unreadable {path.name}"
        if load:
            import numpy as np
            import torch

            # as the Trainer
            allowed = [
                internals.get("numpy._core.multiarray._reconstruct"),
                np.ndarray,
                np.dtype,
                type(np.dtype(np.uint32)),
            ]
            file.seek(0)
            try:
                with torch.serialization.safe_globals(allowed):
                    loaded = torch.load(file, map_location="cpu", weights_only=True)
            except Exception as err:  # noqa: BLE001 (UnpicklingError, RuntimeError ...: refused either way)
                return (
                    f"refused {path.name}: it holds more than tensors and plain data ({type(err).__name__}); "
                    "a pickle can run code"
                )
            if keys and not (isinstance(loaded, dict) and all(k in loaded for k in keys)):
                return f"refused {path.name}: not an RNG state the Trainer wrote (it needs {', '.join(keys)})"
    return None


def dcp_problems(folder: Path, what: str, status: CheckpointStatus) -> tuple[list[str], set[int]]:
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
        # torch's reader, which the resume uses, must find each class where it is named
        if layout is not None:
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
                f"{folder.name}/ holds no tensors (an adapter-only save that selected nothing): use an earlier "
                "checkpoint"
            ]
        if any(LORA_WEIGHT.match(name) for name in layout.tensors):
            status.lora = "adapter only" if all(LORA_WEIGHT.match(name) for name in layout.tensors) else "whole model"
            # the frozen base comes from elsewhere: say which one the run recorded
            if status.lora == "adapter only":
                from fsdp_recipes.ckpt import base_identity

                try:
                    record = base_identity.read(folder.parent)
                except CheckpointError as err:
                    return [str(err)]
                status.base_model = (
                    record["base_model"] if record else f"not recorded: no {base_identity.BASE_IDENTITY}"
                )
    # that the chunks make up each tensor (a rank's slice missing) is check_folder's (dcp_check.chunk_problems)
    return []


# state_dict_type of a checkpoint holding safetensors model weights and no optimizer state
WEIGHTS_ONLY = "WEIGHTS_ONLY"
_WEIGHTS_FILES = ("model.safetensors", "model.safetensors.index.json")
# peft's: a LoRA run's weights under the stock Trainer (beside ADAPTER_CONFIG)
ADAPTER_WEIGHTS = "adapter_model.safetensors"
_OPTIMIZER_STATE = (OPTIMIZER_DIR, PLAIN_OPTIMIZER_FILE, FULL_OPTIMIZER_FILE)
# model weights in pickle files (the stock Trainer's with save_safetensors=false, peft's .bin adapter): never unpickled
PICKLED_WEIGHTS = ("pytorch_model.bin", "pytorch_model.bin.index.json", "adapter_model.bin")
PICKLED_SHARD = re.compile(r"pytorch_model-\d+-of-\d+\.bin")


def weights_only_layout(ckpt: Path) -> bool:
    """Safetensors model weights and no optimizer state, nor FSDP model files, under any name a save writes (a link or
    a file where one belongs counts as there): save_only_model's checkpoint, or one whose optimizer state was
    removed."""
    if any(os.path.lexists(ckpt / name) for name in (*_OPTIMIZER_STATE, DCP_MODEL_DIR, FULL_MODEL_FILE)):
        return False
    return any(os.path.lexists(ckpt / name) for name in (*_WEIGHTS_FILES, ADAPTER_WEIGHTS)) or any(
        ckpt.glob("model-*-of-*.safetensors")
    )


def adapter_only(folder: Path) -> bool:
    """peft's adapter (and no model weights) is what a save_only_model checkpoint of a LoRA run holds."""
    return os.path.lexists(folder / ADAPTER_WEIGHTS) and not any(
        os.path.lexists(folder / name) for name in _WEIGHTS_FILES
    )


def weights_problems(folder: Path) -> list[str]:
    """Why the safetensors weights from_pretrained would read from ``folder`` are not a whole model:
    ``model.safetensors`` (read first when a folder holds both), else every shard the index names, each a plain file
    of the folder (readers.is_shard_name) whose header safetensors reads (readers.safetensors_header: every entry's
    bytes are dtype x shape, none over another's, the file exactly as long as they say), holding exactly the tensors
    the index assigns it; or peft's adapter_model.safetensors beside its adapter_config.json. At least one tensor,
    and, where the folder holds a config.json, the names and shapes of the model it describes
    (model_match.config_mismatch). This is the whole verdict on a weights-only checkpoint: no other file
    (trainer_state.json) takes part. Dtypes are not judged (the file is whole whatever a merge converts), nor values
    (reading them is the merge's)."""
    from fsdp_recipes.ckpt.readers import NO_HEADER, NotSafetensors, is_shard_name, safetensors_header

    index = folder / "model.safetensors.index.json"
    # shard file: the tensors the index assigns it
    expected: dict[str, set] = {}
    if adapter_only(folder):
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
                    f"{index.name} names {short_json(shard)} as a shard, which is not a .safetensors file of "
                    "the checkpoint"
                ]
            expected.setdefault(shard, set()).add(tensor)
        if unnamed := sorted({p.name for p in folder.glob("model-*-of-*.safetensors")} - set(expected)):
            return [f"{index.name} names no tensor of {unnamed[0]}: the index is not this checkpoint's"]
    # held: tensor name -> its shape
    problems, held, dtypes = [], {}, {}
    for shard, tensors in sorted(expected.items()):
        path = folder / shard
        named = f" ({index.name} names it)" if tensors else ""
        if not os.path.lexists(path):
            problems.append(f"missing {shard}{named}")
            continue
        try:
            length, entries, size = safetensors_header(path)
        except OSError as err:
            problems.append(f"unreadable {shard} ({err.strerror})")
            continue
        except NotSafetensors as err:
            problems.append(
                f"truncated or unreadable {shard} ({NO_HEADER})"
                if err.reason == NO_HEADER
                else f"{shard} is damaged or forged: {err.reason} (safetensors refuses it)"
            )
            continue
        if size < 8 + length + (end := max((e["data_offsets"][1] for e in entries.values()), default=0)):
            problems.append(f"truncated {shard} ({size:,} of the {8 + length + end:,} bytes its header describes)")
        elif lacking := tensors - set(entries):
            problems.append(
                f"{shard} lacks {len(lacking)} tensor(s) {index.name} assigns it "
                f"({short_json(sorted(lacking)[0])}, ...)"
            )
        # from_pretrained loads what the index names
        elif tensors and (unnamed := set(entries) - tensors):
            problems.append(
                f"{shard} holds {len(unnamed)} tensor(s) {index.name} does not assign it "
                f"({short_json(sorted(unnamed)[0])}, ...): the index is not this checkpoint's"
            )
        held.update((name, tuple(entry["shape"])) for name, entry in entries.items())
        dtypes.update((name, entry["dtype"]) for name, entry in entries.items())
    if not problems and not held:
        problems.append("the weights hold no tensors")
    elif not problems and not adapter_only(folder) and os.path.lexists(folder / "config.json"):
        from fsdp_recipes.ckpt.model_match import config_mismatch

        if mismatch := config_mismatch(folder, held, dtypes):
            problems.append(mismatch)
    return problems
