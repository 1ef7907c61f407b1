"""Output files made of byte ranges of the checkpoint's files, copied in a process of its own (started by
safetensors_writer, which runs this module's ``main``).

Why a process: a merge checks the weights with transformers in a thread beside the copy (seconds of imports, all
Python), and each of the copy's system calls then waits for the GIL on its way back: 5.9 GB took 10.5 s where it
took 4.1 s alone, and 5.0 s beside the same Python work in another process (bench/merge_benchmark.py's raw
torch DCP row). A child has an interpreter of its own, and it imports neither torch nor transformers (0.2 s).

The plan comes from the parent (safetensors_writer.write_weights) as JSON on stdin, never from a file a user gave:
``{"files": [{"path": str, "header": hex, "pieces": [[source path, offset, bytes], ...]}]}``. The child prints the
bytes copied, one line per piece of at most COPY_STEP, and on a bad source one line and exit status FAILED; the
parent kills it when the check beside fails, and checks every file's size after it. Each file is written by
DirectFile (fsynced at close), or not at all.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from pathlib import Path

from fsdp_recipes.direct_writes import DirectFile
from fsdp_recipes.errors import CheckpointError

COPY_STEP = 64 << 20  # bytes copied between two looks at whether a check running beside the copy has failed
FAILED = 3  # exit status: the one line on stderr is the error (1 is Python's own, with a traceback)


class Cancelled(Exception):
    """The copy was stopped because a check running beside it failed."""


def copy_piece(
    out: DirectFile,
    src: Path,
    src_offset: int,
    count: int,
    cancelled: Callable[[], bool] = lambda: False,
    progress: Callable[[int], object] = lambda n: None,
) -> None:
    """Append ``count`` bytes of ``src`` from ``src_offset`` to ``out``, asking ``cancelled`` every COPY_STEP."""
    with open(src, "rb") as f:
        while count:
            if cancelled():
                raise Cancelled
            step = min(count, COPY_STEP)
            if out.copy_from(f.fileno(), src_offset, step) != step:
                raise CheckpointError(f"{src} ended early: the file is truncated; copy the checkpoint again")
            src_offset, count = src_offset + step, count - step
            progress(step)


def write_file(
    path: Path,
    header: bytes,
    pieces: list[tuple[Path, int, int]],
    cancelled: Callable[[], bool] = lambda: False,
    progress: Callable[[int], object] = lambda n: None,
) -> None:
    """``path`` = ``header`` followed by each piece, whole and fsynced, or (after an error) incomplete, for the
    caller to remove."""
    out = DirectFile(path)
    try:
        out.write(header)
        for src, offset, count in pieces:
            copy_piece(out, Path(src), offset, count, cancelled, progress)
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
    except (CheckpointError, OSError) as err:  # a write's error names no file: the one being written
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
