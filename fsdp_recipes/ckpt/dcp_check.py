"""Whether a DCP folder can be read, and safely: ``check_folder`` says what makes it unreadable or unsafe (missing,
unreadable or unsafe ``.metadata``; missing, truncated or escaping ``.distcp`` files; chunks that do not make up
their tensor; a record that names more than its allow-list, vetted by fsdp_recipes.ckpt.dcp_pickles), in one list.

A dtype or DCP class this torch lacks raises ``UnknownToThisVersion``: no problem of the folder, which may be
complete, and a caller must not treat it as one.
"""

from __future__ import annotations

import io
import itertools
import math
from pathlib import Path

from fsdp_recipes.ckpt.dcp_layout import (
    EscapingPathError,
    Layout,
    MetadataTooLarge,
    Stored,
    TensorEntry,
    UnsafeCheckpointError,
    UnsafeRecordError,
    storage_file_problem,
    unsafe_message,
)
from fsdp_recipes.ckpt.dcp_pickles import load_byte_record, read_layout, vet_record
from fsdp_recipes.ckpt.torch_names import DTYPE_SIZES
from fsdp_recipes.ckpt.torch_save_archive import RECORD_LIMIT, FileSlice
from fsdp_recipes.errors import UnknownToThisVersion


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
    # a truncated pickle raises several different types
    except Exception as err:
        return None, [f"unreadable {meta_path} ({type(err).__name__})"]
    if problems := chunk_problems(layout, meta_path):
        return layout, problems
    needed: dict[str, int] = {}
    for info in layout.storage.values():
        needed[info.relative_path] = max(needed.get(info.relative_path, 0), info.offset + info.length)
    problems = []
    for name, size in sorted(needed.items()):
        path = Path(dcp_dir) / name
        if (problem := storage_file_problem(Path(dcp_dir), name)) and "a link" in problem:
            problems.append(unsafe_message(meta_path, EscapingPathError(problem)))
        elif not path.is_file():
            problems.append(f"missing {path}")
        elif path.stat().st_size < size:
            problems.append(f"truncated {path} ({path.stat().st_size} of {size} bytes)")
    if not problems:
        problems = vet_records(dcp_dir, layout, byte_records)
    # after the vetting, which names a record holding code for what it is
    if not problems:
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
                    f"unreadable {meta_path}: the chunk of {key!r} at {list(chunk.offsets)} of size "
                    f"{list(chunk.sizes)} has a "
                    f"record of {stored.length:,} bytes, fewer than its {needs:,}: use another checkpoint-N, or "
                    "copy this one "
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
                f"unreadable {meta_path}: the chunks of {key!r} {detail}, so they do not make up the tensor: "
                "use another "
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
    # accelerate PR #4206's FSDP2 adapter-only saves kept rank 0's slice alone
    if held < math.prod(shape):
        return f"hold {held:,} of its {math.prod(shape):,} elements (a rank's slice is missing, or the file was edited)"
    if held > math.prod(shape):
        return (
            f"hold {held:,} elements where the tensor {list(shape)} has {math.prod(shape):,} (the file was "
            "edited or damaged)"
        )
    # as many elements as the tensor: they make it up unless two overlap. Over the grid the chunk edges cut, each
    # cell must be in exactly one chunk
    edges = [
        sorted({0, d, *(c.offsets[i] for c in chunks), *(c.offsets[i] + c.sizes[i] for c in chunks)})
        for i, d in enumerate(shape)
    ]
    if (cells := math.prod(len(e) - 1 for e in edges)) > (limit := CELLS_PER_CHUNK * len(chunks) + CELLS_EXTRA):
        return (
            f"cut it into {cells:,} pieces, more than any writer's layout of {len(chunks):,} chunks (this "
            f"reader checks up to {limit:,})"
        )
    index = [{edge: i for i, edge in enumerate(e)} for e in edges]
    seen: set[tuple[int, ...]] = set()
    for chunk in chunks:
        ranges = [range(index[i][o], index[i][o + n]) for i, (o, n) in enumerate(zip(chunk.offsets, chunk.sizes))]
        for cell in itertools.product(*ranges):
            if cell in seen:
                return (
                    f"overlap (one at {list(chunk.offsets)} of size {list(chunk.sizes)} covers elements "
                    "another holds: the file was edited or damaged)"
                )
            seen.add(cell)
    return None


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
                    # torch would decode and unpickle it with weights_only=False
                    if is_bytes:
                        return [
                            f"{path}: {what} is compressed or transformed, so it cannot be checked before it is "
                            "unpickled: refusing it; use a checkpoint saved without DCP storage extensions"
                        ]
                    # a tensor record: torch decodes it and reads it with weights_only=True
                    continue
                try:
                    vet_record(FileSlice(f, stored.offset, stored.length), plain_data=is_bytes)
                except UnknownToThisVersion as err:
                    raise err.at(f"{path} ({what})") from None
                except UnsafeCheckpointError as err:
                    return [unsafe_message(path, UnsafeRecordError(f"{what} names {err}"))]
                except Exception as err:  # noqa: BLE001 (zipfile, pickle and struct errors of a damaged record)
                    return [f"unreadable {what} in {path} ({type(err).__name__}): copy the checkpoint again"]
                # as the resume will read it: torch's zip reader may see another archive in the bytes
                if is_bytes:
                    try:
                        load_byte_record(io.BytesIO(_read_range(f, stored)), key)
                    except UnknownToThisVersion as err:
                        raise err.at(f"{path} ({what})") from None
                    except (UnsafeRecordError, ValueError) as err:
                        return [f"{path}: {err}; use a checkpoint you or your training run wrote"]
    return []


def _read_range(f, stored: Stored) -> bytes:
    if stored.length > RECORD_LIMIT:
        raise ValueError(f"a {stored.length}-byte byte record")
    f.seek(stored.offset)
    return f.read(stored.length)
