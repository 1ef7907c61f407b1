"""The one patch behind our checkpoint saves: accelerate's sharded saves through DCP, written past the page cache,
and (asynchronous checkpoints) through DCP's ``async_save``.

accelerate 1.15 writes SHARDED_STATE_DICT checkpoints with ``torch.distributed.checkpoint.save`` (save_fsdp_model,
save_fsdp_optimizer, which the Trainer calls for each checkpoint), reaching it as ``dist_cp.save`` after importing
the module inside the function. Within ``checkpoint_saves(...)`` that name is a wrapper:

- Direct writes (``direct=True``): the storage writer accelerate made (DCP's FileSystemWriter) gets a FileSystem
  whose shard files (.distcp) are fsdp_recipes.direct_writes.DirectFile: O_DIRECT where the filesystem takes it,
  the same bytes (the format is DCP's own; any DCP reader reads them). ``files`` counts the shard files written
  either way and why the page cache wrote some.
- In the background (``background=Background(...)``): DCP's ``async_save`` instead: the state dict is copied to host
  memory (the staging) before the call returns, so training goes on from a snapshot of this step, and a thread of
  its own writes the files. Each save of a checkpoint (the model's, then the optimizer's) coordinates with the other
  ranks over a gloo group of its own, ``groups(i)`` for the i-th save: their threads run at once, and two threads
  sharing one group interleave its collectives differently on each rank (a deadlock, seen). Each call's future is
  appended to ``futures``; the caller waits for them (fsdp_recipes.train.async_checkpoints).

- Either way a failed write fails the save with its own OSError (a full disk, a quota), not the RuntimeError
  torch.save's C++ writer makes of it (``_ShardFiles``). The final export's save is inside with ``direct=False``
  for that alone.

Outside the context nothing changes.

The host copy a background save stages into: fsdp_recipes.compat.host_copy.
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Callable
from contextlib import contextmanager

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.filesystem import FileSystem

from fsdp_recipes.compat.host_copy import local_bytes
from fsdp_recipes.direct_writes import DirectFile


@dataclasses.dataclass
class Background:
    """What background saves need: ``groups(i)`` and ``stagers(i)``, the gloo group and the ReusedHostCopy of the i-th
    save of a checkpoint; ``futures`` gets each save's future, ``staged_bytes`` the bytes of this rank's tensors it
    copied to host memory (0 for a save written in place), ``in_place`` whether it was."""

    groups: Callable
    stagers: Callable
    futures: list
    staged_bytes: list
    in_place: list = dataclasses.field(default_factory=list)


class ShardFiles:
    """How this rank's checkpoint shard files were written (fsdp_report.json's checkpoint_writes.shard_files)."""

    def __init__(self):
        self.direct, self.page_cache, self.why = 0, 0, None
        # a save whose storage writer was not DCP's FileSystemWriter: left as it was
        self.other_writer = None
        # background saves write from DCP's threads
        self._lock = threading.Lock()

    def add(self, page_cache_why: str | None) -> None:
        with self._lock:
            if page_cache_why is None:
                self.direct += 1
            else:
                self.page_cache += 1
                self.why = self.why or page_cache_why

    def report(self) -> dict:
        return {
            "direct": self.direct,
            "page_cache": self.page_cache,
            **({"page_cache_why": self.why} if self.why else {}),
            **({"other_writer": self.other_writer} if self.other_writer else {}),
        }


class _ShardFiles(FileSystem):
    """DCP's FileSystem, a failed write of a file raising the write's own OSError. torch.save writes through C++,
    which turns the OSError of a write its callback made (a full disk, a quota, a failing device) into a RuntimeError
    of its own ("unexpected pos 704 vs 598") holding the OSError only as its context, and DCP's gather of every rank's
    error (a pickle) drops that context: the line a run ends with could not say what failed."""

    @contextmanager
    def create_stream(self, path, mode):
        try:
            with super().create_stream(path, mode) as stream:
                yield stream
        except RuntimeError as err:
            if isinstance(err.__context__, OSError):
                raise err.__context__ from err
            raise


class _DirectShardFiles(_ShardFiles):
    """DCP's FileSystem, its shard files (.distcp) written by DirectFile; every other file as before.

    The torch.save records of a shard file are written without the zip CRC-32 (``set_crc32_options(False)`` while
    the file is open, in the thread that writes it): torch.load and DCP never check it (a flipped byte loads
    silently either way; tests/unit/shared/test_direct_writes.py), and computing it was half the CPU a direct-written
    save
    takes (bench/direct_writes.py: 0.75 -> 0.33 s for 1.6 GB), CPU a background save takes from training. Our
    reader (fsdp_recipes.ckpt.torch_save_archive.stored_member) reads such records as torch does. The setting is per
    thread in torch 2.13 (a ContextVar; tested); where a torch keeps it process-wide, other torch.save calls
    meanwhile skip it too, and two shard files closed in crossed order by two writer threads can leave it off for the
    process: either loses nothing any torch reader checks."""

    def __init__(self, sync: bool, files: ShardFiles):
        super().__init__()
        self.sync, self.files = sync, files

    @contextmanager
    def create_stream(self, path, mode):
        if mode != "wb" or not str(path).endswith(".distcp"):
            with super().create_stream(path, mode) as stream:
                yield stream
            return
        crc = torch.serialization.get_crc32_options()
        stream = DirectFile(path, sync=self.sync)
        torch.serialization.set_crc32_options(False)
        try:
            yield stream
        except BaseException as err:
            # not written whole: no tail, no fsync; the save fails and the checkpoint stays incomplete
            stream.abort()
            # the write's own error, as _ShardFiles raises it (every later write fails because of the first)
            if isinstance(err, RuntimeError) and isinstance(stream.failure, OSError):
                raise stream.failure from err
            raise
        finally:
            torch.serialization.set_crc32_options(crc)
        stream.close()
        self.files.add(stream.page_cache_why)


def _our_files(storage_writer, files: ShardFiles, direct: bool):
    # DCP's FileSystemWriter, as accelerate makes it
    if type(getattr(storage_writer, "fs", None)) is FileSystem:
        storage_writer.fs = _DirectShardFiles(storage_writer.sync_files, files) if direct else _ShardFiles()
    elif direct:
        files.other_writer = (
            f"{type(storage_writer).__name__} without DCP's FileSystem: its files written as it writes them"
        )
    return storage_writer


@contextmanager
def checkpoint_saves(files: ShardFiles, *, direct: bool, background: Background | None = None):
    """accelerate's DCP saves inside: shard files written past the page cache (``direct``), in the background (given
    ``background``)."""
    save = dcp.save

    def wrapped(
        state_dict,
        *,
        checkpoint_id=None,
        storage_writer=None,
        planner=None,
        process_group=None,
        no_dist=False,
        **kwargs,
    ):
        storage_writer = _our_files(storage_writer, files, direct)
        if background is None:
            return save(
                state_dict,
                checkpoint_id=checkpoint_id,
                storage_writer=storage_writer,
                planner=planner,
                process_group=process_group,
                no_dist=no_dist,
                **kwargs,
            )
        i = len(background.futures)
        stager = background.stagers(i)
        background.futures.append(
            dcp.async_save(
                state_dict,
                checkpoint_id=checkpoint_id,
                storage_writer=storage_writer,
                planner=planner,
                process_group=background.groups(i),
                async_stager=stager,
                no_dist=no_dist,
            )
        )
        background.in_place.append(stager.last_in_place)
        background.staged_bytes.append(0 if stager.last_in_place else local_bytes(state_dict))
        # accelerate does not read save's result (the metadata); the future holds it
        return None

    dcp.save = wrapped
    try:
        yield
    finally:
        dcp.save = save
