"""The host copy a background save stages into (fsdp_recipes.compat.async_dcp hands DCP's ``async_save`` one
:class:`ReusedHostCopy` per save of a checkpoint: the model's, the optimizer's).

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

import copy
import threading
import time

import torch

from fsdp_recipes.compat import internals
from fsdp_recipes.errors import InternalsChanged


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
        # buffers made before the first save (HostBuffers), for the first host copy only
        self.ahead = ahead
        # host copies made: 1 for a whole run unless the state dict changed shape
        self.made = 0

    @property
    def should_synchronize_after_execute(self) -> bool:
        # the copy is done when stage returns
        return False

    def stage(self, state_dict):
        self.last_in_place = self.in_place and on_host(state_dict)
        if self.last_in_place:
            # a copy made before (tensors moved since) is not kept for nothing
            self.copy, self.layout = None, None
            return state_dict
        layout = _layout(state_dict)
        if self.copy is None or layout != self.layout:
            # the old buffers go before the new ones are made
            self.copy = None
            ahead, self.ahead = self.ahead, None
            if ahead is not None:
                self.copy = ahead.build(state_dict, layout)
            if self.copy is None:
                self.copy = internals.get("torch.distributed._state_dict_utils._create_cpu_state_dict")(
                    state_dict, pin_memory=torch.cuda.is_available()
                )
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

    def __init__(self, shapes, pin: str | None):
        self.pin, self.free, self.bytes, self.seconds, self.error = pin, {}, 0, None, None
        self.taken, self.made_at_save, self.waited = 0, 0, 0.0
        self._thread = threading.Thread(target=self._make, args=(list(shapes),), name="host-copy-ahead", daemon=True)
        self._thread.start()

    @staticmethod
    def shapes_of(tensors) -> list[tuple]:
        """``(dtype, shape)`` of each tensor's memory on this rank (a DTensor's local shard), empty ones left out."""
        return [(local.dtype, tuple(local.shape)) for local in map(_local, tensors) if local.numel()]

    def _make(self, shapes) -> None:
        began, made = time.monotonic(), []
        # what could be made is used, should memory run out part way
        try:
            # torch's pinned allocator: measured to hold up the training thread's CUDA calls
            for dtype, shape in shapes:
                made.append(torch.empty(shape, dtype=dtype, pin_memory=self.pin == "allocator"))
        except Exception as error:  # noqa: BLE001 (the save makes what is missing, as without this)
            self.error = f"{type(error).__name__}: {error}"
        try:
            if self.pin != "allocator":
                _fault_in(made)
            for buffer in made:
                if self.pin == "register":
                    _register(buffer)
                self.free.setdefault((buffer.dtype, tuple(buffer.shape)), []).append(buffer)
                self.bytes += buffer.numel() * buffer.element_size()
        except Exception as error:  # noqa: BLE001
            self.error = self.error or f"{type(error).__name__}: {error}"
        self.seconds = round(time.monotonic() - began, 3)

    def busy(self) -> bool:
        return self._thread.is_alive()

    def build(self, state_dict, layout: tuple):
        """The first host copy of ``state_dict`` around these buffers; None (torch's helper makes it, and the report
        says why) for a state dict this way does not build as torch's helper would."""
        why = None if _copyable(state_dict) else "a tensor type other than Tensor and DTensor"
        try:
            made = _host_copy(state_dict, self, {}) if why is None else None
        # a torch where DTensor's empty_like or memory moved
        except (RuntimeError, TypeError, ValueError, InternalsChanged) as error:
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
        return {
            "bytes": self.bytes,
            "seconds": self.seconds,
            "pinned": self.pin,
            "tensors_taken": self.taken,
            "tensors_made_at_save": self.made_at_save,
            "bytes_not_taken": left,
            "save_waited_seconds": round(self.waited, 3),
            **({"error": self.error} if self.error else {}),
        }


# the launcher gives each rank one OpenMP thread (OMP_NUM_THREADS=1), so zero_() alone faults in 1.3 GB/s
FAULT_THREADS = 4


def _fault_in(buffers, chunk_bytes: int = 64 * 2**20) -> None:
    """Touch every page of ``buffers`` (zero them) on up to FAULT_THREADS threads, so the first save's copy does not
    fault them in and page-locking finds them resident."""
    import os

    chunks = iter([c for b in buffers for c in b.view(-1).split(max(1, chunk_bytes // b.element_size()))])
    lock = threading.Lock()

    def work():
        while True:
            with lock:
                chunk = next(chunks, None)
            if chunk is None:
                return
            # without the GIL
            chunk.zero_()

    helpers = [
        threading.Thread(target=work, name="host-copy-ahead", daemon=True)
        for _ in range(min(FAULT_THREADS, os.cpu_count() or 1) - 1)
    ]
    for t in helpers:
        t.start()
    work()
    for t in helpers:
        t.join()


def _register(buffer) -> None:
    """Page-lock memory already faulted in (torch's own way for shared pinned memory, _state_dict_utils), unlocked when
    the tensor goes."""
    import weakref

    cudart = torch.cuda.cudart()
    code = cudart.cudaHostRegister(buffer.data_ptr(), buffer.numel() * buffer.element_size(), 0)
    if code != cudart.cudaError.success:
        raise RuntimeError(f"cudaHostRegister failed: {code}")
    weakref.finalize(buffer, cudart.cudaHostUnregister, buffer.data_ptr())


def _copyable(state) -> bool:
    """Only dicts, lists, tuples, plain tensors, DTensors and plain values (what FSDP2's state dicts hold): anything
    else
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
        # the DTensor's mesh and placements; its memory is replaced next
        wrapper = torch.empty_like(state, device="cpu")
        internals.set_attr(
            wrapper, "torch.distributed.tensor.DTensor._local_tensor", _host_tensor(state.to_local(), ahead, seen)
        )
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
        seen[tie] = (
            taken if taken is not None else torch.empty(local.shape, dtype=local.dtype, pin_memory=bool(ahead.pin))
        )
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
    """Names, kinds, shapes and dtypes of a nested state dict's leaves: when they differ, the host copy is made
    again."""
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
