"""Reading a torch.distributed.checkpoint (DCP) folder's layout without importing torch, and without running code.

Importing torch and torch.distributed.checkpoint takes about 2 s here: as long as copying a few GB from the
page cache, so it doubled the time of a merge whose work is a kernel copy. Underneath, a DCP folder is plain
data: ``.metadata`` is a pickle of a few small dataclasses (names, shapes, dtypes, which file and byte range
holds each chunk) and each ``.distcp`` file is a run of torch.save records (zip archives). Both are read here
with restricted unpicklers that build stand-ins for exactly the classes those pickles name and import or call
nothing else.

A checkpoint may come from anywhere, and a pickle can run any code it names. DCP itself loads ``.metadata``
with plain ``pickle.load`` (torch 2.13, FileSystemReader.read_metadata), so every tool here reads it through
this module first and refuses a file that names anything but DCP's metadata dataclasses and enums
(UnsafeCheckpointError); DCP's own load then only ever sees a vetted file. A name this module does not know is
accepted only when it is a dataclass or enum of ``torch.distributed.checkpoint`` (another torch version's
metadata); it is never looked up as a dotted attribute path. Records that are not plain tensors go to torch's
``weights_only`` loader (the merge's slow path, DCP's own reader), never to plain pickle.
"""

from __future__ import annotations

import io
import pickle
import re
import struct
import zipfile
from dataclasses import dataclass
from pathlib import Path

# bytes per element of the dtypes (torch names) a checkpoint may hold
DTYPE_SIZES = {
    "float64": 8, "float32": 4, "float16": 2, "bfloat16": 2, "int64": 8, "int32": 4, "int16": 2, "int8": 1,
    "uint8": 1, "bool": 1, "float8_e4m3fn": 1, "float8_e5m2": 1,
}
# torch.save names a tensor's storage by its legacy typed-storage class
_STORAGE_DTYPES = {
    "DoubleStorage": "float64", "FloatStorage": "float32", "HalfStorage": "float16", "BFloat16Storage": "bfloat16",
    "LongStorage": "int64", "IntStorage": "int32", "ShortStorage": "int16", "CharStorage": "int8",
    "ByteStorage": "uint8", "BoolStorage": "bool",
}


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


# ----------------------------------------------------------------------------------------------- .metadata


class _Standin:
    """Any DCP metadata dataclass: its pickled state becomes attributes (an enum's value: ``args``)."""

    def __init__(self, *args, **kwargs):
        self.args = args
        self.__dict__.update(kwargs)

    def __setstate__(self, state):
        if isinstance(state, tuple) and len(state) == 2 and isinstance(state[1], dict) and (state[0] is None or isinstance(state[0], dict)):
            state = {**(state[0] or {}), **state[1]}  # (dict, slots) of a slotted dataclass
        if isinstance(state, dict):
            self.__dict__.update(state)
        else:
            self.state = state  # TensorProperties pickles a tuple: (dtype, layout, ...)


_DCP_CLASSES = ("Metadata", "TensorStorageMetadata", "BytesStorageMetadata", "TensorProperties", "ChunkStorageMetadata",
                "MetadataIndex", "StorageMeta", "_StorageInfo")


class _UnknownGlobal(pickle.UnpicklingError):
    pass


class UnsafeCheckpointError(pickle.UnpicklingError):
    """A checkpoint pickle names something that is not checkpoint data: it is never unpickled."""


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

    def find_class(self, module, name):
        if module.startswith(_DCP_MODULE) and name in self._standins:
            return self._standins[name]
        if module.startswith(_DCP_MODULE) and name == "_MEM_FORMAT_ENCODING":
            return lambda value: value
        if module == "torch" and name in DTYPE_SIZES:
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
        raise UnsafeCheckpointError(f"{module}.{name}")


def _layout_from(metadata) -> Layout:
    """Our plain view of a DCP Metadata object, torch's or the stand-in."""
    tensors = {}
    for key, meta in metadata.state_dict_metadata.items():
        if not hasattr(meta, "chunks"):
            continue  # BytesStorageMetadata: pickled objects, never model weights
        props = meta.properties
        dtype = props.dtype if hasattr(props, "dtype") else props.state[0]
        tensors[key] = TensorEntry(
            str(dtype).removeprefix("torch."), tuple(meta.size),
            tuple(Chunk(tuple(c.offsets), tuple(c.sizes)) for c in meta.chunks),
        )
    storage = {}
    for index, info in (metadata.storage_data or {}).items():
        offset = getattr(index, "offset", None)  # a default left out of the pickled state
        where = (index.fqn, None if offset is None else tuple(offset))
        storage[where] = Stored(info.relative_path, info.offset, info.length, bool(getattr(info, "transform_descriptors", None)))
    return Layout(tensors, storage)


def read_layout(dcp_dir: Path) -> Layout:
    """The folder's tensors and where their chunks lie. Raises UnsafeCheckpointError when ``.metadata`` names
    anything but DCP metadata (it could run code), another exception when it is unreadable."""
    path = Path(dcp_dir) / ".metadata"
    with open(path, "rb") as f:
        return _layout_from(_MetadataUnpickler(f).load())


def unsafe_message(path: Path, err: UnsafeCheckpointError) -> str:
    return (
        f"{path} names {err}, which DCP metadata never holds: refusing to unpickle it (a pickle can run code); "
        "use a checkpoint you or your training run wrote"
    )


def check_folder(dcp_dir: Path) -> tuple[Layout | None, list[str]]:
    """(layout or None, what makes the folder unreadable: missing or unreadable .metadata, missing or truncated
    .distcp files)."""
    meta_path = Path(dcp_dir) / ".metadata"
    if not meta_path.is_file():
        return None, [f"missing {meta_path}"]
    try:
        layout = read_layout(dcp_dir)
    except UnsafeCheckpointError as err:
        return None, [unsafe_message(meta_path, err)]
    except Exception as err:  # a truncated pickle raises several different types
        return None, [f"unreadable {meta_path} ({type(err).__name__})"]
    needed: dict[str, int] = {}
    for info in layout.storage.values():
        needed[info.relative_path] = max(needed.get(info.relative_path, 0), info.offset + info.length)
    problems = []
    for name, size in sorted(needed.items()):
        path = Path(dcp_dir) / name
        if not path.is_file():
            problems.append(f"missing {path}")
        elif path.stat().st_size < size:
            problems.append(f"truncated {path} ({path.stat().st_size} of {size} bytes)")
    return layout, problems


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


class _RecordUnpickler(pickle.Unpickler):
    """data.pkl of a torch.save'd tensor: _rebuild_tensor_v2(storage, storage_offset, size, stride, ...)."""

    def find_class(self, module, name):
        if (module, name) == ("torch._utils", "_rebuild_tensor_v2"):
            return lambda storage, offset, size, stride, *rest: ("tensor", storage, offset, tuple(size), tuple(stride))
        if module == "torch" and name in _STORAGE_DTYPES:
            return _STORAGE_DTYPES[name]
        if (module, name) == ("collections", "OrderedDict"):
            return dict
        raise _UnknownGlobal(f"{module}.{name}")  # not a plain tensor record: torch's weights_only loader reads it

    def persistent_load(self, pid):
        return tuple(pid)  # ("storage", dtype name, key, location, numel)


def _row_major(shape: tuple[int, ...]) -> tuple[int, ...]:
    strides, step = [], 1
    for d in reversed(shape):
        strides.append(step)
        step *= max(d, 1)
    return tuple(reversed(strides))


def raw_tensor(dcp_dir: Path, stored: Stored) -> RawTensor | None:
    """Where a chunk's bytes lie when its record is one contiguous, uncompressed, little-endian tensor from the
    start of its storage; None otherwise (the caller then loads it with torch)."""
    if stored.transformed:
        return None
    with open(Path(dcp_dir) / stored.relative_path, "rb") as f:
        try:
            archive = zipfile.ZipFile(FileSlice(f, stored.offset, stored.length))
            entries = archive.infolist()
            pkl = [z for z in entries if z.filename.endswith("/data.pkl")]
            data = [z for z in entries if re.search(r"/data/\d+$", z.filename)]
            order = [z for z in entries if z.filename.endswith("/byteorder")]
            if len(pkl) != 1 or len(data) != 1 or data[0].compress_type != zipfile.ZIP_STORED:
                return None
            if order and archive.read(order[0]).decode() != "little":
                return None
            kind, storage, offset, shape, stride = _RecordUnpickler(io.BytesIO(archive.read(pkl[0]))).load()
        except Exception:
            return None
        if kind != "tensor" or storage[0] != "storage" or offset != 0:
            return None
        dtype = storage[1]
        numel = 1
        for d in shape:
            numel *= d
        if any(s != r for s, r, d in zip(stride, _row_major(shape), shape) if d > 1) or data[0].file_size != numel * DTYPE_SIZES[dtype]:
            return None
        f.seek(stored.offset + data[0].header_offset)
        local = f.read(30)  # zip local file header: the data follows its name and extra field
        name_len, extra_len = struct.unpack("<HH", local[26:30])
        return RawTensor(dtype, shape, stored.offset + data[0].header_offset + 30 + name_len + extra_len, data[0].file_size)
