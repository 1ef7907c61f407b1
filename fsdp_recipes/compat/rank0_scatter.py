"""Rank-0-only loading without a full copy on the other ranks (fsdp_cpu_ram_efficient_loading, FSDP2).

accelerate's ``fsdp2_load_full_state_dict`` broadcasts every parameter whole from rank 0: each other rank
allocates the full parameter, receives it, then keeps its shard. For a model whose embedding and LM head are a
quarter of its bytes each, that transient makes a non-zero rank peak at ~0.8x the model (bench/load_memory.py).
Here rank 0 scatters each dim-0-sharded parameter instead: every rank receives only its own rows. Parameters
placed any other way (2-D meshes, replicated) keep accelerate's broadcast, which is correct, only bigger.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from fsdp_recipes.compat import internals

TARGET = "accelerate.utils.fsdp_utils.fsdp2_load_full_state_dict"


def _scatter_shard(full: torch.Tensor | None, meta_param, world: int, rank: int) -> torch.Tensor:
    """This rank's dim-0 chunk (torch.chunk's split, as Shard(0) makes it) of rank 0's ``full``."""
    rows, rest = meta_param.shape[0], tuple(meta_param.shape[1:])
    per = -(-rows // world)
    local_rows = max(0, min(per, rows - rank * per))
    buf = torch.empty((per, *rest), dtype=meta_param.dtype, device=meta_param.device_mesh.device_type)
    chunks = None
    if rank == 0:
        full = full.detach().to(device=buf.device, dtype=buf.dtype)
        chunks = []
        for r in range(world):
            start, n = min(r * per, rows), max(0, min(per, rows - r * per))
            piece = full.narrow(0, start, n)
            if n < per:  # gloo scatter wants equal sizes: pad the short last chunks
                piece = torch.cat([piece, piece.new_zeros((per - n, *rest))])
            chunks.append(piece.contiguous())
    dist.scatter(buf, chunks, src=0)
    return buf if local_rows == per else buf.narrow(0, 0, local_rows).clone()


def load_full_state_dict(accelerator, model: torch.nn.Module, full_sd: dict, cpu_offload: bool = False):
    from torch.distributed.tensor import DTensor, Shard

    meta_sd = model.state_dict()
    scatterable = all(
        isinstance(p, DTensor) and p.device_mesh.ndim == 1 and list(p.placements) == [Shard(0)]
        and p.device_mesh.size() == dist.get_world_size() for p in meta_sd.values()
    )
    if not scatterable:
        return _original(accelerator, model, full_sd, cpu_offload)
    world, rank = dist.get_world_size(), dist.get_rank()
    sharded = {}
    for name, meta_param in meta_sd.items():
        if rank == 0 and name not in full_sd:
            raise KeyError(f"{name!r} is in the sharded model but not in rank 0's full state dict")
        local = _scatter_shard(full_sd[name] if rank == 0 else None, meta_param, world, rank)
        if cpu_offload:
            local = local.to("cpu")
        sharded[name] = DTensor.from_local(local, meta_param.device_mesh, meta_param.placements, run_check=False,
                                           shape=meta_param.shape, stride=meta_param.stride())
    model.load_state_dict(sharded, assign=True)
    return model


_original = None  # accelerate's own function, once installed


def install() -> None:
    """Swap accelerate's broadcast for the scatter (every rank must, before prepare). Idempotent."""
    global _original
    if _original is None:
        _original = internals.patch(TARGET, load_full_state_dict)
