"""Streaming tensors from a checkpoint source into safetensors shards (+ index), as save_pretrained names them.

The headers are computed up front from the source's shapes and dtypes; then each tensor whose bytes lie plain in
the source is copied by the kernel straight to its place in the output (copy_file_range; sendfile or a buffered
loop across filesystems and where it is missing), and the rest (casts, other layouts) is read in groups of at
most ``memory_budget`` bytes (a larger tensor alone). Peak memory follows the budget and the largest tensor,
never the model size.
"""

from __future__ import annotations

import errno
import json
import os
import struct
from collections.abc import Callable
from pathlib import Path

from huggingface_hub import split_state_dict_into_shards_factory
from tqdm.auto import tqdm

from fsdp_recipes.ckpt.readers import SAFETENSORS_DTYPES, TensorInfo, dtype_name, torch_dtype
from fsdp_recipes.compat import internals
from fsdp_recipes.errors import CheckpointError

COPY_STEP = 64 << 20  # bytes per kernel copy call: how often a failed check running beside the copy is noticed
# copy_file_range or sendfile cannot do these (another filesystem, an old kernel, a filesystem without it, macOS's
# sendfile, which only writes to sockets): copy another way
_NO_RANGE_COPY = {errno.EXDEV, errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL, errno.ENOTSOCK, getattr(errno, "ENOTSUP", errno.EOPNOTSUPP)}


class Cancelled(Exception):
    """The copy was stopped because a check running beside it failed."""


def _safetensors_header(names: list[str], infos: dict[str, TensorInfo], dtype: str | None) -> tuple[bytes, list[tuple[str, int]]]:
    header, offset, layout = {"__metadata__": {"format": "pt"}}, 0, []
    for n in names:
        size = infos[n].nbytes(dtype)
        header[n] = {"dtype": SAFETENSORS_DTYPES[dtype or infos[n].dtype], "shape": list(infos[n].shape), "data_offsets": [offset, offset + size]}
        layout.append((n, size))
        offset += size
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # the data section starts 8-byte aligned, as safetensors writes it
    return struct.pack("<Q", len(raw)) + raw, layout


def groups(names: list[str], infos: dict[str, TensorInfo], budget: int):
    group, size = [], 0
    for n in names:
        if group and size + infos[n].nbytes() > budget:
            yield group
            group, size = [], 0
        group.append(n)
        size += infos[n].nbytes()
    if group:
        yield group


class RangeCopier:
    """Copies byte ranges between files by the fastest means that works here: copy_file_range (in the kernel,
    no user-space buffer), else sendfile, else read/pwrite through one buffer. Falls back once per merge, on the
    first call that says the fast means cannot do it, and remembers."""

    def __init__(self):
        self.method = "copy_file_range" if hasattr(os, "copy_file_range") else "sendfile" if hasattr(os, "sendfile") else "read/write"

    def copy(self, src_fd: int, src_offset: int, dst_fd: int, dst_offset: int, count: int) -> int:
        """Copy up to ``count`` bytes; returns how many (0 at the end of the source)."""
        while True:
            try:
                if self.method == "copy_file_range":
                    return os.copy_file_range(src_fd, dst_fd, count, src_offset, dst_offset)
                if self.method == "sendfile":
                    os.lseek(dst_fd, dst_offset, os.SEEK_SET)
                    return os.sendfile(dst_fd, src_fd, src_offset, count)
                data = os.pread(src_fd, min(count, 8 << 20), src_offset)
                return os.pwrite(dst_fd, data, dst_offset) if data else 0
            except OSError as err:
                if err.errno not in _NO_RANGE_COPY or self.method == "read/write":
                    raise
                self.method = "sendfile" if self.method == "copy_file_range" and hasattr(os, "sendfile") else "read/write"


def copy_range(copier: RangeCopier, src: Path, src_offset: int, fd: int, dst_offset: int, count: int,
               cancelled: Callable[[], bool] = lambda: False, progress: Callable[[int], object] = lambda n: None) -> None:
    with open(src, "rb") as f:
        while count:
            if cancelled():
                raise Cancelled
            done = copier.copy(f.fileno(), src_offset, fd, dst_offset, min(count, COPY_STEP))
            if done == 0:
                raise CheckpointError(f"{src} ended early: the file is truncated; copy the checkpoint again")
            src_offset, dst_offset, count = src_offset + done, dst_offset + done, count - done
            progress(done)


def weight_files(source, names: dict[str, str] | list[str], max_shard_size: str | int = "5GB", dtype: str | None = None,
                 stem: str = "model") -> list[str]:
    """The names of the files ``write_weights`` writes for these arguments (shards in order, then the index if any)."""
    split, _, _ = _plan(source, names, max_shard_size, dtype_name(dtype), stem)
    return list(split.filename_to_tensors) + ([f"{stem}.safetensors.index.json"] if split.is_sharded else [])


def _plan(source, names, max_shard_size, dtype: str | None, stem: str):
    mapping = dict(names) if isinstance(names, dict) else {n: n for n in names}
    infos = {out: source.tensors[src] for out, src in mapping.items()}
    split = split_state_dict_into_shards_factory(
        infos, get_storage_size=lambda info: info.nbytes(dtype), filename_pattern=stem + "{suffix}.safetensors", max_shard_size=max_shard_size,
    )
    return split, infos, mapping


def write_weights(
    source, names: dict[str, str] | list[str], out_dir: Path, max_shard_size: str | int = "5GB", dtype: str | None = None,
    memory_budget: str | int = "512MB", cancelled: Callable[[], bool] = lambda: False, stem: str = "model",
    part: tuple[int, int] = (0, 1),
) -> list[str]:
    """Stream the source's tensors into safetensors shards (+ index) in ``out_dir``; returns the names of the files
    written. ``names``: output name -> source tensor name (a list: the same names). ``cancelled`` is asked between
    pieces of at most COPY_STEP bytes; when it says yes, Cancelled is raised. ``part`` = (k, n): only the shards
    whose position in the plan is k modulo n, and the index only for k = 0, so that n processes given the same
    arguments write one folder between them (the final export: fsdp_recipes.train.export)."""
    dtype = dtype_name(dtype)
    split, infos, mapping = _plan(source, names, max_shard_size, dtype, stem)
    budget = internals.get("huggingface_hub.serialization._base.parse_size_to_int")(memory_budget) if isinstance(memory_budget, str) else memory_budget
    mine = [(f, shard) for i, (f, shard) in enumerate(split.filename_to_tensors.items()) if i % part[1] == part[0]]
    total = sum(info.nbytes(dtype) for info in infos.values())
    copier, written = RangeCopier(), []
    with tqdm(total=sum(infos[n].nbytes(dtype) for _, shard in mine for n in shard), unit="B", unit_scale=True, desc="Writing weights",
              disable=part[0] != 0) as bar:  # one bar: the first part's
        for filename, shard_names in mine:
            header, layout = _safetensors_header(sorted(shard_names), infos, dtype)
            offsets, position = {}, len(header)
            for n, size in layout:
                offsets[n], position = position, position + size
            fd = os.open(out_dir / filename, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            try:
                os.write(fd, header)
                # Kernel copies first, in the order the bytes lie in the checkpoint files: read sequentially, the
                # copy runs as fast as `cp` (in layout order it was up to 1.5x slower). Everything else is read,
                # cast and written after, in budgeted groups.
                plans = {n: source.copy_plan(mapping[n]) for n, _ in layout} if dtype is None and hasattr(source, "copy_plan") else {}
                slow = [n for n, _ in layout if plans.get(n) is None]
                pieces = sorted((src, src_offset, offsets[n] + at, count) for n, plan in plans.items() if plan for src, src_offset, at, count in plan)
                for src, src_offset, dst_offset, count in pieces:
                    copy_range(copier, src, src_offset, fd, dst_offset, count, cancelled, bar.update)
                for group in groups(slow, infos, budget):
                    if cancelled():
                        raise Cancelled
                    tensors = source.read([mapping[n] for n in group])
                    for n in group:
                        t = tensors.pop(mapping[n])
                        # the dtype and shape the header states, whatever a source's read gave: bytes of another size
                        # would run into the next tensor's place in the file
                        t = t.to(torch_dtype(dtype or infos[n].dtype)).contiguous()
                        if tuple(t.shape) != tuple(infos[n].shape):  # with the stated dtype, the stated bytes
                            raise CheckpointError(f"{n}: the checkpoint gave a tensor of shape {tuple(t.shape)}, where its "
                                                  f"metadata states {tuple(infos[n].shape)}: the checkpoint is inconsistent; copy it again")
                        if t.numel():
                            os.pwrite(fd, t.reshape(-1).view(torch_dtype("uint8")).numpy(), offsets[n])
                        bar.update(infos[n].nbytes(dtype))
                        del t
                os.ftruncate(fd, position)  # only grows the file when trailing tensors are empty
            finally:
                os.close(fd)
            written.append(filename)
    if split.is_sharded and part[0] == 0:
        index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(split.tensor_to_filename.items()))}
        (out_dir / f"{stem}.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
        written.append(f"{stem}.safetensors.index.json")
    return written
