"""Readers of the checkpoint formats a merge accepts, and which of their tensors are the model's weights.

Formats: a sharded DCP folder (FSDP1 or FSDP2, any number of ranks and nodes, whoever wrote it), a full
safetensors state dict (``model.safetensors`` [+ index]) or a torch.save one (``pytorch_model_fsdp.bin``, read
``weights_only``). Every tool names tensors its own way: accelerate and the Trainer store ``model.<name>``,
``dcp.save(model.state_dict())`` stores ``<name>``, torch's ``get_state_dict`` beside its optimizer stores
``model.<name>`` and ``optim.…``, Lightning ``model.<attribute>.<name>``. The namespace holding the weights is
found by matching the stored names and shapes against the model (``match_namespace``); optimizer namespaces are
never weights.
"""

from __future__ import annotations

import json
import os
import re
import struct
import warnings
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

from fsdp_recipes.bounded import JSON_LIMIT, load_json
from fsdp_recipes.ckpt.layout import DCP_MODEL_DIR, FULL_FILES, SHARD_DIGESTS, WRAPPER_PREFIXES, CheckpointError, checkpoint_steps
from fsdp_recipes.ckpt.dcp import DTYPE_SIZES, UnsafeCheckpointError, check_folder, digest_problems, guard_torch_dcp, raw_tensor, unsafe_message

SAFETENSORS_HEADER_LIMIT = 100_000_000  # safetensors' own limit (MAX_HEADER_SIZE): a larger header is not one
SAFETENSORS_DTYPES = {
    "float64": "F64", "float32": "F32", "float16": "F16", "bfloat16": "BF16", "int64": "I64", "int32": "I32",
    "int16": "I16", "int8": "I8", "uint8": "U8", "bool": "BOOL", "float8_e4m3fn": "F8_E4M3", "float8_e5m2": "F8_E5M2",
}
# top-level names under which tools store optimizer state beside the model (get_state_dict: optim, accelerate:
# optimizer, Lightning: optimizer_0, ...): never weights, whatever their shapes
OPTIMIZER_NAMESPACE = re.compile(r"^(optim|optimizer|optimizers|optimizer_\d+|optimizer_states?|optim_state)\.")


def dtype_name(dtype) -> str | None:
    """"bfloat16" for torch.bfloat16 or "bfloat16"; None stays None (keep the saved dtype)."""
    return None if dtype is None else str(dtype).removeprefix("torch.")


def torch_dtype(name: str):
    import torch

    return getattr(torch, name)


@dataclass(frozen=True)
class TensorInfo:
    shape: tuple[int, ...]
    dtype: str  # torch name: "float32"

    def nbytes(self, dtype: str | None = None) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n * DTYPE_SIZES[dtype or self.dtype]


def clean_name(name: str) -> str:
    for prefix in WRAPPER_PREFIXES:
        name = name.replace(prefix, "")
    return name


# ----------------------------------------------------------------------------------------------- formats


class DCPSource:
    """A sharded ``torch.distributed.checkpoint`` folder, read without a process group. Tensor names are the stored
    keys without FSDP/compile wrapper names; byte entries (pickled objects) are not tensors and never read."""

    kind = "sharded (DCP)"

    def __init__(self, dcp_dir: Path):
        self.path = Path(dcp_dir)
        layout, problems = check_folder(self.path, byte_records=False)  # a merge reads tensor records only
        if not problems and self.path.name == DCP_MODEL_DIR:
            problems = digest_problems(self.path.parent, (DCP_MODEL_DIR,))
        if problems:
            if "refusing to" in problems[0] or problems[0].startswith("unreadable") or "not the file" in problems[0] or SHARD_DIGESTS in problems[0]:  # complete sentences
                raise CheckpointError(problems[0])
            raise CheckpointError(
                f"checkpoint {dcp_dir} is incomplete: {'; '.join(problems[:3])}; it was not finished writing or was "
                "copied partly: use an earlier checkpoint-N or copy the folder again"
            )
        self._layout = layout
        self.keys = {clean_name(k): k for k in layout.tensors}
        self.tensors = {n: TensorInfo(layout.tensors[k].shape, layout.tensors[k].dtype) for n, k in self.keys.items()}
        self.ranks = len({info.relative_path for info in layout.storage.values()})

    def copy_plan(self, name: str) -> list[tuple[Path, int, int, int]] | None:
        """Where the tensor's bytes lie in the .distcp files, as (file, offset, offset in the tensor, bytes), for a
        kernel copy with no tensor in memory. Only for the common layout: every chunk a whole-row (dim-0) slice
        stored as one contiguous, uncompressed, little-endian torch.save record. None when that does not hold."""
        key, info = self.keys[name], self.tensors[name]
        row_bytes = info.nbytes() // info.shape[0] if info.shape and info.shape[0] else 0
        plan = []
        for chunk in self._layout.tensors[key].chunks:
            if not row_bytes or any(chunk.offsets[1:]) or chunk.sizes[1:] != info.shape[1:]:
                return None
            stored = self._layout.storage.get((key, chunk.offsets))
            raw = raw_tensor(self.path, stored) if stored else None
            if raw is None or raw.dtype != info.dtype or raw.shape != chunk.sizes:
                return None
            plan.append((self.path / stored.relative_path, raw.data_offset, chunk.offsets[0] * row_bytes, raw.nbytes))
        return plan if sum(n for *_, n in plan) == info.nbytes() else None

    def read(self, names: list[str]) -> dict:
        import torch
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.api import CheckpointException

        # DCP's reader unpickles .metadata with plain pickle: this folder's was vetted by check_folder above, and
        # torch's reader vets it again as it reads it (guard_torch_dcp). Records are read by torch with weights_only.
        guard_torch_dcp()
        buffers = {self.keys[n]: torch.empty(self.tensors[n].shape, dtype=torch_dtype(self.tensors[n].dtype)) for n in names}
        with warnings.catch_warnings():  # "torch.distributed is disabled ... single process": that is the intent
            warnings.simplefilter("ignore", UserWarning)
            try:
                dcp.load(buffers, storage_reader=dcp.FileSystemReader(str(self.path)), no_dist=True)
            except (Exception, CheckpointException) as err:  # noqa: BLE001 (DCP's wraps the record's error; a BaseException)
                if unsafe := _unsafe_cause(err):
                    raise CheckpointError(unsafe_message(self.path / ".metadata", unsafe)) from None
                refused = "Weights only load failed" in str(err)
                raise CheckpointError(
                    f"a tensor record in {self.path} is " + ("refused: it names code or objects that are not tensors "
                    "(torch.load weights_only)" if refused else f"unreadable ({type(err).__name__})") + "; use a checkpoint you or your run wrote"
                ) from None
        return {n: buffers[self.keys[n]] for n in names}


def _unsafe_cause(err: BaseException) -> UnsafeCheckpointError | None:
    """The refusal of guard_torch_dcp inside DCP's error (a CheckpointException holds each rank's (error, trace))."""
    if isinstance(err, UnsafeCheckpointError):
        return err
    failures = getattr(err, "failures", None)
    for failure in failures.values() if isinstance(failures, dict) else ():
        cause = failure[0] if isinstance(failure, tuple) else failure
        if isinstance(cause, UnsafeCheckpointError):
            return cause
    return None


class SafetensorsSource:
    """``model.safetensors`` or an index of shards. Tensors are laid out as plain bytes: copied by the kernel like
    DCP records (the header is read here, without torch), or read one at a time from memory maps to be cast."""

    kind = "full (safetensors)"

    def __init__(self, folder: Path):
        self.path = folder
        index = folder / "model.safetensors.index.json"
        try:
            files = sorted(set(load_json(index, index.name, JSON_LIMIT)["weight_map"].values())) if index.is_file() else ["model.safetensors"]
        except (ValueError, KeyError, TypeError, AttributeError):
            raise CheckpointError(f"{index} is not a safetensors index (no weight_map): copy the checkpoint again") from None
        self.ranks = 1
        self.tensors, self._where = {}, {}
        codes = {code: name for name, code in SAFETENSORS_DTYPES.items()}
        for file in files:
            path = folder / file
            if not path.is_file():
                raise CheckpointError(f"{path} is missing ({index.name} names it): copy the checkpoint again")
            with open(path, "rb") as f:
                try:
                    (length,) = struct.unpack("<Q", f.read(8))
                    if length > min(path.stat().st_size, SAFETENSORS_HEADER_LIMIT):
                        raise ValueError
                    header = json.loads(f.read(length))
                    entries = {k: v for k, v in header.items() if k != "__metadata__"}
                    for entry in entries.values():
                        entry["dtype"], entry["shape"], entry["data_offsets"]  # noqa: B018 (KeyError when absent)
                except (struct.error, ValueError, MemoryError, OverflowError, KeyError, TypeError, AttributeError):
                    raise CheckpointError(f"{path} is not a readable safetensors file (truncated?): copy the checkpoint again") from None
            end = 0
            for key, entry in entries.items():
                if entry["dtype"] not in codes:
                    raise CheckpointError(f"{path}: {key} has dtype {entry['dtype']}, which this tool does not convert")
                begin, stop = entry["data_offsets"]
                self.tensors[clean_name(key)] = TensorInfo(tuple(entry["shape"]), codes[entry["dtype"]])
                self._where[clean_name(key)] = (file, key, 8 + length + begin, stop - begin)
                end = max(end, stop)
            if path.stat().st_size < 8 + length + end:
                raise CheckpointError(f"{path} is truncated ({path.stat().st_size} of {8 + length + end} bytes): copy the checkpoint again")

    def copy_plan(self, name: str) -> list[tuple[Path, int, int, int]] | None:
        file, _, offset, nbytes = self._where[name]
        return [(self.path / file, offset, 0, nbytes)] if nbytes == self.tensors[name].nbytes() else None

    def read(self, names: list[str]) -> dict:
        from safetensors import safe_open

        out = {}
        for n in names:
            file, key, *_ = self._where[n]
            with safe_open(str(self.path / file), framework="pt") as f:
                out[n] = f.get_tensor(key)
        return out


class TorchBinSource:
    """``pytorch_model_fsdp.bin`` (FULL_STATE_DICT, torch.save): loaded ``weights_only`` (tensors and plain
    containers, never code) and memory-mapped, so pages are read on demand."""

    kind = "full (torch.save)"

    def __init__(self, path: Path):
        import torch

        self.path = path
        try:
            state = torch.load(path, map_location="cpu", mmap=True, weights_only=True)
        except Exception as err:  # noqa: BLE001 (truncated zip, foreign pickle, refused global: all one answer)
            raise CheckpointError(
                f"{path} is unreadable ({type(err).__name__}): it is truncated, not a torch.save state dict, or names "
                "code (refused: only tensors are loaded)"
            ) from None
        if not isinstance(state, dict):
            raise CheckpointError(f"{path} holds a {type(state).__name__}, not a state dict")
        self._state = {clean_name(k): v for k, v in _flatten(state).items() if isinstance(v, torch.Tensor)}
        self.tensors = {n: TensorInfo(tuple(t.shape), dtype_name(t.dtype)) for n, t in self._state.items()}
        self.ranks = 1

    def read(self, names: list[str]) -> dict:
        return {n: self._state[n] for n in names}


def _flatten(state: dict, prefix: str = "") -> dict:
    """{"model": {"a": t}} -> {"model.a": t}, as DCP flattens nested state dicts."""
    out = {}
    for k, v in state.items():
        if isinstance(v, dict):
            out.update(_flatten(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


# ----------------------------------------------------------------------------------------------- the model's namespace


@dataclass
class WeightMap:
    """Which stored tensor holds each of the model's weights."""

    names: dict[str, str]  # model weight name -> source tensor name
    prefix: str  # the namespace they were found under ("" for flat keys)
    ignored: int = 0  # stored tensors outside it (optimizer state, other modules)

    def describe(self) -> str:
        where = f'under "{self.prefix}"' if self.prefix else "at the top level (no prefix)"
        rest = f"; {self.ignored} other stored tensor(s) ignored (optimizer state, other modules)" if self.ignored else ""
        return f"layout: {len(self.names)} weights {where}{rest}"


def weight_candidates(stored) -> list[str]:
    return [n for n in stored if not OPTIMIZER_NAMESPACE.match(n)]


def guess_namespace(stored: dict[str, TensorInfo]) -> WeightMap | None:
    """The weights without knowing the model: every non-optimizer tensor, under the longest dotted prefix they all
    share. Right for every producer above; ``match_namespace`` has the last word."""
    names = weight_candidates(stored)
    if not names:
        return None
    parts = [n.split(".") for n in names]
    common = []
    for column in zip(*(p[:-1] for p in parts)):
        if len(set(column)) != 1:
            break
        common.append(column[0])
    prefix = "".join(f"{c}." for c in common)
    return WeightMap({n[len(prefix):]: n for n in names}, prefix, len(stored) - len(names))


def match_namespace(stored: dict[str, TensorInfo], expected: dict[str, tuple[int, ...]], tied: list[str], model_name: str) -> WeightMap:
    """The namespace whose names and shapes are the model's, checked: every weight present with its shape, nothing
    unknown inside it. Raises CheckpointError naming what was found and what was expected."""
    wanted = sorted(set(expected) - set(tied))
    votes: Counter[str] = Counter()
    for n in weight_candidates(stored):
        parts = n.split(".")
        for i in range(len(parts)):
            suffix = ".".join(parts[i:])
            if suffix in expected and tuple(stored[n].shape) == tuple(expected[suffix]):
                votes[".".join(parts[:i]) + ("." if i else "")] += 1
    names = sorted(weight_candidates(stored)) or sorted(stored)
    found = (", ".join(names[:3]) + (", ..." if len(names) > 3 else "")) or "no tensors"
    if not votes:
        raise CheckpointError(
            f"found no weights of {model_name} in the checkpoint: it stores {found}; expected names like {wanted[0]} "
            "(under any prefix) with the config's shapes: pass the right --base-model"
        )
    prefix = max(votes, key=lambda p: (votes[p], -len(p)))
    inside = {n[len(prefix):]: n for n in weight_candidates(stored) if n.startswith(prefix)}
    missing = [n for n in wanted if n not in inside]
    if missing:
        raise CheckpointError(
            f"the checkpoint lacks {len(missing)} of the {len(wanted)} weights of {model_name} (e.g. {prefix}{missing[0]}); "
            f"it stores {found}: the config does not belong to this checkpoint; pass the right --base-model"
        )
    wrong = [n for n in wanted if tuple(stored[inside[n]].shape) != tuple(expected[n])]
    if wrong:
        n = wrong[0]
        raise CheckpointError(f"{n} has shape {tuple(stored[inside[n]].shape)} in the checkpoint but {tuple(expected[n])} in the config: pass the right --base-model")
    extra = sorted(set(inside) - set(expected))
    if extra:
        raise CheckpointError(f"the checkpoint has {len(extra)} weight(s) {model_name} does not (e.g. {prefix}{extra[0]}): pass the right --base-model")
    return WeightMap({n: inside[n] for n in wanted}, prefix, len(stored) - len(inside))


# ----------------------------------------------------------------------------------------------- finding the input


def checkpoint_problems(ckpt: Path) -> list[str]:
    """Why a checkpoint-N folder cannot be merged (empty when it can)."""
    if (ckpt / DCP_MODEL_DIR).is_dir():
        return check_folder(ckpt / DCP_MODEL_DIR, byte_records=False)[1] or digest_problems(ckpt, (DCP_MODEL_DIR,))
    if any((ckpt / f).is_file() for f in FULL_FILES):
        return []
    return [f"no {DCP_MODEL_DIR}/ and no full weights in {ckpt}"]


@dataclass
class ResolvedInput:
    source: object
    checkpoint_dir: Path  # the checkpoint: where its trainer state lies
    notes: list[str] = field(default_factory=list)
    weights_dir: Path | None = None  # the folder holding the weights, when not checkpoint_dir

    @property
    def places(self) -> list[Path]:
        """Where config and tokenizer are looked for, in order: beside the weights, the checkpoint, its parent."""
        found = [self.weights_dir, self.checkpoint_dir, self.checkpoint_dir.parent]
        return [p for i, p in enumerate(found) if p is not None and p not in found[:i]]


def open_source(folder: Path):
    if (folder / DCP_MODEL_DIR).is_dir():
        return DCPSource(folder / DCP_MODEL_DIR)
    if (folder / "model.safetensors.index.json").is_file() or (folder / "model.safetensors").is_file():
        return SafetensorsSource(folder)
    return TorchBinSource(folder / "pytorch_model_fsdp.bin")


def resolve_input(path: str | os.PathLike) -> ResolvedInput:
    """A checkpoint-N folder, a DCP folder (ours, raw torch, Lightning's), or a run folder (newest complete checkpoint)."""
    p = Path(path)
    if not p.exists():
        raise CheckpointError(f"{p} does not exist: give a checkpoint-N folder, its {DCP_MODEL_DIR} folder, or a run's output folder")
    if not p.is_dir():
        raise CheckpointError(f"{p} is a file: give the folder that holds it (a checkpoint-N folder or {DCP_MODEL_DIR})")
    if p.name.startswith("optimizer"):
        raise CheckpointError(f"{p} holds optimizer state, not model weights: give {p.parent / DCP_MODEL_DIR} or {p.parent}")
    if (p / ".metadata").is_file() or any(p.glob("*.distcp")):
        # accelerate's model folder belongs to the checkpoint-N around it; any other DCP folder is the checkpoint
        return ResolvedInput(DCPSource(p), p.parent, weights_dir=p) if p.name == DCP_MODEL_DIR else ResolvedInput(DCPSource(p), p)
    if (p / DCP_MODEL_DIR).is_dir():
        return ResolvedInput(open_source(p), p)
    steps = checkpoint_steps(p)
    if not steps and any((p / f).is_file() for f in FULL_FILES):
        return ResolvedInput(open_source(p), p)
    if steps:
        notes = []
        for ckpt in steps:
            problems = checkpoint_problems(ckpt)
            if not problems:
                notes.append(f"using {ckpt.name}, the newest complete checkpoint in {p}")
                return ResolvedInput(open_source(ckpt), ckpt, notes)
            notes.append(f"skipping {ckpt.name}: {problems[0]}")
        raise CheckpointError(f"no complete checkpoint in {p} ({'; '.join(notes)}): resume training to write one")
    hints = sorted({str(q.parent) for q in p.glob("*/checkpoint-*")} | {str(q.parent) for q in p.glob("*/*/.metadata")} | {str(q.parent) for q in p.glob("*/.metadata")})
    hint = f"; did you mean {hints[0]}?" if hints else f"; expected checkpoint-N/ folders, {DCP_MODEL_DIR}/ or a DCP .metadata inside"
    raise CheckpointError(f"{p} is not a checkpoint{hint}")
