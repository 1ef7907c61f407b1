"""Rank-0-only loading without a full copy on the other ranks (fsdp_cpu_ram_efficient_loading).

transformers 5.23 does not load a non-zero rank's model on the meta device: it maps the safetensors file there too
(no RAM until a page is touched), and a dtype other than the file's (float32, our default, from a bf16 hub model)
converts the whole model in every rank's private memory. So a rank other than 0 builds its model on the meta
device (``device_map="meta"``: transformers' own dtypes and ties, nothing read), its weights then uninitialised
memory no page of which is touched (:func:`hollow_weights`), and receives rank 0's buffers.
What the FSDP wrappers then do decides what each rank holds:

FSDP2: accelerate moves the model to meta itself, then its ``fsdp2_load_full_state_dict`` broadcasts every
parameter whole from rank 0: each other rank allocates the full parameter, receives it, then keeps its shard. For a
model whose embedding and LM head are a quarter of its bytes each, that transient makes a non-zero rank peak at
~0.8x the model (bench/load_memory.py). Here rank 0 scatters each dim-0-sharded parameter instead: every rank
receives only its own rows, and rank 0 lets go of each full parameter once scattered. Parameters placed any other
way (2-D meshes, replicated) keep accelerate's broadcast, which is correct, only bigger.

FSDP1 (``sync_module_states``): torch broadcasts each unit's parameters from rank 0 INTO the tensors every rank
holds, then flattens the unit into one flat parameter (a copy of the whole unit) and keeps this rank's shard of it:
a rank held its shards plus twice its largest unit (1.48x a 1 GB model on 2 ranks, whose root unit is half of it).
On CPU (:func:`install_fsdp1`) the parameters are sent once flattened instead: the sync sends only buffers, and each
unit's flat parameter is, on ranks other than 0, an untouched buffer, and rank 0 (whose flat parameter is the real
one) scatters each rank its own chunk, padded as FSDP pads its shard. A rank other than 0 receives that chunk into a
buffer of its own, which FSDP keeps as its shard (``FlatParamHandle._get_shard`` patched: torch clones the chunk out
of the flat parameter, a second copy of it for a moment). The other ranks' stand-ins and flat parameters are never
written, and a rank other than 0 holds its shards and nothing more: 0.50x a 1 GB model on 2 ranks, whose root unit
is half of it (bench/load_memory.py). Where FSDP keeps the whole flat parameter (NO_SHARD) the flat parameter is
broadcast whole, as torch would broadcast its pieces; where it broadcasts over two groups (HYBRID_SHARD: across
nodes, then within), whole across, then scattered within into the flat parameter, and cloned into the shard. Were
the stand-ins views of the private file mapping, every written page would become the rank's own (copy on write):
every rank, rank 0 included, peaked at 2x the model (bench/load_memory.py).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from fsdp_recipes.compat import internals
from fsdp_recipes.errors import InternalsChanged

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
            # gloo scatter wants equal sizes: pad the short last chunks
            if n < per:
                piece = torch.cat([piece, piece.new_zeros((per - n, *rest))])
            chunks.append(piece.contiguous())
    dist.scatter(buf, chunks, src=0)
    return buf if local_rows == per else buf.narrow(0, 0, local_rows).clone()


def load_full_state_dict(accelerator, model: torch.nn.Module, full_sd: dict, cpu_offload: bool = False):
    from torch.distributed.tensor import DTensor, Shard

    meta_sd = model.state_dict()
    scatterable = all(
        isinstance(p, DTensor)
        and p.device_mesh.ndim == 1
        and list(p.placements) == [Shard(0)]
        and p.device_mesh.size() == dist.get_world_size()
        for p in meta_sd.values()
    )
    if not scatterable:
        return _original(accelerator, model, full_sd, cpu_offload)
    world, rank = dist.get_world_size(), dist.get_rank()
    if rank == 0 and (missing := next((name for name in meta_sd if name not in full_sd), None)):
        raise KeyError(f"{missing!r} is in the sharded model but not in rank 0's full state dict")
    # a weight shared by modules (tied embeddings) is one parameter under several names: scattered once (twice, a
    # non-zero rank held two shards of it until accelerate re-tied them: 0.76x the fp32 model instead of 0.5x)
    first: dict[int, str] = {}
    alias = {name: first.setdefault(id(p), name) for name, p in model.named_parameters(remove_duplicate=False)}
    sharded = {}
    for name, meta_param in meta_sd.items():
        if alias.get(name, name) in sharded:
            sharded[name] = sharded[alias[name]]
            if rank == 0:
                del full_sd[name]
            continue
        # popped: accelerate's dict holds the only reference to rank 0's full weights once the model went to meta,
        # so each is freed as soon as it is scattered (a bf16 file loaded as fp32 is a private full copy: rank 0
        # held it and every shard at once, 1.5x the fp32 model on 2 ranks)
        local = _scatter_shard(full_sd.pop(name) if rank == 0 else None, meta_param, world, rank)
        if cpu_offload:
            local = local.to("cpu")
        sharded[name] = DTensor.from_local(
            local,
            meta_param.device_mesh,
            meta_param.placements,
            run_check=False,
            shape=meta_param.shape,
            stride=meta_param.stride(),
        )
    model.load_state_dict(sharded, assign=True)
    return model


# accelerate's own function, once installed
_original = None


def install() -> None:
    """FSDP2: swap accelerate's broadcast for the scatter (every rank must, before prepare). Idempotent."""
    global _original
    if _original is None:
        _original = internals.patch(TARGET, load_full_state_dict)


def hollow_weights(model: torch.nn.Module) -> torch.nn.Module:
    """A rank other than 0, its model built on the meta device: every parameter becomes an uninitialised CPU tensor
    of its shape, dtype and requires_grad (pages the kernel gives only when written: no RAM until then), a tensor
    shared by modules (tied embeddings) one shared tensor. Not meta: accelerate's FSDP2 prepare tells parameters
    apart by data_ptr(), which is 0 for every meta tensor (the optimizer then steps one parameter of all)."""
    # id -> (the original, alive till the end; its stand-in)
    hollow: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
    for module in model.modules():
        for name, param in list(module.named_parameters(recurse=False)):
            if id(param) not in hollow:
                stand_in = torch.nn.Parameter(
                    torch.empty(param.shape, dtype=param.dtype, device="cpu"), requires_grad=param.requires_grad
                )
                hollow[id(param)] = (param, stand_in)
            setattr(module, name, hollow[id(param)][1])
    return model


def receive_buffers(model: torch.nn.Module) -> torch.nn.Module:
    """Every rank (a collective): the buffers of rank 0's model, such as rotary frequencies, replace this rank's.
    A rank other than 0 built its model on the meta device (``from_pretrained(device_map="meta")``: its dtypes and
    ties are transformers' own, and nothing is read), where buffers computed at construction are meta too; FSDP1's
    sync and accelerate's FSDP2 path both keep the buffers a rank has. A buffer shared by modules stays shared."""
    rank = dist.get_rank()
    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")
    # id -> (this rank's, alive till the end; rank 0's)
    received: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
    for module in model.modules():
        for name, buffer in list(module.named_buffers(recurse=False)):
            if id(buffer) not in received:
                wire = (
                    buffer.detach().to(device).contiguous()
                    if rank == 0
                    else torch.empty(buffer.shape, dtype=buffer.dtype, device=device)
                )
                dist.broadcast(wire, src=0)
                received[id(buffer)] = (buffer, buffer if rank == 0 else wire.to("cpu"))
            # an existing buffer's name: stays a buffer, persistence kept
            setattr(module, name, received[id(buffer)][1])
    return model


def _broadcast_each(process_group, module_states: list, broadcast_bucket_size: int, src: int) -> None:
    """torch's _sync_params_and_buffers, one tensor at a time (the bucket size is moot): its coalesced broadcast
    copies the bucket back on every rank, the sender too."""
    for tensor in module_states:
        if tensor.is_contiguous():
            dist.broadcast(tensor, group=process_group, group_src=src)
        else:
            staged = tensor.contiguous()
            dist.broadcast(staged, group=process_group, group_src=src)
            if dist.get_rank(process_group) != src:
                tensor.copy_(staged)


# id(unit's module) -> the process groups its parameters are owed over, in the order torch would broadcast them
_owed: dict[int, list] = {}


def _sync_buffers(module, params: list, process_group) -> None:
    """torch's _sync_module_params_and_buffers for the unit's buffers; its parameters are sent once flattened."""
    _sync_module_original(module, [], process_group)
    if params:
        _owed.setdefault(id(module), []).append(process_group)


def _flat_param_from_rank0(self, tensors: list, aligned_numel: int, requires_grad: bool):
    """FlatParamHandle.flatten_tensors_into_flat_param: rank 0's flat parameter is its own; another rank's an
    untouched buffer that receives from rank 0 what FSDP keeps of it (see the module docstring)."""
    groups = _owed.pop(
        id(internals.attr(self, "torch.distributed.fsdp._flat_param.FlatParamHandle._fully_sharded_module")), None
    )
    if groups is None or dist.get_rank() == 0:
        flat = _flatten_original(self, tensors, aligned_numel, requires_grad)
        # a unit whose parameters the sync did not leave to us
        if groups is None:
            return flat
    else:
        # the tensors as torch would flatten them, padding included
        numel = sum(t.numel() for t in tensors)
        flat = internals.get("torch.distributed.fsdp._flat_param.FlatParameter")(
            torch.empty(numel, dtype=tensors[0].dtype, device=tensors[0].device), requires_grad=requires_grad
        )
    *across, last = groups
    for group in across:
        dist.broadcast(flat.data, group=group, group_src=0)
    if last is self.process_group and self.uses_sharded_strategy:
        # one group (not HYBRID_SHARD's two): a rank other than 0 receives its chunk into the shard FSDP keeps
        if (shard := _scatter_chunks(flat.data, last, keep=not across)) is not None:
            _kept[id(flat)] = (flat, shard)
    else:
        dist.broadcast(flat.data, group=last, group_src=0)
    return flat


def _scatter_chunks(flat: torch.Tensor, group, keep: bool = False) -> torch.Tensor | None:
    """Group rank 0's ``flat`` into every rank's own chunk of it, as torch.chunk splits it (FSDP1's shard), padded
    with zeros to the first chunk's size as FSDP pads its shard. With ``keep``, a rank other than group rank 0
    receives into a buffer of its own and returns it (FSDP's shard: :func:`_shard_as_received`), ``flat`` untouched;
    otherwise the chunk is written into ``flat`` and None returned."""
    world, rank, numel = dist.get_world_size(group), dist.get_rank(group), flat.numel()
    per = -(-numel // world)

    def chunk(r: int) -> torch.Tensor:
        return flat.narrow(0, min(r * per, numel), max(0, min(per, numel - r * per)))

    mine = chunk(rank)
    kept = keep and rank != 0
    # gloo scatters equal sizes
    buf = mine if mine.numel() == per and not kept else flat.new_empty(per)
    pieces = None
    if rank == 0:
        pieces = [
            c if c.numel() == per else torch.cat([c, c.new_zeros(per - c.numel())]) for c in map(chunk, range(world))
        ]
    dist.scatter(buf, pieces, group=group, group_src=0)
    if kept:
        return buf
    if buf is not mine:
        mine.copy_(buf[: mine.numel()])
    return None


# id(flat parameter) -> (it, the padded shard this rank received for it), until FSDP shards it
_kept: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}


def _shard_as_received(tensor: torch.Tensor, rank: int, world_size: int) -> tuple[torch.Tensor, int]:
    """FlatParamHandle._get_shard (this rank's padded shard of ``tensor``, and its padding): for a flat parameter
    whose chunk this rank received on its own (:func:`_scatter_chunks`), that buffer itself; torch clones the
    chunk out of the flat parameter, which here was never written. Any other tensor: torch's own."""
    flat, shard = _kept.get(id(tensor), (None, None))
    if flat is not tensor:
        return _get_shard_original(tensor, rank, world_size)
    del _kept[id(tensor)]
    chunk, numel_to_pad = internals.get("torch.distributed.fsdp._flat_param.FlatParamHandle._get_unpadded_shard")(
        tensor, rank, world_size
    )
    if chunk.numel() + numel_to_pad != shard.numel():
        raise InternalsChanged(
            f"torch {torch.__version__} shards an FSDP1 flat parameter of {tensor.numel()} elements into "
            f"{chunk.numel() + numel_to_pad} per rank, not the {shard.numel()} rank 0 sent: "
            "set fsdp_cpu_ram_efficient_loading: false in your copy of the config"
        )
    return shard, numel_to_pad


def check_fsdp1_sent() -> None:
    """After wrapping: every unit whose parameters the sync left to its flat parameter got them. Raises
    InternalsChanged where torch wrapped a unit without flattening it through the method patched here: that unit
    would keep the other ranks' uninitialised stand-ins, as would a unit sharded without the chunk it received."""
    if _owed:
        raise InternalsChanged(
            f"{len(_owed)} FSDP1 unit(s) were wrapped without their flat parameter being filled from rank 0 "
            f"(torch {torch.__version__} no longer flattens through FlatParamHandle.flatten_tensors_into_flat_param): "
            "set fsdp_cpu_ram_efficient_loading: false in your copy of the config"
        )
    if _kept:
        raise InternalsChanged(
            f"{len(_kept)} FSDP1 unit(s) were sharded without the shard received from rank 0 (torch "
            f"{torch.__version__} no longer shards through FlatParamHandle._get_shard): "
            "set fsdp_cpu_ram_efficient_loading: false in your copy of the config"
        )


_sync_original = _sync_module_original = _flatten_original = _get_shard_original = None


def install_fsdp1() -> None:
    """FSDP1 on CPU: buffers broadcast tensor by tensor, parameters scattered once flattened, each rank's chunk
    kept as its shard (see the module docstring). Idempotent."""
    global _sync_original, _sync_module_original, _flatten_original, _get_shard_original
    if _sync_original is None:
        _sync_original = internals.patch("torch.distributed.fsdp._init_utils._sync_params_and_buffers", _broadcast_each)
        _sync_module_original = internals.patch(
            "torch.distributed.fsdp._init_utils._sync_module_params_and_buffers", _sync_buffers
        )
        _flatten_original = internals.patch(
            "torch.distributed.fsdp._flat_param.FlatParamHandle.flatten_tensors_into_flat_param", _flat_param_from_rank0
        )
        _get_shard_original = internals.patch(
            "torch.distributed.fsdp._flat_param.FlatParamHandle._get_shard", staticmethod(_shard_as_received)
        )
