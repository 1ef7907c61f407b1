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

Outside the context nothing changes: the final export's save is ordinary.

The staging: DCP's default (FileSystemWriter's own stager) builds a new host copy for every save, and for a DTensor
already on the CPU deep-copies it first and then allocates the copy it fills: two copies and a fresh allocation per
save, 4.4 s of the training thread per checkpoint of a 0.79 GB model on 2 CPU ranks (py-spy), as long as the
synchronous save it replaced. :class:`ReusedHostCopy` makes the host copy once (per save of a checkpoint: the
model's, the optimizer's) and copies into it at every later checkpoint: one memcpy, memory bounded by one copy of
this rank's shards and held for the run. Reuse is safe because at most one checkpoint is in flight (the caller
finishes a save before the next begins). Where the shards already live in host memory, ``ReusedHostCopy(in_place=True)``
makes no copy at all (see the class).

The first host copy: made at the first checkpoint, on the training thread, it was most of that checkpoint's stall on
a GPU (an H100: ~4.3 s, against ~0.3 s for each later save, bench/results/h100/checkpoint-stall-1): torch's helper
copies every GPU shard into new pageable memory first (``DTensor.to("cpu")``), then page-locks a second buffer of
the same size. :class:`HostBuffers` makes the buffers ahead, on a thread of its own, from the shapes of this rank's
weight and optimizer shards after the first optimizer step (fsdp_recipes.train.async_checkpoints starts it), and
the first save's copy is built around them with no copy of its own; a shape it did not foresee is made at the save,
as before.
"""

from __future__ import annotations

import dataclasses
import copy
import threading
import time
from collections.abc import Callable
from contextlib import contextmanager

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.filesystem import FileSystem

from fsdp_recipes.compat import internals
from fsdp_recipes.errors import InternalsChanged
from fsdp_recipes.direct_writes import DirectFile


class ReusedHostCopy:
    """A DCP AsyncStager: the state dict copied into host buffers made at the first save and reused after (made again
    only if the tensors' names, shapes or dtypes change). Pinned where CUDA is (faster copies from the GPU).

    ``in_place``: a state dict whose every tensor already lives in host memory (CPU training, CPU offload) is handed
    to the writer as it is, no copy (``last_in_place`` says so): whoever stages so must keep those tensors unchanged
    until the write is done (fsdp_recipes.train.async_checkpoints holds the next optimizer step). A copy there would
    double the host memory of the largest runs (a 70B model's fp32 weights and Adam state offloaded to the host are
    ~840 GB per node) and costs the training thread a memcpy of every byte."""

    def __init__(self, in_place: bool = False, ahead: HostBuffers | None = None):
        self.copy, self.layout = None, None
        self.in_place, self.last_in_place = in_place, False
        self.ahead = ahead  # buffers made before the first save (HostBuffers), for the first host copy only
        self.made = 0  # host copies made: 1 for a whole run unless the state dict changed shape

    @property
    def should_synchronize_after_execute(self) -> bool:
        return False  # the copy is done when stage returns

    def stage(self, state_dict):
        self.last_in_place = self.in_place and on_host(state_dict)
        if self.last_in_place:
            self.copy, self.layout = None, None  # a copy made before (tensors moved since) is not kept for nothing
            return state_dict
        layout = _layout(state_dict)
        if self.copy is None or layout != self.layout:
            self.copy = None  # the old buffers go before the new ones are made
            ahead, self.ahead = self.ahead, None
            if ahead is not None:
                self.copy = ahead.build(state_dict, layout)
            if self.copy is None:
                self.copy = internals.get("torch.distributed._state_dict_utils._create_cpu_state_dict")(state_dict, pin_memory=torch.cuda.is_available())
            _share_ties(state_dict, self.copy, {})
            self.layout = layout
            self.made += 1
        return internals.get("torch.distributed._state_dict_utils._copy_state_dict")(state_dict, self.copy)

    def synchronize_staging(self) -> None:
        pass

    def close(self) -> None:
        pass


class HostBuffers:
    """Host buffers for the first host copy, made ahead on a thread of their own: one per ``(dtype, shape)`` given
    (this rank's weight and optimizer shards), page-locked where CUDA is, else with their pages touched (so the
    save's copy does not fault them in). ``take`` hands them out to the first save's copy (waiting for the thread if
    it is still at work); ``close`` lets go of what no save took and says what it cost (fsdp_report.json).

    The memory is the host copy's own, which the run holds from its first checkpoint on anyway; made earlier. A
    failure here (no pinned memory left) is not the run's: the save then makes its copy as before, and says so."""

    def __init__(self, shapes, pin: bool):
        self.pin, self.free, self.bytes, self.seconds, self.error = pin, {}, 0, None, None
        self.taken, self.made_at_save, self.waited = 0, 0, 0.0
        self._thread = threading.Thread(target=self._make, args=(list(shapes),), name="host-copy-ahead", daemon=True)
        self._thread.start()

    @staticmethod
    def shapes_of(tensors) -> list[tuple]:
        """``(dtype, shape)`` of each tensor's memory on this rank (a DTensor's local shard), empty ones left out."""
        return [(local.dtype, tuple(local.shape)) for local in map(_local, tensors) if local.numel()]

    def _make(self, shapes) -> None:
        began = time.monotonic()
        try:
            for dtype, shape in shapes:
                buffer = torch.empty(shape, dtype=dtype, pin_memory=self.pin)
                if not self.pin:
                    buffer.zero_()
                self.free.setdefault((dtype, tuple(shape)), []).append(buffer)
                self.bytes += buffer.numel() * buffer.element_size()
        except Exception as error:  # noqa: BLE001 (the save makes what is missing, as without this)
            self.error = f"{type(error).__name__}: {error}"
        self.seconds = round(time.monotonic() - began, 3)

    def busy(self) -> bool:
        return self._thread.is_alive()

    def build(self, state_dict, layout: tuple):
        """The first host copy of ``state_dict`` around these buffers; None (torch's helper makes it, and the report
        says why) for a state dict this way does not build as torch's helper would."""
        why = None if _copyable(state_dict) else "a tensor type other than Tensor and DTensor"
        try:
            made = _host_copy(state_dict, self, {}) if why is None else None
        except (RuntimeError, TypeError, ValueError, InternalsChanged) as error:  # a torch where DTensor's empty_like or memory moved
            made, why = None, f"{type(error).__name__}: {error}"
        if made is not None and _layout(made) != layout:
            made, why = None, "its layout differed from the state dict's"
        if why is not None:
            self.error = self.error or f"a host copy was made by torch's helper instead ({why})"
        return made

    def take(self, dtype, shape):
        if self._thread.is_alive():
            began = time.monotonic()
            self._thread.join()
            self.waited += time.monotonic() - began
        found = self.free.get((dtype, tuple(shape)))
        if found:
            self.taken += 1
            return found.pop()
        self.made_at_save += 1
        return None

    def close(self) -> dict:
        self._thread.join()
        left = sum(b.numel() * b.element_size() for found in self.free.values() for b in found)
        self.free = {}
        return {"bytes": self.bytes, "seconds": self.seconds, "pinned": self.pin, "tensors_taken": self.taken,
                "tensors_made_at_save": self.made_at_save, "bytes_not_taken": left,
                "save_waited_seconds": round(self.waited, 3), **({"error": self.error} if self.error else {})}


def _copyable(state) -> bool:
    """Only dicts, lists, tuples, plain tensors, DTensors and plain values (what FSDP2's state dicts hold): anything else
    (FSDP1's ShardedTensor) is left to torch's helper."""
    from torch.distributed.tensor import DTensor

    if isinstance(state, torch.Tensor):
        return type(state) in (torch.Tensor, torch.nn.Parameter, DTensor)
    items = state.values() if isinstance(state, dict) else state if isinstance(state, (list, tuple)) else ()
    return all(_copyable(v) for v in items)


@torch.no_grad()
def _host_copy(state, ahead: HostBuffers, seen: dict):
    """What torch's ``_create_cpu_state_dict`` makes (same structure, 0-dim tensors as it makes them), each tensor's
    host memory taken from ``ahead`` where it holds one of that dtype and shape, and no copy of the data: the save
    copies into it next. A tensor held under several names (tied embeddings) gets one buffer."""
    from torch.distributed.tensor import DTensor

    if isinstance(state, DTensor):
        if state.dim() == 0:
            return state
        wrapper = torch.empty_like(state, device="cpu")  # the DTensor's mesh and placements; its memory is replaced next
        internals.set_attr(wrapper, "torch.distributed.tensor.DTensor._local_tensor", _host_tensor(state.to_local(), ahead, seen))
        return wrapper
    if isinstance(state, torch.Tensor):
        return torch.tensor(0, dtype=state.dtype) if state.dim() == 0 else _host_tensor(state, ahead, seen)
    if isinstance(state, dict):
        return {k: _host_copy(v, ahead, seen) for k, v in state.items()}
    if isinstance(state, (list, tuple)):
        made = [_host_copy(v, ahead, seen) for v in state]
        return tuple(made) if isinstance(state, tuple) else made
    return copy.deepcopy(state)


def _host_tensor(local, ahead: HostBuffers, seen: dict):
    if local.numel() == 0:
        return torch.zeros_like(local, device="cpu")
    tie = _same_tensor(local)
    if tie not in seen:
        taken = ahead.take(local.dtype, local.shape)
        seen[tie] = taken if taken is not None else torch.empty(local.shape, dtype=local.dtype, pin_memory=ahead.pin)
    return seen[tie]


def on_host(state) -> bool:
    """Every tensor of a (nested) state dict (a DTensor: its local shard) in ordinary host memory."""
    if isinstance(state, torch.Tensor):
        return _local(state).device.type == "cpu"
    items = state.values() if isinstance(state, dict) else state if isinstance(state, (list, tuple)) else ()
    return all(on_host(v) for v in items)


def _local(tensor):
    from torch.distributed.tensor import DTensor

    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def _same_tensor(local) -> tuple:
    """What a tensor held under several names (tied embeddings) has in common under each: its memory and its view."""
    return (local.data_ptr(), tuple(local.shape), local.stride(), local.dtype)


def _share_ties(state, copy, seen: dict) -> None:
    """A tensor the state dict holds under several names (tied embeddings: lm_head.weight and embed_tokens.weight)
    gets one host buffer, not one per name (torch's helper makes one per name, held for the run)."""
    items = state.items() if isinstance(state, dict) else enumerate(state) if isinstance(state, (list, tuple)) else ()
    for key, value in items:
        if isinstance(value, torch.Tensor):
            local = _local(value)
            if local.numel():
                tie = _same_tensor(local)
                if tie in seen and not isinstance(copy, tuple):
                    copy[key] = seen[tie]
                else:
                    seen.setdefault(tie, copy[key])
        elif isinstance(value, (dict, list, tuple)):
            _share_ties(value, copy[key], seen)


def _layout(state, path: str = "") -> tuple:
    """Names, kinds, shapes and dtypes of a nested state dict's leaves: when they differ, the host copy is made again."""
    import torch
    from torch.distributed.tensor import DTensor

    if isinstance(state, DTensor):
        local = state.to_local()
        return ((path, "dtensor", tuple(state.shape), tuple(local.shape), local.dtype, str(state.placements)),)
    if isinstance(state, torch.Tensor):
        return ((path, "tensor", tuple(state.shape), state.dtype),)
    if isinstance(state, dict):
        return tuple(x for k, v in state.items() for x in _layout(v, f"{path}.{k}"))
    if isinstance(state, (list, tuple)):
        return tuple(x for i, v in enumerate(state) for x in _layout(v, f"{path}[{i}]"))
    return ((path, type(state).__name__),)


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
        self.other_writer = None  # a save whose storage writer was not DCP's FileSystemWriter: left as it was
        self._lock = threading.Lock()  # background saves write from DCP's threads

    def add(self, page_cache_why: str | None) -> None:
        with self._lock:
            if page_cache_why is None:
                self.direct += 1
            else:
                self.page_cache += 1
                self.why = self.why or page_cache_why

    def report(self) -> dict:
        return {"direct": self.direct, "page_cache": self.page_cache, **({"page_cache_why": self.why} if self.why else {}),
                **({"other_writer": self.other_writer} if self.other_writer else {})}


class _DirectShardFiles(FileSystem):
    """DCP's FileSystem, its shard files (.distcp) written by DirectFile; every other file as before.

    The torch.save records of a shard file are written without the zip CRC-32 (``set_crc32_options(False)`` while
    the file is open, in the thread that writes it): torch.load and DCP never check it (a flipped byte loads
    silently either way; tests/test_direct_writes.py), and computing it was half the CPU a direct-written save
    takes (bench/direct_writes.py: 0.75 -> 0.33 s for 1.6 GB), CPU a background save takes from training. Our
    reader (fsdp_recipes.ckpt.dcp.stored_member) reads such records as torch does. The setting is per thread in
    torch 2.13 (a ContextVar; tested); where a torch keeps it process-wide, other torch.save calls meanwhile skip
    it too, and two shard files closed in crossed order by two writer threads can leave it off for the process:
    either loses nothing any torch reader checks."""

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
        except BaseException:
            stream.abort()  # not written whole: no tail, no fsync; the save fails and the checkpoint stays incomplete
            raise
        finally:
            torch.serialization.set_crc32_options(crc)
        stream.close()
        self.files.add(stream.page_cache_why)


def _writing_direct(storage_writer, files: ShardFiles):
    if type(getattr(storage_writer, "fs", None)) is FileSystem:  # DCP's FileSystemWriter, as accelerate makes it
        storage_writer.fs = _DirectShardFiles(storage_writer.sync_files, files)
    else:
        files.other_writer = f"{type(storage_writer).__name__} without DCP's FileSystem: its files written as it writes them"
    return storage_writer


@contextmanager
def checkpoint_saves(files: ShardFiles, *, direct: bool, background: Background | None = None):
    """accelerate's DCP saves inside: shard files written past the page cache (``direct``), in the background (given
    ``background``)."""
    save = dcp.save

    def wrapped(state_dict, *, checkpoint_id=None, storage_writer=None, planner=None, process_group=None, no_dist=False, **kwargs):
        if direct:
            storage_writer = _writing_direct(storage_writer, files)
        if background is None:
            return save(state_dict, checkpoint_id=checkpoint_id, storage_writer=storage_writer, planner=planner,
                        process_group=process_group, no_dist=no_dist, **kwargs)
        i = len(background.futures)
        stager = background.stagers(i)
        background.futures.append(dcp.async_save(state_dict, checkpoint_id=checkpoint_id, storage_writer=storage_writer, planner=planner,
                                                 process_group=background.groups(i), async_stager=stager, no_dist=no_dist))
        background.in_place.append(stager.last_in_place)
        background.staged_bytes.append(0 if stager.last_in_place else local_bytes(state_dict))
        return None  # accelerate does not read save's result (the metadata); the future holds it

    dcp.save = wrapped
    try:
        yield
    finally:
        dcp.save = save


def local_bytes(state, seen: set | None = None) -> int:
    """Bytes of the tensors in a (nested) state dict that live on this rank: a DTensor counts its local shard, a tensor
    held under several names (tied embeddings) once."""
    seen = set() if seen is None else seen
    if isinstance(state, torch.Tensor):
        local = _local(state)
        tie = _same_tensor(local)
        if local.numel() and tie in seen:
            return 0
        seen.add(tie)
        return local.numel() * local.element_size()
    if isinstance(state, dict):
        return sum(local_bytes(v, seen) for v in state.values())
    if isinstance(state, (list, tuple)):
        return sum(local_bytes(v, seen) for v in state)
    return 0
