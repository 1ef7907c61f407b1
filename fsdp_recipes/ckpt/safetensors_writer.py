"""Streaming tensors from a checkpoint source into safetensors shards (+ index), as save_pretrained names them.

The headers are computed up front from the source's shapes and dtypes; then each file is written front to back
through fsdp_recipes.direct_writes.DirectFile (O_DIRECT where the filesystem takes it, fsynced at close): a tensor
whose bytes lie plain in the source is read straight into the writer's buffer, the rest (casts, other layouts) is
read in groups of at most ``memory_budget`` bytes (a larger tensor alone). Peak memory follows the budget and the
largest tensor, never the model size. A float tensor holding NaN or infinity, as read or once cast, is refused
(copier.finite): no model folder is written from a run that diverged.
"""

from __future__ import annotations

import json
import os
import struct
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

from huggingface_hub import split_state_dict_into_shards_factory
from tqdm.auto import tqdm

from fsdp_recipes.ckpt.copier import FAILED, Cancelled, copy_piece, finite, non_finite_error
from fsdp_recipes.ckpt.readers import SAFETENSORS_DTYPES, TensorInfo, dtype_name, torch_dtype
from fsdp_recipes.compat import internals
from fsdp_recipes.direct_writes import DirectFile
from fsdp_recipes.errors import CheckpointError


def _safetensors_header(
    names: list[str], infos: dict[str, TensorInfo], dtype: str | None
) -> tuple[bytes, list[tuple[str, int]]]:
    header, offset, layout = {"__metadata__": {"format": "pt"}}, 0, []
    for n in names:
        size = infos[n].nbytes(dtype)
        header[n] = {
            "dtype": SAFETENSORS_DTYPES[dtype or infos[n].dtype],
            "shape": list(infos[n].shape),
            "data_offsets": [offset, offset + size],
        }
        layout.append((n, size))
        offset += size
    raw = json.dumps(header, separators=(",", ":")).encode()
    # the data section starts 8-byte aligned, as safetensors writes it
    raw += b" " * (-len(raw) % 8)
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


def _in_order(plan: list[tuple[Path, int, int, int]] | None, size: int) -> list[tuple[Path, int, int, int]] | None:
    """A copy plan's pieces in the order they fill the tensor, or None (read the tensor instead) when they do not
    fill its ``size`` bytes exactly once: the file is written front to back."""
    if plan is None:
        return None
    plan, at = sorted(plan, key=lambda piece: piece[2]), 0
    for _, _, start, count in plan:
        if start != at:
            return None
        at += count
    return plan if at == size else None


def weight_files(
    source,
    names: dict[str, str] | list[str],
    max_shard_size: str | int = "5GB",
    dtype: str | None = None,
    stem: str = "model",
) -> list[str]:
    """The names of the files ``write_weights`` writes for these arguments (shards in order, then the index if any)."""
    split, _, _ = _plan(source, names, max_shard_size, dtype_name(dtype), stem)
    return list(split.filename_to_tensors) + ([f"{stem}.safetensors.index.json"] if split.is_sharded else [])


def _plan(source, names, max_shard_size, dtype: str | None, stem: str):
    mapping = dict(names) if isinstance(names, dict) else {n: n for n in names}
    infos = {out: source.tensors[src] for out, src in mapping.items()}
    split = split_state_dict_into_shards_factory(
        infos,
        get_storage_size=lambda info: info.nbytes(dtype),
        filename_pattern=stem + "{suffix}.safetensors",
        max_shard_size=max_shard_size,
    )
    return split, infos, mapping


def write_weights(
    source,
    names: dict[str, str] | list[str],
    out_dir: Path,
    max_shard_size: str | int = "5GB",
    dtype: str | None = None,
    memory_budget: str | int = "512MB",
    cancelled: Callable[[], bool] = lambda: False,
    stem: str = "model",
    part: tuple[int, int] = (0, 1),
    copy_process: bool = False,
) -> list[str]:
    """Stream the source's tensors into safetensors shards (+ index) in ``out_dir``; returns the names of the files
    written. ``names``: output name -> source tensor name (a list: the same names). ``cancelled`` is asked between
    pieces of at most COPY_STEP bytes; when it says yes, Cancelled is raised. ``part`` = (k, n): only the shards
    whose position in the plan is k modulo n, and the index only for k = 0, so that n processes given the same
    arguments write one folder between them (the final export: fsdp_recipes.train.export). ``copy_process``: shards
    that are byte copies alone are written by a child process (fsdp_recipes.ckpt.copier: for a caller whose other
    threads run Python meanwhile), while this one writes the rest."""
    dtype = dtype_name(dtype)
    split, infos, mapping = _plan(source, names, max_shard_size, dtype, stem)
    budget = (
        internals.get("huggingface_hub.serialization._base.parse_size_to_int")(memory_budget)
        if isinstance(memory_budget, str)
        else memory_budget
    )
    mine = [(f, shard) for i, (f, shard) in enumerate(split.filename_to_tensors.items()) if i % part[1] == part[0]]
    total = sum(info.nbytes(dtype) for info in infos.values())
    shards, copies = [], []
    for filename, shard_names in mine:
        header, layout = _safetensors_header(sorted(shard_names), infos, dtype)
        plans = (
            {n: _in_order(source.copy_plan(mapping[n]), size) for n, size in layout}
            if dtype is None and hasattr(source, "copy_plan")
            else {}
        )
        if copy_process and all(plans.get(n) for n, _ in layout):
            copies.append(
                {
                    "path": str(out_dir / filename),
                    "header": header.hex(),
                    "pieces": [
                        [str(src), offset, count, infos[n].dtype, n]
                        for n, _ in layout
                        for src, offset, _, count in plans[n]
                    ],
                }
            )
        else:
            shards.append((out_dir / filename, header, layout, plans))
    # one bar: the first part's
    with tqdm(
        total=sum(infos[n].nbytes(dtype) for _, shard in mine for n in shard),
        unit="B",
        unit_scale=True,
        desc="Writing weights",
        disable=part[0] != 0,
    ) as bar:
        child, errors = _start_copies(copies) if copies else (None, None)
        try:
            for path, header, layout, plans in shards:
                _write_shard(path, header, layout, plans, source, mapping, infos, dtype, budget, cancelled, bar.update)
            if child is not None:
                _finish_copies(child, errors, copies, cancelled, bar.update)
        finally:
            if child is not None:
                # an error or a cancel here: the copy stops too
                if child.poll() is None:
                    child.kill()
                child.wait()
                child.stdout.close()
                errors.close()
    written = [name for name, _ in mine]
    if split.is_sharded and part[0] == 0:
        index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(split.tensor_to_filename.items()))}
        (out_dir / f"{stem}.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
        written.append(f"{stem}.safetensors.index.json")
    return written


def _write_shard(
    path: Path,
    header: bytes,
    layout: list[tuple[str, int]],
    plans: dict,
    source,
    mapping: dict[str, str],
    infos: dict[str, TensorInfo],
    dtype: str | None,
    budget: int,
    cancelled: Callable[[], bool],
    progress: Callable[[int], object],
) -> None:
    """One safetensors file, front to back: a tensor whose bytes lie plain in the source is read straight into the
    writer's buffer; the rest are read (and cast) in budgeted groups, in the order they are written."""
    slow = groups([n for n, _ in layout if plans.get(n) is None], infos, budget)
    loaded: dict = {}
    # fsynced at close: a renamed output folder is on disk
    out = DirectFile(path)
    try:
        out.write(header)
        for n, size in layout:
            if cancelled():
                raise Cancelled
            if plan := plans.get(n):
                for src, src_offset, _, count in plan:
                    copy_piece(out, src, src_offset, count, cancelled, progress, infos[n].dtype, n)
                continue
            if n not in loaded:
                group = next(slow)
                tensors = source.read([mapping[m] for m in group])
                loaded = {m: tensors[mapping[m]] for m in group}
                del tensors
            # the dtype and shape the header states, whatever a source's read gave: bytes of another size would run
            # into the next tensor's place in the file
            given = loaded.pop(n)
            t = given.to(torch_dtype(dtype or infos[n].dtype)).contiguous()
            # with the stated dtype, the stated bytes
            if tuple(t.shape) != tuple(infos[n].shape):
                raise CheckpointError(
                    f"{n}: the checkpoint gave a tensor of shape {tuple(t.shape)}, where its "
                    f"metadata states {tuple(infos[n].shape)}: the checkpoint is inconsistent; copy it again"
                )
            if t.numel():
                raw = t.reshape(-1).view(torch_dtype("uint8")).numpy()
                # a cast to a narrower float can make infinities too
                if not finite(raw, dtype or infos[n].dtype):
                    raise out_of_range_error(n, dtype, given) or non_finite_error(n, dtype or infos[n].dtype)
                out.write(raw)
            progress(size)
            del t
    except BaseException:
        out.abort()
        raise
    out.close()


# the dtypes --dtype offers, and of the other dtypes a weight might be cast to, which ones hold larger values
CAST_CHOICES = ("float16", "bfloat16", "float32")


def out_of_range_error(name: str, dtype: str | None, given) -> CheckpointError | None:
    """The error for finite weights that --dtype ``dtype`` cannot hold (their cast made infinities: not a run that
    diverged), naming the --dtype choices that hold them; None when there was no --dtype, or ``given`` (the tensor
    before the cast) is itself not finite."""
    import torch

    if dtype is None or not torch.isfinite(given).all():
        return None
    largest = torch.finfo(torch_dtype(dtype)).max
    wider = [d for d in CAST_CHOICES if torch.finfo(torch_dtype(d)).max > largest]
    saved = str(given.dtype).removeprefix("torch.")
    instead = f"merge with --dtype {' or '.join(wider)}, or " if wider else ""
    return CheckpointError(
        f"{name}: its values exceed {dtype}'s range (largest {largest:.4g}) and would be written as infinities, so "
        f"nothing was written; {instead}leave --dtype out to keep {saved}"
    )


def _start_copies(files: list[dict]) -> tuple[subprocess.Popen, object]:
    """The child that writes ``files`` (fsdp_recipes.ckpt.copier), its plan sent, its stderr in a temporary file
    (a pipe nobody reads while the copy runs could fill and stop it)."""
    # the package as this process has it, installed or not, and never the current folder, which -m or -c put first
    # on the path (a folder named fsdp_recipes there, another checkout's, or a json.py would be imported instead)
    start = (
        "import sys; sys.path[:] = [sys.argv[1], *(p for p in sys.path if p not in ('', '.'))]; "
        "from fsdp_recipes.ckpt.copier import main; sys.exit(main())"
    )
    # and the interpreter as this one was started: a merge run with -I, -E or -s is isolated in its child too
    flags = (
        ["-I"]
        if sys.flags.isolated
        else [f for f, on in (("-E", sys.flags.ignore_environment), ("-s", sys.flags.no_user_site)) if on]
    )
    errors = tempfile.TemporaryFile("w+")
    child = subprocess.Popen(
        [sys.executable, *flags, "-c", start, str(Path(__file__).resolve().parents[2])],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=errors,
        text=True,
    )
    try:
        child.stdin.write(json.dumps({"files": files}))
        child.stdin.close()
    except BrokenPipeError:
        # it died at once: _finish_copies says why
        pass
    return child, errors


def _finish_copies(
    child: subprocess.Popen, errors, files: list[dict], cancelled: Callable[[], bool], progress: Callable[[int], object]
) -> None:
    """Follow the child's progress to its end; Cancelled when the check beside fails (the caller kills it), one
    CheckpointError when it failed or its files are not whole (header and every piece: never trusted from its
    exit status alone)."""
    for line in child.stdout:
        if cancelled():
            raise Cancelled
        progress(int(line))
    if cancelled():
        raise Cancelled
    code = child.wait()
    errors.seek(0)
    said = [line.strip() for line in errors.read().splitlines() if line.strip()]
    # the copier's own one-line error (a truncated record, a full disk)
    if code == FAILED:
        raise CheckpointError(
            said[-1] if said else "the copy process failed without a word: nothing was published; run the merge again"
        )
    if code:
        raise CheckpointError(
            f"the copy process ended with status {code}"
            + (f" ({said[-1]})" if said else "")
            + ": nothing was published; run the merge again"
        )
    for f in files:
        want = len(f["header"]) // 2 + sum(piece[2] for piece in f["pieces"])
        have = os.stat(f["path"]).st_size if os.path.isfile(f["path"]) else None
        if have != want:
            raise CheckpointError(
                f"the copy process ended without writing {Path(f['path']).name} whole ({have} of {want} bytes): "
                "nothing was published; run the merge again"
            )
