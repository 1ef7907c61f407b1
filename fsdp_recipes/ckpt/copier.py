"""Output files made of byte ranges of the checkpoint's files, copied in a process of its own (started by
safetensors_writer, which runs this module's ``main``).

Why a process: a merge checks the weights with transformers in a thread beside the copy (seconds of imports, all
Python), and each of the copy's system calls then waits for the GIL on its way back: 5.9 GB took 10.5 s where it
took 4.1 s alone, and 5.0 s beside the same Python work in another process (bench/merge_benchmark.py's raw
torch DCP row). A child has an interpreter of its own, and it imports neither torch nor transformers (0.2 s).

The plan comes from the parent (safetensors_writer.write_weights) as JSON on stdin, never from a file a user gave:
``{"files": [{"path": str, "header": hex, "pieces": [[source path, offset, bytes, dtype, tensor name], ...]}]}``.
The child prints the bytes copied, one line per piece of at most COPY_STEP, and on a bad source one line and exit
status FAILED; the parent kills it when the check beside fails, and checks every file's size after it. Each file is
written by DirectFile (fsynced at close), or not at all.

Every float tensor's bytes are checked for NaN and infinity as they are copied (``finite``, at memory speed, on the
pages the copy just read): a checkpoint of a run that diverged, or bytes changed in it, is refused in one line
naming the tensor, never written out as a model that computes nothing but NaN.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from pathlib import Path

import numpy as np

from fsdp_recipes.direct_writes import DirectFile
from fsdp_recipes.errors import CheckpointError

# bytes copied between two looks at whether a check running beside the copy has failed
COPY_STEP = 64 << 20
# exit status: the one line on stderr is the error (1 is Python's own, with a traceback)
FAILED = 3


class Cancelled(Exception):
    """The copy was stopped because a check running beside it failed."""


# A float's bits with the sign masked off are at least its exponent's all-ones exactly when it is NaN or infinite
# (float8_e4m3fn has no infinity: its one NaN is 0x7F): (element view, that mask, the all-ones exponent)
_NON_FINITE = {
    "float64": ("<u8", 0x7FFF_FFFF_FFFF_FFFF, 0x7FF0_0000_0000_0000),
    "float32": ("<u4", 0x7FFF_FFFF, 0x7F80_0000),
    "bfloat16": ("<u2", 0x7FFF, 0x7F80),
    "float16": ("<u2", 0x7FFF, 0x7C00),
    "float8_e5m2": ("u1", 0x7F, 0x7C),
    "float8_e4m3fn": ("u1", 0x7F, 0x7F),
}
# elements masked at a time: a bounded scratch buffer, and the speed of memory (~12 GB/s)
_FINITE_BLOCK = 1 << 20


def finite(data, dtype: str | None) -> bool:
    """No NaN or infinity among the elements of ``data`` (the raw little-endian bytes of whole elements of ``dtype``,
    a torch dtype name); True for a dtype without them (integers, bool) or unknown here."""
    if dtype not in _NON_FINITE:
        return True
    view, mask, limit = _NON_FINITE[dtype]
    values, mask = np.frombuffer(data, dtype=view), np.array(mask, dtype=view)
    scratch = np.empty(min(len(values), _FINITE_BLOCK), dtype=view)
    for start in range(0, len(values), _FINITE_BLOCK):
        part = values[start : start + _FINITE_BLOCK]
        if np.bitwise_and(part, mask, out=scratch[: len(part)]).max() >= limit:
            return False
    return True


def non_finite_error(name: str, dtype: str) -> CheckpointError:
    return CheckpointError(
        f"{name} holds NaN or infinite values ({dtype}): a model with them computes nothing but NaN, so none was "
        "written; merge an earlier checkpoint (the run diverged before this one, or its files were changed)"
    )


def copy_piece(
    out: DirectFile,
    src: Path,
    src_offset: int,
    count: int,
    cancelled: Callable[[], bool] = lambda: False,
    progress: Callable[[int], object] = lambda n: None,
    dtype: str | None = None,
    name: str = "a tensor",
) -> None:
    """Append ``count`` bytes of ``src`` from ``src_offset`` to ``out``, asking ``cancelled`` every COPY_STEP. The bytes
    are whole elements of the tensor ``name`` of ``dtype``: a float one is checked for NaN and infinity as it goes,
    in the pages the copy just read (CheckpointError naming it)."""
    with open(src, "rb") as f:
        while count:
            if cancelled():
                raise Cancelled
            # a multiple of every element size
            step = min(count, COPY_STEP)
            if out.copy_from(f.fileno(), src_offset, step) != step:
                raise CheckpointError(f"{src} ended early: the file is truncated; copy the checkpoint again")
            if dtype in _NON_FINITE and not finite(np.memmap(f, np.uint8, "r", src_offset, (step,)), dtype):
                raise non_finite_error(name, dtype)
            src_offset, count = src_offset + step, count - step
            progress(step)


def write_file(
    path: Path,
    header: bytes,
    pieces: list[tuple],
    cancelled: Callable[[], bool] = lambda: False,
    progress: Callable[[int], object] = lambda n: None,
) -> None:
    """``path`` = ``header`` followed by each piece, whole and fsynced, or (after an error) incomplete, for the
    caller to remove."""
    out = DirectFile(path)
    try:
        out.write(header)
        # what: [dtype, tensor name] (the copy plan's)
        for src, offset, count, *what in pieces:
            copy_piece(out, Path(src), offset, count, cancelled, progress, *what)
    except BaseException:
        out.abort()
        raise
    out.close()


def main() -> int:
    plan = json.loads(sys.stdin.read())
    path = None
    try:
        for f in plan["files"]:
            path = f["path"]
            write_file(Path(path), bytes.fromhex(f["header"]), f["pieces"], progress=lambda n: print(n, flush=True))
    # a write's error names no file: the one being written
    except (CheckpointError, OSError) as err:
        print(
            str(err)
            if isinstance(err, CheckpointError)
            else f"{err.filename or path}: {err.strerror or err}: nothing was published; "
            "fix it (free space, a file size limit, permissions) and run the merge again",
            file=sys.stderr,
        )
        return FAILED
    return 0


if __name__ == "__main__":
    sys.exit(main())
