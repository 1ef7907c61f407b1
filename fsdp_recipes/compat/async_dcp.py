"""The one patch behind asynchronous checkpoints: accelerate's sharded saves through DCP's ``async_save``.

accelerate 1.15 writes SHARDED_STATE_DICT checkpoints with ``torch.distributed.checkpoint.save`` (save_fsdp_model,
save_fsdp_optimizer, which the Trainer calls for each checkpoint), reaching it as ``dist_cp.save`` after importing
the module inside the function. Within ``async_dcp_saves(groups, futures)`` that name is DCP's ``async_save``
instead: the state dict is copied to host memory (DCP's staging) before the call returns, so training goes on from
a snapshot of this step, and a thread of its own writes the files. Each save of a checkpoint (the model's, then the
optimizer's) coordinates with the other ranks over a gloo group of its own, ``groups(i)`` for the i-th save: their
threads run at once, and two threads sharing one group interleave its collectives differently on each rank (a
deadlock, seen). Each call's future is appended to ``futures``; the caller waits for them
(fsdp_recipes.train.async_checkpoints). Outside the context nothing changes: the final export's save stays
synchronous.
"""

from __future__ import annotations

from contextlib import contextmanager


@contextmanager
def async_dcp_saves(groups, futures: list, staged_bytes: list):
    """``futures`` gets each save's future, ``staged_bytes`` the bytes of this rank's tensors it copied to host memory."""
    import torch.distributed.checkpoint as dcp

    save = dcp.save

    def staged(state_dict, *, checkpoint_id=None, storage_writer=None, planner=None, process_group=None, no_dist=False, **_):
        futures.append(dcp.async_save(state_dict, checkpoint_id=checkpoint_id, storage_writer=storage_writer, planner=planner,
                                      process_group=groups(len(futures)), no_dist=no_dist))
        staged_bytes.append(local_bytes(state_dict))
        # accelerate does not read save's result (the metadata); the future holds it

    dcp.save = staged
    try:
        yield
    finally:
        dcp.save = save


def local_bytes(state) -> int:
    """Bytes of the tensors in a (nested) state dict that live on this rank: a DTensor counts its local shard."""
    import torch
    from torch.distributed.tensor import DTensor

    if isinstance(state, DTensor):
        return local_bytes(state.to_local())
    if isinstance(state, torch.Tensor):
        return state.numel() * state.element_size()
    if isinstance(state, dict):
        return sum(local_bytes(v) for v in state.values())
    if isinstance(state, (list, tuple)):
        return sum(local_bytes(v) for v in state)
    return 0
