"""The one reader of a DCP folder's pickles: ``.metadata`` (a pickle of a few small dataclasses) and every record of
every ``.distcp`` file (torch.save zip archives), each read with a restricted unpickler that builds stand-ins for
exactly the classes its allow-list names and imports or calls nothing else (a pickle can run any code it names; DCP
itself reads both with plain ``pickle.load`` and ``torch.load(weights_only=False)``). Only this module unpickles a
DCP file (tests/unit/ckpt/test_pickles.py).

- ``.metadata`` (``read_layout``, ``vet_metadata``): DCP's metadata dataclasses and enums, torch dtypes and sizes;
  another name is accepted only when it is a dataclass or enum of ``torch.distributed.checkpoint`` (another torch
  version's), never looked up as a dotted attribute path.
- a record (``vet_record``): a tensor record may name only torch's tensor rebuild and storage types, a byte record
  only plain data; ``raw_tensor`` finds a plain tensor record's bytes, to be copied without torch.
- ``guard_torch_dcp`` (through fsdp_recipes/compat/torch_dcp.py) makes torch's own DCP reader go through both checks
  on every load that follows in this process: ``vetted_metadata`` unpickles the very bytes it vetted, and a byte
  record is read by torch's restricted reader (``weights_only=True``) and handed to torch re-written from that plain
  value, never the original.

UnsafeCheckpointError names what was refused; nothing a refused file names is ever imported or called.
"""

from __future__ import annotations

import io
import os
import pickle
import pickletools
import warnings
import zipfile
from dataclasses import dataclass
from pathlib import Path

from fsdp_recipes.ckpt.dcp_layout import (
    EscapingPathError,
    Layout,
    MetadataTooLarge,
    Stored,
    UnsafeCheckpointError,
    UnsafeRecordError,
    layout_from,
    storage_file_problem,
)
from fsdp_recipes.ckpt.torch_names import (
    DCP_MODULE,
    DTYPE_SIZES,
    OTHER_STORAGES,
    STORAGE_DTYPES,
    TORCH_DTYPE_NAMES,
    require_this_torch,
    torch_version,
    unknown_torch_name,
)
from fsdp_recipes.ckpt.torch_save_archive import (
    RECORD_LIMIT,
    FileSlice,
    RawTensor,
    member_start,
    row_major,
    stored_member,
    torch_save_layout,
)
from fsdp_recipes.errors import UnknownToThisVersion

# A 70B model's .metadata over 512 ranks (every tensor and Adam moment, a chunk per rank) is ~0.1 GiB; a file that
# claims more (a hole of zeros behind a pickle opcode's length) would be read whole into memory
METADATA_LIMIT = 1 << 30


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
            # (dict, slots) of a slotted dataclass
            state = {**(state[0] or {}), **state[1]}
        if isinstance(state, dict):
            self.__dict__.update(state)
        else:
            # TensorProperties pickles a tuple: (dtype, layout, ...)
            self.state = state


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


def _is_dcp_data_class(module: str, name: str) -> bool:
    """A DCP metadata dataclass or enum this module has no stand-in for (a newer torch). Importing a module of
    torch.distributed.checkpoint runs only torch's own code; a dotted name (an attribute path) is never followed."""
    import dataclasses
    import enum
    import importlib

    if not module.startswith(DCP_MODULE) or not name.isidentifier():
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
        if module.startswith(DCP_MODULE):
            self.dcp_names.add((module, name))
        if module.startswith(DCP_MODULE) and name in self._standins:
            return self._standins[name]
        if module.startswith(DCP_MODULE) and name == "_MEM_FORMAT_ENCODING":
            return lambda value: value
        if module == "torch" and name in TORCH_DTYPE_NAMES:
            return name
        if (module, name) == ("torch", "Size"):
            return lambda dims=(): tuple(dims)
        if (module, name) == ("torch.serialization", "_get_layout"):
            return lambda layout: layout
        if module == "pathlib" and name in ("PosixPath", "WindowsPath", "PurePosixPath", "PureWindowsPath", "Path"):
            # StorageMeta.checkpoint_id, unused
            return lambda *parts: "/".join(map(str, parts))
        if (module, name) == ("collections", "OrderedDict"):
            return dict
        if _is_dcp_data_class(module, name):
            return self._standins.setdefault(name, type(name, (_Standin,), {}))
        if kind := unknown_torch_name(module, name):
            raise UnknownToThisVersion(".metadata", f"{module}.{name}", kind, torch_version())
        raise UnsafeCheckpointError(f"{module}.{name}")


def read_layout(dcp_dir: Path) -> Layout:
    """The folder's tensors and where their chunks lie. Raises UnsafeCheckpointError when ``.metadata`` names
    anything but DCP metadata (it could run code), UnknownToThisVersion when it names a dtype or DCP class this
    torch does not have (another version's checkpoint), another exception when it is unreadable."""
    path = Path(dcp_dir) / ".metadata"
    with open(path, "rb") as f:
        # a claimed length is allocated before it is read
        if (size := os.fstat(f.fileno()).st_size) > METADATA_LIMIT:
            raise MetadataTooLarge(f"{size / 2**30:.1f} GiB, over the {METADATA_LIMIT >> 30} GiB this reader takes")
        try:
            return _read_metadata(f)
        except UnknownToThisVersion as err:
            raise err.at(path) from None


def _read_metadata(f) -> Layout:
    unpickler = _MetadataUnpickler(f)
    layout = layout_from(unpickler.load())
    layout.dcp_names = frozenset(unpickler.dcp_names)
    return layout


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
            # a view's flags (neg, conj), hooks, odd types: torch reads it
            raise ValueError("not a plain tensor record")
        self.storage, self.shape, self.stride = storage, size, stride

    def __setstate__(self, state):
        # torch would call set_() with it
        raise ValueError("BUILD on the tensor")


class _RecordUnpickler(pickle.Unpickler):
    """data.pkl of a plain torch.save'd tensor: _rebuild_tensor_v2(storage, 0, size, stride, False, OrderedDict()),
    its storage a persistent id ("storage", <dtype>Storage, key, location, numel); anything else raises."""

    def __init__(self, data: bytes):
        # genops decodes a STRING opcode's escapes, warning on a bad one
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            if any(op.name not in _RECORD_OPCODES for op, _, _ in pickletools.genops(data)):
                raise ValueError("an opcode torch.save does not write in a tensor record")
        super().__init__(io.BytesIO(data))
        self.storages = []

    def find_class(self, module, name):
        if (module, name) == ("torch._utils", "_rebuild_tensor_v2"):
            return _PlainTensor
        if module == "torch" and name in STORAGE_DTYPES:
            return _StorageType(STORAGE_DTYPES[name])
        if (module, name) == ("collections", "OrderedDict"):
            return dict
        # not a plain tensor record: torch's weights_only loader reads it
        raise _UnknownGlobal(f"{module}.{name}")

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


def raw_tensor(dcp_dir: Path, stored: Stored) -> RawTensor | None:
    """Where a chunk's bytes lie when its record is one contiguous, uncompressed, little-endian tensor from the
    start of its storage, laid out exactly as torch.save writes it (``torch_save_layout``, ``_RecordUnpickler``);
    None otherwise (the caller then loads it with torch, and copies what torch reads)."""
    if stored.transformed:
        return None
    try:
        with open(Path(dcp_dir) / stored.relative_path, "rb") as f:
            record = FileSlice(f, stored.offset, stored.length)
            members = torch_save_layout(record, stored.length)
            if members is None or "data.pkl" not in members:
                return None
            data = {name: info for name, info in members.items() if name.startswith("data/")}
            if len(data) != 1 or (
                "byteorder" in members and stored_member(record, members["byteorder"], 16) != b"little"
            ):
                return None
            tensor = _RecordUnpickler(stored_member(record, members["data.pkl"], RECORD_LIMIT)).tensor()
            [(data_name, data_info)] = data.items()
            numel = 1
            for d in tensor.shape:
                numel *= d
            dtype = tensor.storage.dtype
            if (
                f"data/{tensor.storage.key}" != data_name
                or tensor.storage.numel != numel
                or data_info.file_size != numel * DTYPE_SIZES[dtype]
                or any(s != r for s, r, d in zip(tensor.stride, row_major(tensor.shape), tensor.shape) if d > 1)
            ):
                return None
            return RawTensor(dtype, tensor.shape, stored.offset + member_start(record, data_info), data_info.file_size)
    except Exception:
        return None


class _VettingUnpickler(pickle.Unpickler):
    """Reads a record's data.pkl only to learn what it names: tensor rebuilds and storages (tensor records), plus
    plain data (byte records). Everything it builds is a stand-in; nothing it names is imported or called."""

    def __init__(self, file, plain_data: bool):
        super().__init__(file)
        self.plain_data = plain_data

    def find_class(self, module, name):
        if (module, name) in (("torch._utils", "_rebuild_tensor_v2"), ("torch._utils", "_rebuild_tensor_v3")):
            # v3: dtypes without a legacy storage class (uint16, float8 ...)
            return lambda *args: ("tensor",)
        if module == "torch" and (name in STORAGE_DTYPES or name in OTHER_STORAGES or name in TORCH_DTYPE_NAMES):
            return name
        if (module, name) == ("torch.storage", "UntypedStorage"):
            return name
        if (module, name) in (("collections", "OrderedDict"), ("torch", "Size")):
            return lambda *args: {} if name == "OrderedDict" else tuple(*args)
        if self.plain_data and module == "builtins" and name in ("set", "frozenset", "complex"):
            return lambda *args: None
        if kind := unknown_torch_name(module, name):
            raise UnknownToThisVersion("a record", f"{module}.{name}", kind, torch_version())
        raise UnsafeRecordError(f"{module}.{name}")

    def persistent_load(self, pid):
        # ("storage", dtype name, key, location, numel)
        return tuple(pid)


def vet_record(stream, plain_data: bool) -> None:
    """Raise UnsafeCheckpointError unless the torch.save record in ``stream`` names only its allow-list (a tensor
    record: a tensor; a byte record: plain data and tensors); OSError/zipfile.BadZipFile/ValueError when it is not a
    readable record at all."""
    archive = zipfile.ZipFile(stream)
    pkl = [z for z in archive.infolist() if z.filename.endswith("/data.pkl") or z.filename == "data.pkl"]
    if len(pkl) != 1:
        raise ValueError(f"{len(pkl)} data.pkl entries")
    _VettingUnpickler(io.BytesIO(stored_member(stream, pkl[0], RECORD_LIMIT)), plain_data).load()


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
    # and the classes it names are where this torch has them
    require_this_torch(vet_metadata(data, path), path)
    metadata = pickle.loads(data)  # noqa: S301 (vetted above: it names only DCP metadata classes)
    for name in sorted({info.relative_path for info in (metadata.storage_data or {}).values()}):
        if problem := storage_file_problem(folder, name):
            raise EscapingPathError(problem)
    return metadata


def vetted_byte_record(stream, key: str) -> io.BytesIO:
    """A byte record for torch's loader (guard_torch_dcp): its plain value as ``load_byte_record`` reads it,
    re-encoded by us, never the original bytes. UnsafeRecordError when it is refused."""
    import torch

    rewritten = io.BytesIO()
    # only plain data, re-encoded by us
    torch.save(load_byte_record(stream, key), rewritten)
    rewritten.seek(0)
    return rewritten


def guard_torch_dcp() -> None:
    """From now on in this process, torch's DCP reader unpickles nothing this module has not vetted: its
    ``.metadata`` (``vetted_metadata``) and every byte record (``vetted_byte_record``). The patch of torch's reader
    is fsdp_recipes.compat.torch_dcp's; the allow-lists are here. Idempotent."""
    from fsdp_recipes.compat.torch_dcp import install

    install(vetted_metadata, vetted_byte_record, METADATA_LIMIT)
