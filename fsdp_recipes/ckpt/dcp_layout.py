"""A DCP folder's layout, as plain data: its tensors, their chunks and the byte range of the .distcp file that
holds each chunk (``Layout``, built from torch's Metadata or the stand-in by ``layout_from``), and the errors that
refuse a folder as unsafe, with the line that names them (``unsafe_message``).

A storage path must name a regular file directly inside the folder (no ``/``, no ``..``, no link out): torch's own
reader would otherwise open a file elsewhere.
"""

from __future__ import annotations

import os
import pickle
from dataclasses import dataclass, field
from pathlib import Path

from fsdp_recipes.bounded import plain_file_name


@dataclass(frozen=True)
class Chunk:
    offsets: tuple[int, ...]
    sizes: tuple[int, ...]


@dataclass(frozen=True)
class TensorEntry:
    # torch name: "float32"
    dtype: str
    shape: tuple[int, ...]
    chunks: tuple[Chunk, ...]


@dataclass(frozen=True)
class Stored:
    """Where one chunk's torch.save record lies: a byte range of a .distcp file."""

    relative_path: str
    offset: int
    length: int
    # compressed or otherwise not a plain record
    transformed: bool


@dataclass
class Layout:
    # DCP key ("model.lm_head.weight") -> entry; byte entries left out
    tensors: dict[str, TensorEntry]
    # (key, chunk offsets) -> record
    storage: dict[tuple[str, tuple[int, ...] | None], Stored]
    # keys of byte entries (pickled values): vetted, never weights
    byte_keys: frozenset[str] = frozenset()
    # the DCP classes .metadata names, (module, name): read here by stand-ins whatever module holds them; torch's own
    # reader needs each where it is named (require_this_torch)
    dcp_names: frozenset[tuple[str, str]] = field(default=frozenset(), compare=False)


class UnsafeCheckpointError(pickle.UnpicklingError):
    """A checkpoint pickle names something that is not checkpoint data: it is never unpickled."""


class EscapingPathError(UnsafeCheckpointError):
    """DCP metadata names a storage file outside its own folder."""


class UnsafeRecordError(UnsafeCheckpointError):
    """A .distcp record whose pickle names more than its kind of record may."""


class MetadataTooLarge(ValueError):
    """A .metadata file larger than the reader takes (fsdp_recipes.ckpt.dcp_pickles.METADATA_LIMIT)."""


def layout_from(metadata) -> Layout:
    """Our plain view of a DCP Metadata object, torch's or the stand-in."""
    tensors, byte_keys = {}, set()
    for key, meta in metadata.state_dict_metadata.items():
        if not hasattr(meta, "chunks"):
            # BytesStorageMetadata: pickled objects, never model weights
            byte_keys.add(key)
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
        # a default left out of the pickled state
        offset = getattr(index, "offset", None)
        where = (index.fqn, None if offset is None else tuple(offset))
        # torch's reader would open a file elsewhere
        if not plain_file_name(info.relative_path):
            raise EscapingPathError(f"storage path {info.relative_path!r}")
        storage[where] = Stored(
            info.relative_path, info.offset, info.length, bool(getattr(info, "transform_descriptors", None))
        )
    return Layout(tensors, storage, frozenset(byte_keys))


def unsafe_message(path: Path, err: UnsafeCheckpointError) -> str:
    """The one line that refuses ``path`` for ``err``, saying what to use instead."""
    if isinstance(err, EscapingPathError):
        return (
            f"{path} names {err}, outside its folder: refusing to read it (a checkpoint's files lie inside it); "
            "use a checkpoint you or your training run wrote"
        )
    if isinstance(err, UnsafeRecordError):
        return (
            f"{path}: {err}: refusing to unpickle it (a pickle can run code); use a checkpoint you or your "
            "training run wrote"
        )
    return (
        f"{path} names {err}, which DCP metadata never holds: refusing to unpickle it (a pickle can run code); "
        "use a checkpoint you or your training run wrote"
    )


def storage_file_problem(folder: Path, name: str) -> str | None:
    """A storage file that is not a regular file directly inside ``folder`` (links resolved): named, else None."""
    import stat

    path = folder / name
    if os.path.dirname(os.path.realpath(path)) != os.path.realpath(folder):
        return f"storage path {name!r} (a link to {os.path.realpath(path)})"
    try:
        mode = os.stat(path).st_mode
    except OSError:
        # missing: torch's own error names it
        return None
    return None if stat.S_ISREG(mode) else f"storage path {name!r} (not a regular file)"
