"""Readers of the checkpoint formats a merge accepts, each behind the same face, so that the merge never asks
which format it was given.

A checkpoint to merge may come from any tool and any number of ranks: a sharded DCP folder (FSDP1 or FSDP2, any
number of ranks and nodes, whoever wrote it), a full safetensors state dict (``model.safetensors`` [+ index]) or a
torch.save one (``pytorch_model_fsdp.bin``, read ``weights_only``). Each reader answers ``tensors`` (every stored
tensor's shape and dtype, known before any byte of it is read, so a merge can check names and plan memory and
disk first), ``read`` and, where the bytes lie plain in the files, ``copy_plan``, so that the copy can be the
kernel's and no tensor needs to be in memory. A stored name loses only its FSDP/compile wrapper names here; which
of the stored tensors are the model's weights is ``namespace``'s question.
"""

from __future__ import annotations

import json
import math
import os
import stat
import struct
import warnings
from dataclasses import dataclass
from pathlib import Path

from fsdp_recipes.bounded import JSON_LIMIT, load_json, plain_file_name
from fsdp_recipes.ckpt.dcp_check import check_folder
from fsdp_recipes.ckpt.dcp_layout import UnsafeCheckpointError, unsafe_message
from fsdp_recipes.ckpt.dcp_pickles import guard_torch_dcp, raw_tensor
from fsdp_recipes.ckpt.layout import DCP_MODEL_DIR, SHARD_DIGESTS
from fsdp_recipes.ckpt.namespace import clean_name
from fsdp_recipes.ckpt.shard_digests import digest_problems
from fsdp_recipes.ckpt.torch_names import DTYPE_SIZES, require_this_torch
from fsdp_recipes.errors import CheckpointError

# safetensors' own limit (MAX_HEADER_SIZE): a larger header is not one
SAFETENSORS_HEADER_LIMIT = 100_000_000
SAFETENSORS_DTYPES = {
    "float64": "F64",
    "float32": "F32",
    "float16": "F16",
    "bfloat16": "BF16",
    "int64": "I64",
    "int32": "I32",
    "int16": "I16",
    "int8": "I8",
    "uint8": "U8",
    "bool": "BOOL",
    "float8_e4m3fn": "F8_E4M3",
    "float8_e5m2": "F8_E5M2",
}


def dtype_name(dtype) -> str | None:
    """ "bfloat16" for torch.bfloat16 or "bfloat16"; None stays None (keep the saved dtype)."""
    return None if dtype is None else str(dtype).removeprefix("torch.")


def torch_dtype(name: str):
    import torch

    return getattr(torch, name)


def unconvertible_dtype(dtype: str, what: str) -> str:
    """The one line for a tensor whose dtype the merge does not convert (a dtype torch has, but safetensors or this
    tool does not take: uint16, complex64, float8_e8m0fnu ...)."""
    return (
        f"{what} is {dtype}, which this tool does not convert to safetensors (it converts {', '.join(DTYPE_SIZES)}): "
        "convert the checkpoint's weights with torch to one of those, or use the tool that wrote it"
    )


@dataclass(frozen=True)
class TensorInfo:
    shape: tuple[int, ...]
    # torch name: "float32"
    dtype: str

    @property
    def numel(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n

    def nbytes(self, dtype: str | None = None) -> int:
        dtype = dtype or self.dtype
        if dtype not in DTYPE_SIZES:
            raise CheckpointError(unconvertible_dtype(dtype, "a tensor"))
        return self.numel * DTYPE_SIZES[dtype]


class DCPSource:
    """A sharded ``torch.distributed.checkpoint`` folder, read without a process group. Tensor names are the stored
    keys without FSDP/compile wrapper names; byte entries (pickled objects) are not tensors and never read."""

    kind = "sharded (DCP)"

    def __init__(self, dcp_dir: Path):
        self.path = Path(dcp_dir)
        # a merge reads tensor records only
        layout, problems = check_folder(self.path, byte_records=False)
        if not problems and self.path.name == DCP_MODEL_DIR:
            problems = digest_problems(self.path.parent, (DCP_MODEL_DIR,))
        if problems:
            # complete sentences
            if (
                "refusing to" in problems[0]
                or problems[0].startswith("unreadable")
                or "not the file" in problems[0]
                or SHARD_DIGESTS in problems[0]
            ):
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
        byte copy with no tensor in memory. Only for the common layout: every chunk a whole-row (dim-0) slice
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
        # A DCP class our stand-ins read but this torch has elsewhere (another version's): one line, not torch's error.
        require_this_torch(self._layout, self.path / ".metadata")
        guard_torch_dcp()
        buffers = {
            self.keys[n]: torch.empty(self.tensors[n].shape, dtype=torch_dtype(self.tensors[n].dtype)) for n in names
        }
        # "torch.distributed is disabled ... single process": that is the intent
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)
            try:
                dcp.load(buffers, storage_reader=dcp.FileSystemReader(str(self.path)), no_dist=True)
            except (Exception, CheckpointException) as err:  # noqa: BLE001 (DCP's wraps the record's error; a BaseException)
                if unsafe := _unsafe_cause(err):
                    raise CheckpointError(unsafe_message(self.path / ".metadata", unsafe)) from None
                refused = "Weights only load failed" in str(err)
                raise CheckpointError(
                    f"a tensor record in {self.path} is "
                    + (
                        "refused: it names code or objects that are not tensors (torch.load weights_only)"
                        if refused
                        else f"unreadable ({type(err).__name__})"
                    )
                    + "; use a checkpoint you or your run wrote"
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


def is_shard_name(name) -> bool:
    """A name a safetensors index may give a shard: a .safetensors file directly in its folder ("../../x" or
    "/etc/passwd" would be read from wherever it points, by this reader and by from_pretrained alike)."""
    return plain_file_name(name) and name.endswith(".safetensors")


# Bits per element of every dtype safetensors knows (its Dtype enum, 0.8), whether or not a merge converts it
SAFETENSORS_BITS = {
    "BOOL": 8,
    "F4": 4,
    "F6_E2M3": 6,
    "F6_E3M2": 6,
    "U8": 8,
    "I8": 8,
    "F8_E5M2": 8,
    "F8_E4M3": 8,
    "F8_E8M0": 8,
    "F8_E4M3FNUZ": 8,
    "F8_E5M2FNUZ": 8,
    "I16": 16,
    "U16": 16,
    "F16": 16,
    "BF16": 16,
    "I32": 32,
    "U32": 32,
    "F32": 32,
    "C64": 64,
    "F64": 64,
    "I64": 64,
    "U64": 64,
}
# NotSafetensors.reason of a file that does not even start like one
NO_HEADER = "no safetensors header"


class NotSafetensors(ValueError):
    """A file safetensors would not load, and why (``reason``, in words)."""

    def __init__(self, reason: str):
        super().__init__(reason)
        self.reason = reason


def _whole_numbers(value, count: int | None = None) -> bool:
    return (
        isinstance(value, list)
        and (count is None or len(value) == count)
        and all(type(v) is int and v >= 0 for v in value)
    )


def safetensors_header(path: Path) -> tuple[int, dict, int]:
    """(header length, tensor entries, file size) of a safetensors file, read within SAFETENSORS_HEADER_LIMIT: the one
    place a header is judged, by safetensors' own rules, so that what passes here is what safetensors.safe_open (and
    so from_pretrained) reads. Every entry has a dtype safetensors knows, a shape of whole numbers and data_offsets
    [begin, end] spanning exactly dtype size x product(shape) bytes; in the order of their offsets the entries fill the
    data area from its start to the file's end, each where the one before ends (two tensors over the same bytes would
    read as copies of each other; a gap or a tail is bytes nobody accounts for); ``__metadata__`` maps text to text.
    Whatever else safe_open refuses is refused too, in its own words. NotSafetensors (a ValueError) names the first
    lie: NO_HEADER when the file has none (a git-lfs pointer, a link to /etc/passwd, a file cut inside its header);
    OSError when it cannot be opened. A sound header over a file shorter than it describes (a copy that did not
    finish, no forgery) is returned as it is: each caller says "truncated" in its own words."""
    # a FIFO must not block the open
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    with os.fdopen(fd, "rb") as f:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise NotSafetensors("not a regular file (a folder, a FIFO or a device)")
        size = info.st_size
        try:
            (length,) = struct.unpack("<Q", f.read(8))
            if length > min(size - 8, SAFETENSORS_HEADER_LIMIT):
                raise ValueError
            # UTF-8 only, as safetensors reads it
            header = json.loads(f.read(length).decode("utf-8"))
            if not isinstance(header, dict):
                raise ValueError
        except (struct.error, ValueError, MemoryError, RecursionError):
            raise NotSafetensors(NO_HEADER) from None
    meta = header.pop("__metadata__", {})
    if not isinstance(meta, dict) or not all(isinstance(v, str) for v in meta.values()):
        raise NotSafetensors("its __metadata__ is not a mapping of text to text")
    for name, entry in header.items():
        if not isinstance(entry, dict) or not all(k in entry for k in ("dtype", "shape", "data_offsets")):
            raise NotSafetensors(f"the entry of {name!r} is not a tensor's (dtype, shape, data_offsets)")
        if not isinstance(entry["dtype"], str) or entry["dtype"] not in SAFETENSORS_BITS:
            raise NotSafetensors(f"{name} has dtype {str(entry['dtype'])[:20]!r}, which safetensors does not know")
        if not _whole_numbers(entry["shape"]):
            raise NotSafetensors(f"{name} has shape {str(entry['shape'])[:40]}, which is not a list of whole numbers")
        if not _whole_numbers(entry["data_offsets"], 2) or entry["data_offsets"][0] > entry["data_offsets"][1]:
            raise NotSafetensors(f"{name} has data_offsets {str(entry['data_offsets'])[:40]}, not [begin, end]")
    end, before = 0, None
    for name, entry in sorted(header.items(), key=lambda item: tuple(item[1]["data_offsets"])):
        begin, stop = entry["data_offsets"]
        # safetensors' InvalidOffset
        if begin != end:
            what = (
                f"overlap {before}'s, which end at {end:,}"
                if begin < end
                else f"leave {begin - end:,} bytes before them unaccounted for"
            )
            raise NotSafetensors(f"{name}'s bytes {begin:,}..{stop:,} {what}")
        before = name
        bits = math.prod(entry["shape"]) * SAFETENSORS_BITS[entry["dtype"]]
        if bits % 8 or stop - begin != bits // 8:
            raise NotSafetensors(
                f"{name} is {entry['dtype']} of shape {tuple(entry['shape'])}, {bits / 8:,g} bytes, in "
                f"{stop - begin:,} bytes of the file"
            )
        end = stop
    if size < 8 + length + end:
        return length, header, size
    if size > 8 + length + end:
        raise NotSafetensors(f"{size - 8 - length - end:,} bytes after the last tensor its header describes")
    from safetensors import SafetensorError, safe_open

    # the bar: what safetensors itself reads (a JSON detail the rules above do not spell out)
    try:
        with safe_open(str(path), framework="numpy"):
            pass
    except SafetensorError as err:
        raise NotSafetensors(f"safetensors refuses it ({str(err).split(': ', 1)[-1][:120]})") from None
    return length, header, size


def safetensors_problem(path: Path, err: NotSafetensors) -> str:
    """The one line for a safetensors file of a checkpoint that safetensors_header refused."""
    if err.reason == NO_HEADER:
        return f"{path} is not a readable safetensors file (truncated?): copy the checkpoint again"
    return (
        f"{path} is not a safetensors file safetensors would read: {err.reason}; it was damaged or forged: copy the "
        "checkpoint again from where it was written"
    )


class SafetensorsSource:
    """``model.safetensors`` or an index of shards. Tensors are laid out as plain bytes: copied by the kernel like
    DCP records (the header is read here, without torch), or read one at a time from memory maps to be cast."""

    kind = "full (safetensors)"

    def __init__(self, folder: Path):
        self.path = folder
        index = folder / "model.safetensors.index.json"
        # from_pretrained reads model.safetensors when a folder holds both it and an index: these are the
        # weights it loads
        whole = (folder / "model.safetensors").is_file()
        try:
            files = (
                sorted(set(load_json(index, index.name, JSON_LIMIT)["weight_map"].values()))
                if index.is_file() and not whole
                else ["model.safetensors"]
            )
        except (ValueError, KeyError, TypeError, AttributeError):
            raise CheckpointError(
                f"{index} is not a safetensors index (no weight_map): copy the checkpoint again"
            ) from None
        self.ranks = 1
        self.tensors, self._where = {}, {}
        codes = {code: name for name, code in SAFETENSORS_DTYPES.items()}
        for file in files:
            if not is_shard_name(file):
                raise CheckpointError(
                    f"{index} names {file!r} as a shard, which is not a .safetensors file inside "
                    f"{folder}: give a folder whose index names only its own shard files"
                )
            path = folder / file
            if not path.is_file():
                raise CheckpointError(f"{path} is missing ({index.name} names it): copy the checkpoint again")
            try:
                length, entries, size = safetensors_header(path)
            except NotSafetensors as err:
                raise CheckpointError(safetensors_problem(path, err)) from None
            if size < 8 + length + (end := max((e["data_offsets"][1] for e in entries.values()), default=0)):
                raise CheckpointError(
                    f"{path} is truncated ({size} of {8 + length + end} bytes): copy the checkpoint again"
                )
            for key, entry in entries.items():
                if entry["dtype"] not in codes:
                    raise CheckpointError(f"{path}: {key} has dtype {entry['dtype']}, which this tool does not convert")
                # from_pretrained would load one of them, which is not said
                if clean_name(key) in self.tensors:
                    raise CheckpointError(
                        f"{folder} holds {clean_name(key)} twice ({self._where[clean_name(key)][0]} and {file}): "
                        "copy the checkpoint again"
                    )
                begin, stop = entry["data_offsets"]
                self.tensors[clean_name(key)] = TensorInfo(tuple(entry["shape"]), codes[entry["dtype"]])
                self._where[clean_name(key)] = (file, key, 8 + length + begin, stop - begin)

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
