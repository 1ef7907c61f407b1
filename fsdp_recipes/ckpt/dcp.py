"""Reading a torch.distributed.checkpoint (DCP) folder's layout without importing torch, and without running code.

Importing torch and torch.distributed.checkpoint takes about 2 s here: as long as copying a few GB from the
page cache, so it doubled the time of a merge whose work is a byte copy. Underneath, a DCP folder is plain
data: ``.metadata`` is a pickle of a few small dataclasses (names, shapes, dtypes, which file and byte range
holds each chunk) and each ``.distcp`` file is a run of torch.save records (zip archives). Both are read here
with restricted unpicklers that build stand-ins for exactly the classes those pickles name and import or call
nothing else.

A checkpoint may come from anywhere, and a pickle can run any code it names. DCP itself loads ``.metadata``
with plain ``pickle.load`` (torch 2.13, FileSystemReader.read_metadata) and every byte record (a non-tensor value:
an optimizer's learning rate, a step count) with ``torch.load(weights_only=False)`` (DefaultLoadPlanner.load_bytes).
This module is the one reader of those pickles, and it reads with allow-lists only:

- ``.metadata``: DCP's metadata dataclasses and enums, torch dtypes and sizes. A name this module does not know is
  accepted only when it is a dataclass or enum of ``torch.distributed.checkpoint`` (another torch version's
  metadata); it is never looked up as a dotted attribute path. Every storage path it names must be a file
  directly inside the folder (no ``/``, no ``..``, no symlink out).
- every record of every ``.distcp`` file (``vet_records``): a tensor record may name only torch's tensor rebuild
  and storage types; a byte record only plain data (numbers, strings, lists, dicts, tuples, None, tensors).
- ``guard_torch_dcp`` (through fsdp_recipes/compat/torch_dcp.py, the patch of torch's reader) makes torch's own DCP reader
  go through both checks on every load that follows in this process (resume in train_fsdp.py, the merge's torch
  path), so the checks cannot be skipped by a code path that forgot them; what it runs is ``vetted_metadata`` and
  ``vetted_byte_record`` here. A vetted ``.metadata`` is unpickled as the very bytes that were vetted, by the same
  (Python's) unpickler. A byte record is a zip archive, and Python's zipfile and torch's reader (miniz) do not read
  every archive alike (a second central directory, names that differ only in case): so a byte record is read by
  torch's own restricted reader (``torch.load(weights_only=True)``: the parser that would have run the pickle is the
  one that refuses it), and torch's loader then gets a record re-written from that plain value, never the original.
  ``vet_records`` checks byte records the same way before a resume starts.

UnsafeCheckpointError names what was refused; nothing a refused file names is ever imported or called.

Another torch version's checkpoint is not an unsafe or incomplete one: every dtype the installed torch has is read
by its name (nothing is looked up), and a dtype name or a ``torch.distributed.checkpoint`` class this torch does not
have (a newer torch's float8 variant, a class a newer DCP added) raises ``UnknownToThisVersion``
(fsdp_recipes.errors): "unreadable by this version", never a problem of the folder, so that nothing that may be a
good checkpoint is called incomplete, passed over or deleted because of it.

Size: one module on purpose (about 940 lines). It is the only place allowed to unpickle anything from a DCP folder
(tests/unit/ckpt/test_pickles.py fails on a pickle read anywhere else): the allow-lists, the restricted unpicklers,
the record vetting and the readers that use them are kept together so that one file holds every line a
reviewer of that guarantee has to read; with them, what check_folder checks of what it read (that the chunks make
up each tensor, the shard digests), so that a folder passes or fails in one place.
"""

from __future__ import annotations

import io
import itertools
import json
import math
import os
import pickle
import pickletools
import re
import struct
import warnings
import zipfile
from dataclasses import dataclass, field
from pathlib import Path

from fsdp_recipes.bounded import plain_file_name
from fsdp_recipes.errors import UnknownToThisVersion

# Every dtype of torch 2.13, by name: [n for n in dir(torch) if isinstance(getattr(torch, n), torch.dtype)] (a test
# checks this list against the installed torch). A pickle names a dtype as torch.<name>; the name is all we keep.
TORCH_DTYPE_NAMES = frozenset(
    {
        "bfloat16",
        "bit",
        "bits16",
        "bits1x8",
        "bits2x4",
        "bits4x2",
        "bits8",
        "bool",
        "cdouble",
        "cfloat",
        "chalf",
        "complex128",
        "complex32",
        "complex64",
        "double",
        "float",
        "float16",
        "float32",
        "float4_e2m1fn_x2",
        "float64",
        "float8_e4m3fn",
        "float8_e4m3fnuz",
        "float8_e5m2",
        "float8_e5m2fnuz",
        "float8_e8m0fnu",
        "half",
        "int",
        "int1",
        "int16",
        "int2",
        "int3",
        "int32",
        "int4",
        "int5",
        "int6",
        "int64",
        "int7",
        "int8",
        "long",
        "qint32",
        "qint8",
        "quint2x4",
        "quint4x2",
        "quint8",
        "short",
        "uint1",
        "uint16",
        "uint2",
        "uint3",
        "uint32",
        "uint4",
        "uint5",
        "uint6",
        "uint64",
        "uint7",
        "uint8",
    }
)
# a name of torch that reads as a dtype (or a legacy storage type) another torch version may have and this one lacks
_DTYPE_LIKE = re.compile(r"(?:b?float|complex|u?int|qu?int|bits?)\d\w*|[A-Z]\w*Storage")
# bytes per element of the dtypes (torch names) a merge converts: a tensor of any other dtype is refused in one line
DTYPE_SIZES = {
    "float64": 8,
    "float32": 4,
    "float16": 2,
    "bfloat16": 2,
    "int64": 8,
    "int32": 4,
    "int16": 2,
    "int8": 1,
    "uint8": 1,
    "bool": 1,
    "float8_e4m3fn": 1,
    "float8_e5m2": 1,
}
# torch.save names a tensor's storage by its legacy typed-storage class
_STORAGE_DTYPES = {
    "DoubleStorage": "float64",
    "FloatStorage": "float32",
    "HalfStorage": "float16",
    "BFloat16Storage": "bfloat16",
    "LongStorage": "int64",
    "IntStorage": "int32",
    "ShortStorage": "int16",
    "CharStorage": "int8",
    "ByteStorage": "uint8",
    "BoolStorage": "bool",
}
# the other storage classes torch.save names (complex and quantized tensors): vetted, never copied raw
_OTHER_STORAGES = frozenset(
    {
        "ComplexDoubleStorage",
        "ComplexFloatStorage",
        "QInt32Storage",
        "QInt8Storage",
        "QUInt2x4Storage",
        "QUInt4x2Storage",
        "QUInt8Storage",
    }
)


def torch_version() -> str:
    """The installed torch's version, read from its package metadata (torch itself is not imported)."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("torch")
    except PackageNotFoundError:
        return "(not installed)"


def _unknown_torch_name(module: str, name: str) -> str | None:
    """ "dtype" or "DCP class" when ``module.name`` is one another torch version may have and this one has not
    (never imported or called: the caller refuses it either way, as unreadable by this version); None otherwise."""
    if module == "torch" and _DTYPE_LIKE.fullmatch(name) and name not in TORCH_DTYPE_NAMES:
        return "dtype"
    if module.startswith(_DCP_MODULE) and name.isidentifier() and all(p.isidentifier() for p in module.split(".")):
        import importlib

        try:
            found = importlib.import_module(module).__dict__  # torch's own module: runs only torch's code
        except ImportError:
            return "DCP class"  # a module of torch.distributed.checkpoint this torch does not have
        return "DCP class" if name not in found else None
    return None


@dataclass(frozen=True)
class Chunk:
    offsets: tuple[int, ...]
    sizes: tuple[int, ...]


@dataclass(frozen=True)
class TensorEntry:
    dtype: str  # torch name: "float32"
    shape: tuple[int, ...]
    chunks: tuple[Chunk, ...]


@dataclass(frozen=True)
class Stored:
    """Where one chunk's torch.save record lies: a byte range of a .distcp file."""

    relative_path: str
    offset: int
    length: int
    transformed: bool  # compressed or otherwise not a plain record


@dataclass
class Layout:
    tensors: dict[str, TensorEntry]  # DCP key ("model.lm_head.weight") -> entry; byte entries left out
    storage: dict[tuple[str, tuple[int, ...] | None], Stored]  # (key, chunk offsets) -> record
    byte_keys: frozenset[str] = frozenset()  # keys of byte entries (pickled values): vetted, never weights
    # the DCP classes .metadata names, (module, name): read here by stand-ins whatever module holds them; torch's own
    # reader needs each where it is named (require_this_torch)
    dcp_names: frozenset[tuple[str, str]] = field(default=frozenset(), compare=False)


# ----------------------------------------------------------------------------------------------- .metadata


class _Standin:
    """Any DCP metadata dataclass: its pickled state becomes attributes (an enum's value: ``args``)."""

    def __init__(self, *args, **kwargs):
        self.args = args
        self.__dict__.update(kwargs)

    def __setstate__(self, state):
        if (
            isinstance(state, tuple)
            and len(state) == 2
            and isinstance(state[1], dict)
            and (state[0] is None or isinstance(state[0], dict))
        ):
            state = {**(state[0] or {}), **state[1]}  # (dict, slots) of a slotted dataclass
        if isinstance(state, dict):
            self.__dict__.update(state)
        else:
            self.state = state  # TensorProperties pickles a tuple: (dtype, layout, ...)


_DCP_CLASSES = (
    "Metadata",
    "TensorStorageMetadata",
    "BytesStorageMetadata",
    "TensorProperties",
    "ChunkStorageMetadata",
    "MetadataIndex",
    "StorageMeta",
    "_StorageInfo",
)


class _UnknownGlobal(pickle.UnpicklingError):
    pass


class UnsafeCheckpointError(pickle.UnpicklingError):
    """A checkpoint pickle names something that is not checkpoint data: it is never unpickled."""


class EscapingPathError(UnsafeCheckpointError):
    """DCP metadata names a storage file outside its own folder."""


_DCP_MODULE = "torch.distributed.checkpoint."


def _is_dcp_data_class(module: str, name: str) -> bool:
    """A DCP metadata dataclass or enum this module has no stand-in for (a newer torch). Importing a module of
    torch.distributed.checkpoint runs only torch's own code; a dotted name (an attribute path) is never followed."""
    import dataclasses
    import enum
    import importlib

    if not module.startswith(_DCP_MODULE) or not name.isidentifier():
        return False
    try:
        obj = importlib.import_module(module).__dict__.get(name)
    except ImportError:
        return False
    return isinstance(obj, type) and (dataclasses.is_dataclass(obj) or issubclass(obj, enum.Enum))


class _MetadataUnpickler(pickle.Unpickler):
    _standins = {name: type(name, (_Standin,), {}) for name in _DCP_CLASSES}

    def __init__(self, file):
        super().__init__(file)
        self.dcp_names: set[tuple[str, str]] = set()

    def find_class(self, module, name):
        if module.startswith(_DCP_MODULE):
            self.dcp_names.add((module, name))
        if module.startswith(_DCP_MODULE) and name in self._standins:
            return self._standins[name]
        if module.startswith(_DCP_MODULE) and name == "_MEM_FORMAT_ENCODING":
            return lambda value: value
        if module == "torch" and name in TORCH_DTYPE_NAMES:
            return name
        if (module, name) == ("torch", "Size"):
            return lambda dims=(): tuple(dims)
        if (module, name) == ("torch.serialization", "_get_layout"):
            return lambda layout: layout
        if module == "pathlib" and name in ("PosixPath", "WindowsPath", "PurePosixPath", "PureWindowsPath", "Path"):
            return lambda *parts: "/".join(map(str, parts))  # StorageMeta.checkpoint_id, unused
        if (module, name) == ("collections", "OrderedDict"):
            return dict
        if _is_dcp_data_class(module, name):
            return self._standins.setdefault(name, type(name, (_Standin,), {}))
        if kind := _unknown_torch_name(module, name):
            raise UnknownToThisVersion(".metadata", f"{module}.{name}", kind, torch_version())
        raise UnsafeCheckpointError(f"{module}.{name}")


def _layout_from(metadata) -> Layout:
    """Our plain view of a DCP Metadata object, torch's or the stand-in."""
    tensors, byte_keys = {}, set()
    for key, meta in metadata.state_dict_metadata.items():
        if not hasattr(meta, "chunks"):
            byte_keys.add(key)  # BytesStorageMetadata: pickled objects, never model weights
            continue
        props = meta.properties
        dtype = props.dtype if hasattr(props, "dtype") else props.state[0]
        tensors[key] = TensorEntry(
            str(dtype).removeprefix("torch."),
            tuple(meta.size),
            tuple(Chunk(tuple(c.offsets), tuple(c.sizes)) for c in meta.chunks),
        )
    storage = {}
    for index, info in (metadata.storage_data or {}).items():
        offset = getattr(index, "offset", None)  # a default left out of the pickled state
        where = (index.fqn, None if offset is None else tuple(offset))
        if not plain_file_name(info.relative_path):  # torch's reader would open a file elsewhere
            raise EscapingPathError(f"storage path {info.relative_path!r}")
        storage[where] = Stored(
            info.relative_path, info.offset, info.length, bool(getattr(info, "transform_descriptors", None))
        )
    return Layout(tensors, storage, frozenset(byte_keys))


def read_layout(dcp_dir: Path) -> Layout:
    """The folder's tensors and where their chunks lie. Raises UnsafeCheckpointError when ``.metadata`` names
    anything but DCP metadata (it could run code), UnknownToThisVersion when it names a dtype or DCP class this
    torch does not have (another version's checkpoint), another exception when it is unreadable."""
    path = Path(dcp_dir) / ".metadata"
    with open(path, "rb") as f:
        if (size := os.fstat(f.fileno()).st_size) > METADATA_LIMIT:  # a claimed length is allocated before it is read
            raise MetadataTooLarge(f"{size / 2**30:.1f} GiB, over the {METADATA_LIMIT >> 30} GiB this reader takes")
        try:
            return _read_metadata(f)
        except UnknownToThisVersion as err:
            raise err.at(path) from None


# A 70B model's .metadata over 512 ranks (every tensor and Adam moment, a chunk per rank) is ~0.1 GiB; a file that
# claims more (a hole of zeros behind a pickle opcode's length) would be read whole into memory
METADATA_LIMIT = 1 << 30


class MetadataTooLarge(ValueError):
    pass


def _read_metadata(f) -> Layout:
    unpickler = _MetadataUnpickler(f)
    layout = _layout_from(unpickler.load())
    layout.dcp_names = frozenset(unpickler.dcp_names)
    return layout


# where torch 2.13 keeps the DCP classes its checkpoints name (a test checks each against the installed torch)
_DCP_NAMES_OF_THIS_TORCH = frozenset(
    {
        *(
            (f"{_DCP_MODULE}metadata", name)
            for name in (
                "Metadata",
                "TensorStorageMetadata",
                "BytesStorageMetadata",
                "TensorProperties",
                "ChunkStorageMetadata",
                "MetadataIndex",
                "StorageMeta",
                "_MEM_FORMAT_ENCODING",
            )
        ),
        (f"{_DCP_MODULE}filesystem", "_StorageInfo"),
    }
)


def require_this_torch(layout: Layout, path) -> None:
    """UnknownToThisVersion unless every DCP class ``.metadata`` names is where it names it in the installed torch
    (a class another torch version moved or added: the stand-ins here read it, torch's own reader, which a resume
    uses, cannot). Imports a module of torch.distributed.checkpoint only for a name this torch's checkpoints do not use."""
    import importlib

    for module, name in sorted(layout.dcp_names - _DCP_NAMES_OF_THIS_TORCH):
        try:
            if hasattr(importlib.import_module(module), name):
                continue
        except ImportError:
            pass
        raise UnknownToThisVersion(path, f"{module}.{name}", "DCP class", torch_version())


def unsafe_message(path: Path, err: UnsafeCheckpointError) -> str:
    if isinstance(err, EscapingPathError):
        return (
            f"{path} names {err}, outside its folder: refusing to read it (a checkpoint's files lie inside it); "
            "use a checkpoint you or your training run wrote"
        )
    if isinstance(err, UnsafeRecordError):
        return f"{path}: {err}: refusing to unpickle it (a pickle can run code); use a checkpoint you or your training run wrote"
    return (
        f"{path} names {err}, which DCP metadata never holds: refusing to unpickle it (a pickle can run code); "
        "use a checkpoint you or your training run wrote"
    )


def _storage_file_problem(folder: Path, name: str) -> str | None:
    """A storage file that is not a regular file directly inside ``folder`` (links resolved): named, else None."""
    import stat

    path = folder / name
    if os.path.dirname(os.path.realpath(path)) != os.path.realpath(folder):
        return f"storage path {name!r} (a link to {os.path.realpath(path)})"
    try:
        mode = os.stat(path).st_mode
    except OSError:
        return None  # missing: torch's own error names it
    return None if stat.S_ISREG(mode) else f"storage path {name!r} (not a regular file)"


def check_folder(dcp_dir: Path, byte_records: bool = True) -> tuple[Layout | None, list[str]]:
    """(layout or None, what makes the folder unreadable or unsafe: missing, unreadable or unsafe .metadata, missing,
    truncated or escaping .distcp files, records that name more than their allow-list). ``byte_records=False``
    leaves byte records unvetted, for a reader that never loads them (the merge reads tensors only).

    Raises UnknownToThisVersion when ``.metadata`` or a record names a dtype or DCP class this torch does not have:
    that is no problem of the folder (it may be complete), and a caller must not treat it as one."""
    meta_path = Path(dcp_dir) / ".metadata"
    if not meta_path.is_file():
        return None, [f"missing {meta_path}"]
    try:
        layout = read_layout(dcp_dir)
    except UnknownToThisVersion:
        raise
    except UnsafeCheckpointError as err:
        return None, [unsafe_message(meta_path, err)]
    except MetadataTooLarge as err:
        return None, [f"unreadable {meta_path} ({err})"]
    except Exception as err:  # a truncated pickle raises several different types
        return None, [f"unreadable {meta_path} ({type(err).__name__})"]
    if problems := chunk_problems(layout, meta_path):
        return layout, problems
    needed: dict[str, int] = {}
    for info in layout.storage.values():
        needed[info.relative_path] = max(needed.get(info.relative_path, 0), info.offset + info.length)
    problems = []
    for name, size in sorted(needed.items()):
        path = Path(dcp_dir) / name
        if (problem := _storage_file_problem(Path(dcp_dir), name)) and "a link" in problem:
            problems.append(unsafe_message(meta_path, EscapingPathError(problem)))
        elif not path.is_file():
            problems.append(f"missing {path}")
        elif path.stat().st_size < size:
            problems.append(f"truncated {path} ({path.stat().st_size} of {size} bytes)")
    if not problems:
        problems = vet_records(dcp_dir, layout, byte_records)
    if not problems:  # after the vetting, which names a record holding code for what it is
        problems = record_size_problems(layout, meta_path)
    return layout, problems


def record_size_problems(layout: Layout, meta_path: Path) -> list[str]:
    """A plain tensor record that holds fewer bytes than its chunk (a compressed one may; a plain one never): the
    merge and the resume would fail on it only once they read it."""
    for key, entry in layout.tensors.items():
        for chunk in entry.chunks:
            stored = layout.storage.get((key, chunk.offsets))
            needs = math.prod(chunk.sizes) * DTYPE_SIZES.get(entry.dtype, 0)
            if stored is not None and not stored.transformed and stored.length < needs:
                return [
                    f"unreadable {meta_path}: the chunk of {key!r} at {list(chunk.offsets)} of size {list(chunk.sizes)} has a "
                    f"record of {stored.length:,} bytes, fewer than its {needs:,}: use another checkpoint-N, or copy this one "
                    "again from where it was written"
                ]
    return []


# Grid cells a tensor's chunks are checked over: a writer's layout (a chunk per rank along one dimension, or a grid of
# them: FSDP x tensor parallel) has about as many cells as chunks; only a layout made up by hand has many more, and
# walking them would make the check itself the attack (a "brick" layout of 2,000 chunks: 1.6 s a tensor)
CELLS_PER_CHUNK, CELLS_EXTRA = 16, 10_000


def chunk_problems(layout: Layout, meta_path: Path) -> list[str]:
    """Whether every tensor's chunks make it up exactly: each inside the tensor, with a record to read it from, none
    overlapping another, every element in one. The first one that does not, as a problem line. Readers trust these
    offsets: chunks that overlap leave other rows as they were before the read (zeros in a merge), silently."""
    for key, entry in layout.tensors.items():
        if (detail := _chunk_problem(key, entry, layout.storage)) is not None:
            return [
                f"unreadable {meta_path}: the chunks of {key!r} {detail}, so they do not make up the tensor: use another "
                "checkpoint-N, or copy this one again from where it was written"
            ]
    return []


def _chunk_problem(key: str, entry: TensorEntry, storage) -> str | None:
    shape, dims = entry.shape, len(entry.shape)
    for chunk in entry.chunks:
        where = f"at {list(chunk.offsets)} of size {list(chunk.sizes)}"
        if len(chunk.offsets) != dims or len(chunk.sizes) != dims:
            return f"include one {where}, with another number of dimensions than the tensor's {list(shape)}"
        if any(o < 0 or n < 0 or o + n > d for o, n, d in zip(chunk.offsets, chunk.sizes, shape)):
            return f"include one {where}, outside the tensor's {list(shape)}"
        if (key, chunk.offsets) not in storage:
            return f"include one {where} that no record holds"
    if math.prod(shape) == 0:
        return None
    chunks = [c for c in entry.chunks if math.prod(c.sizes)]
    held = sum(math.prod(c.sizes) for c in chunks)
    if held < math.prod(shape):  # accelerate PR #4206's FSDP2 adapter-only saves kept rank 0's slice alone
        return f"hold {held:,} of its {math.prod(shape):,} elements (a rank's slice is missing, or the file was edited)"
    if held > math.prod(shape):
        return f"hold {held:,} elements where the tensor {list(shape)} has {math.prod(shape):,} (the file was edited or damaged)"
    # as many elements as the tensor: they make it up unless two overlap. Over the grid the chunk edges cut, each
    # cell must be in exactly one chunk
    edges = [
        sorted({0, d, *(c.offsets[i] for c in chunks), *(c.offsets[i] + c.sizes[i] for c in chunks)})
        for i, d in enumerate(shape)
    ]
    if (cells := math.prod(len(e) - 1 for e in edges)) > (limit := CELLS_PER_CHUNK * len(chunks) + CELLS_EXTRA):
        return f"cut it into {cells:,} pieces, more than any writer's layout of {len(chunks):,} chunks (this reader checks up to {limit:,})"
    index = [{edge: i for i, edge in enumerate(e)} for e in edges]
    seen: set[tuple[int, ...]] = set()
    for chunk in chunks:
        ranges = [range(index[i][o], index[i][o + n]) for i, (o, n) in enumerate(zip(chunk.offsets, chunk.sizes))]
        for cell in itertools.product(*ranges):
            if cell in seen:
                return f"overlap (one at {list(chunk.offsets)} of size {list(chunk.sizes)} covers elements another holds: the file was edited or damaged)"
            seen.add(cell)
    return None


# ----------------------------------------------------------------------------------------------- .distcp records


class FileSlice(io.RawIOBase):
    """A read-only window on part of a file: zipfile (and torch.load) read one record of a .distcp file through it."""

    def __init__(self, f, start: int, length: int):
        self.f, self.start, self.length, self.pos = f, start, length, 0

    def readable(self):
        return True

    def seekable(self):
        return True

    def tell(self):
        return self.pos

    def seek(self, offset, whence=0):
        self.pos = offset if whence == 0 else self.pos + offset if whence == 1 else self.length + offset
        return self.pos

    def readinto(self, buffer):
        n = max(0, min(len(buffer), self.length - self.pos))
        self.f.seek(self.start + self.pos)
        data = self.f.read(n)
        buffer[: len(data)] = data
        self.pos += len(data)
        return len(data)


@dataclass(frozen=True)
class RawTensor:
    """A tensor record whose data is one plain little-endian byte run in the file."""

    dtype: str
    shape: tuple[int, ...]
    data_offset: int  # in the .distcp file
    nbytes: int


# The opcodes torch.save writes in a tensor record's data.pkl (protocol 2; every one of them torch's weights_only
# reader takes too). A record with any other is read by torch.
_RECORD_OPCODES = {
    "PROTO",
    "GLOBAL",
    "BINPERSID",
    "BINPUT",
    "LONG_BINPUT",
    "BINUNICODE",
    "BININT",
    "BININT1",
    "BININT2",
    "LONG1",
    "EMPTY_TUPLE",
    "MARK",
    "TUPLE",
    "TUPLE1",
    "TUPLE2",
    "TUPLE3",
    "NEWFALSE",
    "REDUCE",
    "STOP",
}
_MAX_DIMS = 64


class _StorageType:
    def __init__(self, dtype: str):
        self.dtype = dtype


@dataclass(frozen=True)
class _Storage:
    dtype: str
    key: str
    numel: int


class _PlainTensor:
    """What _rebuild_tensor_v2 builds from a plain record: a contiguous, fresh tensor (checked as it is built)."""

    def __init__(self, storage, offset, size, stride, requires_grad, hooks, *metadata):
        if (
            type(storage) is not _Storage
            or type(offset) is not int
            or offset != 0
            or type(size) is not tuple
            or type(stride) is not tuple
            or len(size) != len(stride)
            or len(size) > _MAX_DIMS
            or any(type(d) is not int or d < 0 for d in (*size, *stride))
            or requires_grad is not False
            or type(hooks) is not dict
            or hooks
            or metadata not in ((), (None,))
        ):
            raise ValueError(
                "not a plain tensor record"
            )  # a view's flags (neg, conj), hooks, odd types: torch reads it
        self.storage, self.shape, self.stride = storage, size, stride

    def __setstate__(self, state):
        raise ValueError("BUILD on the tensor")  # torch would call set_() with it


class _RecordUnpickler(pickle.Unpickler):
    """data.pkl of a plain torch.save'd tensor: _rebuild_tensor_v2(storage, 0, size, stride, False, OrderedDict()),
    its storage a persistent id ("storage", <dtype>Storage, key, location, numel); anything else raises."""

    def __init__(self, data: bytes):
        with warnings.catch_warnings():  # genops decodes a STRING opcode's escapes, warning on a bad one
            warnings.simplefilter("ignore")
            if any(op.name not in _RECORD_OPCODES for op, _, _ in pickletools.genops(data)):
                raise ValueError("an opcode torch.save does not write in a tensor record")
        super().__init__(io.BytesIO(data))
        self.storages = []

    def find_class(self, module, name):
        if (module, name) == ("torch._utils", "_rebuild_tensor_v2"):
            return _PlainTensor
        if module == "torch" and name in _STORAGE_DTYPES:
            return _StorageType(_STORAGE_DTYPES[name])
        if (module, name) == ("collections", "OrderedDict"):
            return dict
        raise _UnknownGlobal(f"{module}.{name}")  # not a plain tensor record: torch's weights_only loader reads it

    def persistent_load(self, pid):
        if (
            type(pid) is not tuple
            or len(pid) != 5
            or pid[0] != "storage"
            or type(pid[1]) is not _StorageType
            or type(pid[2]) is not str
            or type(pid[3]) is not str
            or type(pid[4]) is not int
            or self.storages
        ):
            raise ValueError("not one plain storage")
        self.storages.append(_Storage(pid[1].dtype, pid[2], pid[4]))
        return self.storages[0]

    def tensor(self) -> _PlainTensor:
        result = self.load()
        if type(result) is not _PlainTensor:
            raise ValueError("not a tensor")
        return result


def _row_major(shape: tuple[int, ...]) -> tuple[int, ...]:
    strides, step = [], 1
    for d in reversed(shape):
        strides.append(step)
        step *= max(d, 1)
    return tuple(reversed(strides))


def raw_tensor(dcp_dir: Path, stored: Stored) -> RawTensor | None:
    """Where a chunk's bytes lie when its record is one contiguous, uncompressed, little-endian tensor from the
    start of its storage, laid out exactly as torch.save writes it (``_torch_save_layout``, ``_RecordUnpickler``);
    None otherwise (the caller then loads it with torch, and copies what torch reads)."""
    if stored.transformed:
        return None
    try:
        with open(Path(dcp_dir) / stored.relative_path, "rb") as f:
            record = FileSlice(f, stored.offset, stored.length)
            members = _torch_save_layout(record, stored.length)
            if members is None or "data.pkl" not in members:
                return None
            data = {name: info for name, info in members.items() if name.startswith("data/")}
            if len(data) != 1 or (
                "byteorder" in members and stored_member(record, members["byteorder"], 16) != b"little"
            ):
                return None
            tensor = _RecordUnpickler(stored_member(record, members["data.pkl"], _RECORD_LIMIT)).tensor()
            [(data_name, data_info)] = data.items()
            numel = 1
            for d in tensor.shape:
                numel *= d
            dtype = tensor.storage.dtype
            if (
                f"data/{tensor.storage.key}" != data_name
                or tensor.storage.numel != numel
                or data_info.file_size != numel * DTYPE_SIZES[dtype]
                or any(s != r for s, r, d in zip(tensor.stride, _row_major(tensor.shape), tensor.shape) if d > 1)
            ):
                return None
            return RawTensor(dtype, tensor.shape, stored.offset + _member_start(record, data_info), data_info.file_size)
    except Exception:
        return None


# The members of a torch.save archive (beside data/<key>, one per storage), under one folder name.
_TORCH_SAVE_MEMBERS = {
    "data.pkl",
    ".format_version",
    ".storage_alignment",
    "byteorder",
    "version",
    ".data/serialization_id",
}
_END, _END64, _LOCATOR64 = b"PK\x05\x06", b"PK\x06\x06", b"PK\x06\x07"
_FILE_VERSIONS = range(1, 4)  # torch.save's record format versions up to torch 2.13's (3); a newer one goes to torch


def _torch_save_layout(record, length: int) -> dict[str, zipfile.ZipInfo] | None:
    """The members of a torch.save record by name (``data.pkl``, ``data/0``, ...), when the archive is laid out as
    torch.save writes it, so that Python's zip reader and torch's (miniz) cannot see different members: one folder
    name, known member names (no NUL, no duplicate, no "directory" attribute, one zip64 field at most), stored
    uncompressed with no flag torch's reader refuses, the small text members ASCII, a record version torch 2.13
    writes, one after another from
    byte 0 (each followed by nothing or its data descriptor), then the central directory exactly where the end
    record (or its zip64 record) puts it, then the end record, then nothing. None otherwise."""
    infos = zipfile.ZipFile(record).infolist()
    record.seek(length - 22)
    end = record.read(22)
    if len(end) != 22 or end[:4] != _END or not infos:
        return None
    disk, cd_disk, disk_entries, entries, cd_size, cd_offset, comment = struct.unpack("<HHHHIIH", end[4:22])
    if disk or cd_disk or disk_entries != entries or comment:
        return None  # torch's reader refuses multi-disk archives
    end_at = length - 22
    record.seek(max(0, length - 42))
    locator = record.read(20)
    if locator[:4] == _LOCATOR64:  # torch writes the zip64 end record (56 bytes) and its locator before the end record
        end_at = struct.unpack("<Q", locator[8:16])[0]
        record.seek(end_at)
        end64 = record.read(56)
        size, _, _, disk, cd_disk, disk_entries = struct.unpack("<QHHIIQ", end64[4:32])
        if (
            len(end64) != 56
            or end64[:4] != _END64
            or end_at + 56 != length - 42
            or size != 44
            or disk
            or cd_disk
            or struct.unpack("<I", locator[4:8])[0]
            or struct.unpack("<I", locator[16:20])[0] != 1
        ):
            return None
        numbers = struct.unpack("<QQQ", end64[32:56])
        if disk_entries != numbers[0]:
            return None
        if any(
            short not in (full, saturated)
            for short, full, saturated in zip((entries, cd_size, cd_offset), numbers, (0xFFFF, 0xFFFFFFFF, 0xFFFFFFFF))
        ):
            return None  # the two end records disagree: readers may differ on which they believe
        entries, cd_size, cd_offset = numbers
    if entries != len(infos) or cd_offset + cd_size != end_at:
        return None
    record.seek(cd_offset)
    directory, at = record.read(cd_size), 0
    for info in infos:  # the directory walked by its own lengths, as miniz walks it, names the members zipfile found
        if directory[at : at + 4] != b"PK\x01\x02" or len(directory) < at + 46:
            return None
        name_len, extra_len, comment_len, disk_start, _, external = struct.unpack(
            "<HHHHHI", directory[at + 28 : at + 42]
        )
        name = directory[at + 46 : at + 46 + name_len]
        if (
            name != _raw_name(info)
            or b"\0" in name
            or disk_start
            or external & 0x10
            or not _one_zip64_field(directory[at + 46 + name_len : at + 46 + name_len + extra_len])
        ):
            return None  # a "directory" member torch extracts nothing from, another disk, readers picking other zip64 fields
        at += 46 + name_len + extra_len + comment_len
    if at != cd_size:
        return None
    folder = infos[0].filename.split("/", 1)[0]
    members, position = {}, 0
    for info in sorted(infos, key=lambda i: i.header_offset):
        name = info.filename.removeprefix(folder + "/")
        if (
            info.filename == name
            or name in members
            or info.compress_type != zipfile.ZIP_STORED
            or info.flag_bits & ~0x808
            or info.compress_size != info.file_size
            or not (name in _TORCH_SAVE_MEMBERS or re.fullmatch(r"data/\d+", name))
            or info.header_offset != position
        ):
            return None
        members[name] = info
        position = _member_start(record, info) + info.file_size
        if info.flag_bits & 0x8:  # a data descriptor follows: signature, CRC, sizes (4 or 8 bytes each)
            record.seek(position)
            descriptor = record.read(4)
            position += (16 if not info.file_size >> 32 else 24) if descriptor == b"PK\x07\x08" else 0
    if position != cd_offset:
        return None
    texts = {
        name: stored_member(record, info, 64)
        for name, info in members.items()
        if name != "data.pkl" and not name.startswith("data/")
    }
    numbers = [texts[n] for n in ("version", ".format_version", ".storage_alignment") if n in texts]
    if (
        not all(t.isascii() for t in texts.values())
        or not all(t.strip().isdigit() and len(t) < 20 for t in numbers)
        or "version" not in texts
        or int(texts["version"]) not in _FILE_VERSIONS
    ):
        return None  # torch reads these as text and numbers (its version, the serialization id) and refuses the record
    return members


def _one_zip64_field(extra: bytes) -> bool:
    """A central directory entry's extra fields, read by their own lengths to the end, hold at most one zip64 field
    (Python's zipfile reads the last, miniz the first)."""
    at, zip64 = 0, 0
    while at < len(extra):
        if at + 4 > len(extra):
            return False
        kind, size = struct.unpack("<HH", extra[at : at + 4])
        zip64 += kind == 1
        at += 4 + size
    return at == len(extra) and zip64 <= 1


def _raw_name(info: zipfile.ZipInfo) -> bytes:
    """A member's name as its headers hold it (zipfile's ``filename`` stops at a NUL; this does not)."""
    return info.orig_filename.encode("utf-8" if info.flag_bits & 0x800 else "cp437")


def _member_start(stream, info: zipfile.ZipInfo) -> int:
    """Where a member's bytes start in ``stream``: after its zip local file header, name and extra field. The
    local header must name the member the central directory names (as zipfile checks)."""
    stream.seek(info.header_offset)
    local = stream.read(30)
    if len(local) != 30 or local[:4] != b"PK\x03\x04":
        raise ValueError(f"no local file header for {info.filename!r}")
    name_len, extra_len = struct.unpack("<HH", local[26:30])
    if stream.read(name_len) != _raw_name(info):
        raise ValueError(f"the local header of {info.filename!r} names another file")
    return info.header_offset + 30 + name_len + extra_len


def stored_member(stream, info: zipfile.ZipInfo, limit: int) -> bytes:
    """The bytes of an uncompressed member of a torch.save record, at most ``limit``, read as torch's own reader reads
    them: without checking the zip CRC-32. ``torch.save`` writes a CRC of zero under
    ``torch.serialization.set_crc32_options(False)`` (our checkpoint shards, fsdp_recipes.compat.async_dcp; anyone's),
    and torch.load never checks it, where Python's ``ZipFile.read`` raises "Bad CRC-32" on such a record."""
    if info.compress_type != zipfile.ZIP_STORED or info.file_size > limit:
        raise ValueError(f"{info.filename!r}: compressed, or more than {limit} bytes")
    stream.seek(_member_start(stream, info))
    data = stream.read(info.file_size)
    if len(data) != info.file_size:
        raise ValueError(f"{info.filename!r} is cut off")
    return data


# ----------------------------------------------------------------------------------------------- vetting every record


class UnsafeRecordError(UnsafeCheckpointError):
    """A .distcp record whose pickle names more than its kind of record may."""


_RECORD_LIMIT = 256 << 20  # bytes of one record's pickle (not its tensor data): DCP's are a few hundred bytes


class _VettingUnpickler(pickle.Unpickler):
    """Reads a record's data.pkl only to learn what it names: tensor rebuilds and storages (tensor records), plus
    plain data (byte records). Everything it builds is a stand-in; nothing it names is imported or called."""

    def __init__(self, file, plain_data: bool):
        super().__init__(file)
        self.plain_data = plain_data

    def find_class(self, module, name):
        if (module, name) in (("torch._utils", "_rebuild_tensor_v2"), ("torch._utils", "_rebuild_tensor_v3")):
            return lambda *args: ("tensor",)  # v3: dtypes without a legacy storage class (uint16, float8 ...)
        if module == "torch" and (name in _STORAGE_DTYPES or name in _OTHER_STORAGES or name in TORCH_DTYPE_NAMES):
            return name
        if (module, name) == ("torch.storage", "UntypedStorage"):
            return name
        if (module, name) in (("collections", "OrderedDict"), ("torch", "Size")):
            return lambda *args: {} if name == "OrderedDict" else tuple(*args)
        if self.plain_data and module == "builtins" and name in ("set", "frozenset", "complex"):
            return lambda *args: None
        if kind := _unknown_torch_name(module, name):
            raise UnknownToThisVersion("a record", f"{module}.{name}", kind, torch_version())
        raise UnsafeRecordError(f"{module}.{name}")

    def persistent_load(self, pid):
        return tuple(pid)  # ("storage", dtype name, key, location, numel)


def vet_record(stream, plain_data: bool) -> None:
    """Raise UnsafeCheckpointError unless the torch.save record in ``stream`` names only its allow-list (a tensor
    record: a tensor; a byte record: plain data and tensors); OSError/zipfile.BadZipFile/ValueError when it is not a
    readable record at all."""
    archive = zipfile.ZipFile(stream)
    pkl = [z for z in archive.infolist() if z.filename.endswith("/data.pkl") or z.filename == "data.pkl"]
    if len(pkl) != 1:
        raise ValueError(f"{len(pkl)} data.pkl entries")
    _VettingUnpickler(io.BytesIO(stored_member(stream, pkl[0], _RECORD_LIMIT)), plain_data).load()


def load_byte_record(stream, key: str):
    """A byte record's value, read by torch's restricted reader (weights_only: tensors and plain data; its own zip
    parser, the one DCP would use), after this module's allow-list. UnsafeRecordError when either refuses it."""
    import torch

    try:
        vet_record(stream, plain_data=True)
        stream.seek(0)
        return torch.load(stream, map_location="cpu", weights_only=True)
    except UnknownToThisVersion as err:
        raise err.at(f"byte record {key!r}") from None
    except UnsafeCheckpointError as err:
        raise UnsafeRecordError(f"byte record {key!r} names {err}: refusing to unpickle it") from None
    except Exception as err:  # noqa: BLE001 (torch's UnpicklingError, a zip its reader finds malformed ...)
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise UnsafeRecordError(
            f"byte record {key!r} is refused by torch's restricted reader ({first[:160]}): refusing to unpickle it"
        ) from None


def vet_records(dcp_dir: Path, layout: Layout, byte_records: bool = True) -> list[str]:
    """The first record of the folder that names more than its allow-list, or is unreadable, as a problem line."""
    by_file: dict[str, list[tuple[str, Stored]]] = {}
    for (key, _), stored in sorted(layout.storage.items(), key=lambda item: (item[1].relative_path, item[1].offset)):
        if key in layout.byte_keys and not byte_records:
            continue
        by_file.setdefault(stored.relative_path, []).append((key, stored))
    for name, items in sorted(by_file.items()):
        path = Path(dcp_dir) / name
        with open(path, "rb") as f:
            for key, stored in items:
                is_bytes = key in layout.byte_keys
                what = f"{'byte' if is_bytes else 'tensor'} record {key!r}"
                if stored.transformed:
                    if is_bytes:  # torch would decode and unpickle it with weights_only=False
                        return [
                            f"{path}: {what} is compressed or transformed, so it cannot be checked before it is "
                            "unpickled: refusing it; use a checkpoint saved without DCP storage extensions"
                        ]
                    continue  # a tensor record: torch decodes it and reads it with weights_only=True
                try:
                    vet_record(FileSlice(f, stored.offset, stored.length), plain_data=is_bytes)
                except UnknownToThisVersion as err:
                    raise err.at(f"{path} ({what})") from None
                except UnsafeCheckpointError as err:
                    return [unsafe_message(path, UnsafeRecordError(f"{what} names {err}"))]
                except Exception as err:  # noqa: BLE001 (zipfile, pickle and struct errors of a damaged record)
                    return [f"unreadable {what} in {path} ({type(err).__name__}): copy the checkpoint again"]
                if is_bytes:  # as the resume will read it: torch's zip reader may see another archive in the bytes
                    try:
                        load_byte_record(io.BytesIO(_read_range(f, stored)), key)
                    except UnknownToThisVersion as err:
                        raise err.at(f"{path} ({what})") from None
                    except (UnsafeRecordError, ValueError) as err:
                        return [f"{path}: {err}; use a checkpoint you or your training run wrote"]
    return []


def _read_range(f, stored: Stored) -> bytes:
    if stored.length > _RECORD_LIMIT:
        raise ValueError(f"a {stored.length}-byte byte record")
    f.seek(stored.offset)
    return f.read(stored.length)


def vet_metadata(data: bytes, path) -> Layout:
    """The layout of ``data`` (a .metadata file's bytes): UnsafeCheckpointError unless it names only DCP metadata and
    keeps its storage inside its folder; UnknownToThisVersion when it names a dtype or DCP class this torch lacks."""
    try:
        return _read_metadata(io.BytesIO(data))
    except UnknownToThisVersion as err:
        raise err.at(path) from None


def vetted_metadata(data: bytes, path, folder: Path):
    """torch's DCP Metadata from a ``.metadata`` file's bytes, for torch's own reader (guard_torch_dcp): the bytes
    are unpickled only after ``vet_metadata`` passed them (so they name only allow-listed classes), and every storage
    file they name is checked again as torch is about to open it: a file swapped for a link out or a FIFO since the
    checks would hang the load."""
    require_this_torch(vet_metadata(data, path), path)  # and the classes it names are where this torch has them
    metadata = pickle.loads(data)  # noqa: S301 (vetted above: it names only DCP metadata classes)
    for name in sorted({info.relative_path for info in (metadata.storage_data or {}).values()}):
        if problem := _storage_file_problem(folder, name):
            raise EscapingPathError(problem)
    return metadata


def vetted_byte_record(stream, key: str) -> io.BytesIO:
    """A byte record for torch's loader (guard_torch_dcp): its plain value as ``load_byte_record`` reads it,
    re-encoded by us, never the original bytes. UnsafeRecordError when it is refused."""
    import torch

    rewritten = io.BytesIO()
    torch.save(load_byte_record(stream, key), rewritten)  # only plain data, re-encoded by us
    rewritten.seek(0)
    return rewritten


# ----------------------------------------------------------------------------------------------- shard digests

_DIGEST_SAMPLE = 1 << 20  # bytes hashed at each end of a .distcp file: cheap at any size, different on every rank


def shard_digest(path: Path) -> dict:
    """Size and a SHA-256 of the first and last MiB: tells two ranks' files apart (a swap, a copy from another
    checkpoint, a file replaced since) without reading a 100 GB shard. Not a defence against forgery."""
    import hashlib

    size = path.stat().st_size
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        digest.update(f.read(_DIGEST_SAMPLE))
        if size > _DIGEST_SAMPLE:
            f.seek(max(size - _DIGEST_SAMPLE, _DIGEST_SAMPLE))
            digest.update(f.read(_DIGEST_SAMPLE))
    return {"size": size, "sha256": digest.hexdigest()}


def _digest_form(entry) -> bool:
    """An entry as shard_digest writes it: a whole size and a SHA-256 in hex."""
    return (
        isinstance(entry, dict)
        and type(entry.get("size")) is int
        and entry["size"] >= 0
        and isinstance(entry.get("sha256"), str)
        and re.fullmatch(r"[0-9a-f]{64}", entry["sha256"]) is not None
    )


def write_shard_digests(ckpt: Path, folders: tuple[str, ...]) -> None:
    """SHARD_DIGESTS in a checkpoint whose every rank has finished writing (rank 0, after the last barrier)."""
    from fsdp_recipes.ckpt.layout import SHARD_DIGESTS, step_of_name

    # .metadata too: it says where each chunk lies, which the shards alone do not
    files = {
        f"{folder}/{p.name}": shard_digest(p)
        for folder in folders
        if (ckpt / folder).is_dir()
        for p in sorted((ckpt / folder).iterdir())
        if p.suffix == ".distcp" or p.name == ".metadata"
    }
    step = step_of_name(
        ckpt
    )  # the record belongs to this step: another checkpoint's, copied in with its shards, is named
    record = {
        "format": 1,
        "sample_bytes": _DIGEST_SAMPLE,
        **({"step": step} if step is not None else {}),
        "files": files,
    }
    (ckpt / SHARD_DIGESTS).write_text(json.dumps(record, indent=1) + "\n")


def _step_of(ckpt: Path) -> int | None:
    """The step a checkpoint is of: its name's (checkpoint-N), else its trainer_state.json's global_step."""
    from fsdp_recipes.ckpt.layout import step_of_name

    step = step_of_name(ckpt)
    return step if step is not None else _state_step(ckpt)


def _state_step(ckpt: Path) -> int | None:
    from fsdp_recipes.bounded import STATE_LIMIT, load_json

    try:
        step = load_json(ckpt / "trainer_state.json", "trainer_state.json", STATE_LIMIT).get("global_step")
    except (ValueError, OSError, AttributeError):
        return None
    return step if type(step) is int else None


def digest_problems(ckpt: Path, folders: tuple[str, ...]) -> list[str]:
    """Shard files of ``folders`` that are not the ones the training run wrote (checked when the checkpoint has
    SHARD_DIGESTS: checkpoints of other tools have none)."""
    from fsdp_recipes.bounded import JSON_LIMIT, load_json
    from fsdp_recipes.ckpt.layout import MANIFEST, SHARD_DIGESTS

    path = Path(ckpt) / SHARD_DIGESTS
    try:  # our runs announce the digests in the manifest, which is written before any shard, and sealed with their step
        manifest = (
            load_json(Path(ckpt) / MANIFEST, MANIFEST, JSON_LIMIT) if os.path.lexists(Path(ckpt) / MANIFEST) else {}
        )
    except ValueError:
        manifest = {}  # an unreadable manifest is named by description.recorded_changes
    if not os.path.lexists(path):
        return (
            [
                f"missing {SHARD_DIGESTS} (written last, once every rank had finished: the save did not finish, or it "
                "was removed)"
            ]
            if manifest.get("shard_digests")
            else []
        )
    try:
        record = load_json(path, SHARD_DIGESTS, JSON_LIMIT)
        files = record["files"] if record.get("sample_bytes") == _DIGEST_SAMPLE else None
        if not isinstance(files, dict) or not all(_digest_form(v) for v in files.values()):
            raise ValueError  # an entry that is no size and hash is no record of a file: not a swap
    except (ValueError, TypeError, KeyError, OSError):
        return [f"unreadable {SHARD_DIGESTS}: copy the checkpoint again"]
    # The step the record names must be the folder's (its name's, else trainer_state.json's) and the one the manifest
    # was sealed with; a sealed manifest also means the record names one (an older version's record names none).
    recorded, sealed = record.get("step"), manifest.get("shard_digests_step")
    for what, value in ((SHARD_DIGESTS, recorded), (f"{MANIFEST}'s shard_digests_step", sealed)):
        if value is not None and not (type(value) is int and value >= 0):  # True == 1, 6.0 == 6: no step number
            return [
                f"{what} is {json.dumps(value)[:40]}, not a step number: the record was edited; copy the checkpoint again"
            ]
    steps = [s for s in (_step_of(Path(ckpt)), sealed) if s is not None]
    if (recorded is not None or sealed is not None) and (wrong := [s for s in steps if s != recorded]):
        if recorded == sealed == _state_step(Path(ckpt)) != wrong[0]:  # every record agrees but the folder's name
            return [
                f"{Path(ckpt).name} was renamed: its trainer_state.json, {SHARD_DIGESTS} and {MANIFEST} are of step {recorded}; "
                f"give it back its name checkpoint-{recorded}"
            ]
        whose = "of no step (an older version's)" if recorded is None else f"that of step {json.dumps(recorded)[:40]}"
        return [
            f"{SHARD_DIGESTS} is {whose}, and this checkpoint is of step {wrong[0]}: its shard folders "
            "were copied from another checkpoint (with their digests): copy this checkpoint again from where it was written"
        ]
    problems = []
    for name, expected in sorted(files.items()):
        if not isinstance(name, str) or name.split("/")[0] not in folders:
            continue
        shard = Path(ckpt) / name
        if shard.is_file() and shard_digest(shard) != expected:
            problems.append(
                f"{name} is not the file this checkpoint wrote ({SHARD_DIGESTS} has another size or hash: "
                "swapped with another rank's, replaced or damaged): copy the checkpoint again"
            )
    return problems


def guard_torch_dcp() -> None:
    """From now on in this process, torch's DCP reader unpickles nothing this module has not vetted: its
    ``.metadata`` (``vetted_metadata``) and every byte record (``vetted_byte_record``). The patch of torch's reader
    is fsdp_recipes.compat.torch_dcp's; the allow-lists are here. Idempotent."""
    from fsdp_recipes.compat.torch_dcp import install

    install(vetted_metadata, vetted_byte_record, METADATA_LIMIT)
