"""What torch names in a checkpoint, known without importing torch: every dtype of torch 2.13 by name, the bytes per
element of those a merge converts, torch.save's storage classes, and where this torch keeps the DCP classes.

A name another torch version has and this one lacks (a newer float8 variant, a class a newer DCP added) is
"unreadable by this version" (``UnknownToThisVersion``), never a problem of the checkpoint: nothing that may be a
good checkpoint is called incomplete, passed over or deleted because of it.
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING

from fsdp_recipes.errors import UnknownToThisVersion

if TYPE_CHECKING:
    from fsdp_recipes.ckpt.dcp_layout import Layout

DCP_MODULE = "torch.distributed.checkpoint."


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
STORAGE_DTYPES = {
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
OTHER_STORAGES = frozenset(
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


def unknown_torch_name(module: str, name: str) -> str | None:
    """ "dtype" or "DCP class" when ``module.name`` is one another torch version may have and this one has not
    (never imported or called: the caller refuses it either way, as unreadable by this version); None otherwise."""
    if module == "torch" and _DTYPE_LIKE.fullmatch(name) and name not in TORCH_DTYPE_NAMES:
        return "dtype"
    if module.startswith(DCP_MODULE) and name.isidentifier() and all(p.isidentifier() for p in module.split(".")):
        import importlib

        try:
            # torch's own module: runs only torch's code
            found = importlib.import_module(module).__dict__
        except ImportError:
            # a module of torch.distributed.checkpoint this torch does not have
            return "DCP class"
        return "DCP class" if name not in found else None
    return None


# where torch 2.13 keeps the DCP classes its checkpoints name (a test checks each against the installed torch)
_DCP_NAMES_OF_THIS_TORCH = frozenset(
    {
        *(
            (f"{DCP_MODULE}metadata", name)
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
        (f"{DCP_MODULE}filesystem", "_StorageInfo"),
    }
)


def require_this_torch(layout: Layout, path) -> None:
    """UnknownToThisVersion unless every DCP class ``.metadata`` names is where it names it in the installed torch
    (a class another torch version moved or added: the stand-ins here read it, torch's own reader, which a resume
    uses, cannot). Imports a module of torch.distributed.checkpoint only for a name this torch's checkpoints do not
    use."""
    import importlib

    for module, name in sorted(layout.dcp_names - _DCP_NAMES_OF_THIS_TORCH):
        try:
            if hasattr(importlib.import_module(module), name):
                continue
        except ImportError:
            pass
        raise UnknownToThisVersion(path, f"{module}.{name}", "DCP class", torch_version())
