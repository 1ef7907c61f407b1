"""The folder a merge writes: ``check_output`` refuses an output that would destroy or mix with the input, or that
--overwrite may not replace (anything but a model folder), and what a killed merge left beside it is cleaned up
before the next one decides anything: its own marked staging folders removed (``remove_stale_staging``), an
earlier output it had moved aside put back (``restore_interrupted``). Nothing that is not our staging is deleted.
A merge that stops or fails leaves at once, without waiting for the check beside its copy (``check_pool``).
"""

from __future__ import annotations

import glob
import os
import re
import socket
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path

from fsdp_recipes.ckpt.layout import is_exported_adapter, is_model_folder, overlap, real, training_content
from fsdp_recipes.ckpt.resolve import ResolvedInput
from fsdp_recipes.errors import CheckpointError
from fsdp_recipes.removal import contents, is_ours, move, process_alive, remove


def check_output(input_path, resolved: ResolvedInput, output_path, overwrite: bool) -> Path:
    """The output's real path, after refusing one that would destroy or mix with the input (compared as real
    paths: symlinks and `..` resolved) or, with --overwrite, a folder holding training checkpoints."""
    out = real(output_path)
    for given in {
        real(input_path),
        real(resolved.checkpoint_dir),
        real(resolved.weights_dir or resolved.checkpoint_dir),
    }:
        if overlap(out, given):
            how = (
                "is the input" if out == given else "is inside the input" if given in out.parents else "holds the input"
            )
            raise CheckpointError(f"output {output_path} {how} {given}: choose a folder outside it")
    if out.exists() or out.is_symlink():
        if not out.is_dir():
            raise CheckpointError(f"output {output_path} exists and is not a folder: choose another output")
        if not overwrite:
            raise CheckpointError(f"output {output_path} already exists: choose another folder or pass --overwrite")
        if what := training_content(out):
            raise CheckpointError(
                f"output {output_path} holds {what}: --overwrite only replaces a model folder; choose another output"
            )
        if not (is_model_folder(out) or is_exported_adapter(out)):
            raise CheckpointError(
                f"output {output_path} holds more than a model folder ({contents(out)}): --overwrite only "
                "replaces a folder of weights, config and tokenizer files; choose another output"
            )
    return out


# the marker purpose of the hidden folders a merge writes into before the rename
STAGING = "merge staging"


def staging_name(out: Path, kind: str, pid: int | None = None) -> Path:
    return out.parent / f".{out.name}.{kind}-{socket.gethostname()}-{os.getpid() if pid is None else pid}"


def _left_by_merges(out: Path) -> list[tuple[Path, str, str, str, bool]]:
    """(folder, "tmp" or "old", host, pid, gone) of each ``.out.tmp-`` or ``.out.old-`` folder a merge into ``out``
    named for itself; ``gone``: on this host, and its process is gone (on another host nobody here can tell)."""
    pattern = re.compile(rf"\.{re.escape(out.name)}\.(tmp|old)-(.+)-(\d+)")
    found, here = [], socket.gethostname()
    # 'run[1]' is no pattern
    for path in sorted(out.parent.glob(f".{glob.escape(out.name)}.*")) if out.parent.is_dir() else []:
        if m := pattern.fullmatch(path.name):
            kind, host, pid = m.groups()
            found.append((path, kind, host, pid, host == here and not process_alive(int(pid))))
    return found


def remove_stale_staging(out: Path, log=print) -> None:
    """Staging folders a killed merge into ``out`` left behind (this host's, their process gone): removed, said."""
    for path, _, _, pid, gone in _left_by_merges(out):
        # only our own marked staging folders: a folder merely named like one is someone else's
        if gone and is_ours(path, STAGING):
            remove(path, STAGING)
            log(f"removed {path}, left by a merge that was killed (process {pid})")


def restore_interrupted(out: Path, log=print) -> None:
    """A merge with --overwrite moves the earlier output aside (``.out.old-host-pid``), then its result in: killed
    between the two renames, it left no ``out`` and the earlier model hidden. That folder goes back to ``out``
    (before anything decides about ``out``); where ``out`` exists again it is kept and named, as is a finished result
    the killed merge had not yet moved in. One of another host's merge, or of a process alive here (a merge still
    running, or the number reused since), is named and left alone. Nothing is deleted: they were the user's
    outputs, not our staging."""
    for path, kind, host, pid, gone in _left_by_merges(out):
        if is_ours(path, STAGING) or path.is_symlink() or not (is_model_folder(path) or is_exported_adapter(path)):
            # our marked staging (remove_stale_staging's), or not a folder a merge moves aside
            continue
        what = "an earlier output it had moved aside" if kind == "old" else "its finished result, not yet moved in"
        if not gone:
            where = f"process {pid} on {host}" if host != socket.gethostname() else f"process {pid}, alive here"
            log(
                f"left {path} alone: {what} by a merge ({where}) that may still be running; if none is, move it back "
                "or delete it yourself"
            )
        elif kind == "old" and not (out.exists() or out.is_symlink()):
            move(path, out)
            log(
                f"restored {out} from {path.name}: a merge killed between its two renames (process {pid}) had "
                "moved it aside"
            )
        else:
            log(f"kept {path}: {what} by a merge that was killed (process {pid}); move or delete it yourself")


@contextmanager
def check_pool() -> Iterator[ThreadPoolExecutor]:
    """The thread of the check beside the copy (transformers' imports: seconds). Left on an error or a stop (SIGTERM,
    Ctrl-C), the merge does not wait for it: its staging folder is already removed, the check writes nothing, and a
    stopped merge sat out those seconds of a scheduler's grace period. Left normally, it waits as ``with`` does."""
    pool = ThreadPoolExecutor(1)
    try:
        yield pool
    except BaseException:
        pool.shutdown(wait=False, cancel_futures=True)
        raise
    pool.shutdown()
