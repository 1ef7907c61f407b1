"""FSDP1 rank-0-only loading keeps the chunk a rank received as its shard (fsdp_recipes.compat.rank0_loading): the
padded chunk rank 0 sends each rank is exactly the shard torch's FlatParamHandle would cut and pad from the whole
flat parameter, for every size and rank count (uneven splits, fewer elements than ranks); a rank other than 0
receives it into a buffer of its own, never writing its flat parameter, and FSDP keeps that very buffer as its
shard (no copy); any other tensor is sharded by torch's own code; a received shard FSDP never took stops the run."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from fsdp_recipes.compat import internals, rank0_loading
from fsdp_recipes.errors import InternalsChanged

GET_SHARD = "torch.distributed.fsdp._flat_param.FlatParamHandle._get_shard"


@pytest.fixture
def torch_get_shard(monkeypatch):
    """torch's own _get_shard, as install_fsdp1 leaves it for the tensors it does not handle (nothing installed)."""
    original = internals.get(GET_SHARD)
    monkeypatch.setattr(rank0_loading, "_get_shard_original", original)
    return original


def scatter_as(monkeypatch, world: int):
    """dist's group size, rank and scatter for one process playing each rank in turn: rank 0 first (it records the
    pieces it sends), then the others (each receives its piece)."""
    sent: list[torch.Tensor] = []
    me = {"rank": 0}

    def scatter(buf, pieces, group=None, group_src=0):
        if pieces is not None:
            sent[:] = [p.clone() for p in pieces]
        buf.copy_(sent[me["rank"]])

    monkeypatch.setattr(rank0_loading.dist, "get_world_size", lambda group=None: world)
    monkeypatch.setattr(rank0_loading.dist, "get_rank", lambda group=None: me["rank"])
    monkeypatch.setattr(rank0_loading.dist, "scatter", scatter)
    return me


@pytest.mark.parametrize(
    "numel, world", [(1, 2), (2, 2), (7, 2), (8, 2), (5, 4), (3, 4), (10, 3), (1, 8), (17, 8), (4096 + 3, 4)]
)
def test_each_rank_keeps_torchs_padded_shard_as_received(monkeypatch, torch_get_shard, numel, world):
    me = scatter_as(monkeypatch, world)
    # no zero: padding is told apart
    full = torch.arange(1, numel + 1, dtype=torch.float32)
    # rank 0 sends, keeps its own
    assert rank0_loading._scatter_chunks(full.clone(), None, keep=True) is None
    for rank in range(1, world):
        me["rank"] = rank
        # stands for the untouched flat parameter
        flat = torch.full((numel,), float("nan"))
        received = rank0_loading._scatter_chunks(flat, None, keep=True)
        assert received is not None and flat.isnan().all(), "the flat parameter was written"
        monkeypatch.setitem(rank0_loading._kept, id(flat), (flat, received))
        shard, padding = rank0_loading._shard_as_received(flat, rank, world)
        expected, expected_padding = torch_get_shard(full, rank, world)
        assert shard is received, "FSDP's shard is a copy of the chunk received"
        assert torch.equal(shard, expected) and padding == expected_padding, (rank, shard, expected)
        assert id(flat) not in rank0_loading._kept
        # taken once: the same tensor sharded again (torch's optimizer-state path) gets torch's own copy
        assert rank0_loading._shard_as_received(full, rank, world)[0] is not received


def test_a_tensor_rank_0_did_not_send_is_sharded_by_torch(torch_get_shard):
    full = torch.arange(1.0, 12.0)
    for rank in range(3):
        shard, padding = rank0_loading._shard_as_received(full, rank, 3)
        expected, expected_padding = torch_get_shard(full, rank, 3)
        assert torch.equal(shard, expected) and padding == expected_padding


def test_a_received_shard_of_another_size_than_torchs_stops_in_one_line(monkeypatch, torch_get_shard):
    flat = torch.empty(10)
    monkeypatch.setitem(rank0_loading._kept, id(flat), (flat, torch.zeros(4)))
    with pytest.raises(InternalsChanged, match="into 5 per rank, not the 4 rank 0 sent"):
        rank0_loading._shard_as_received(flat, 1, 2)


def test_a_received_shard_fsdp_never_took_stops_the_run(monkeypatch):
    flat = torch.empty(10)
    monkeypatch.setitem(rank0_loading._kept, id(flat), (flat, torch.zeros(5)))
    with pytest.raises(InternalsChanged, match="sharded without the shard received from rank 0"):
        rank0_loading.check_fsdp1_sent()


def test_fsdp_shards_a_unit_into_the_buffer_received(monkeypatch, torch_get_shard, one_process_group):
    """torch's own FlatParamHandle.shard() through the patched _get_shard: the flat parameter becomes the received
    buffer, and the unit's parameters are views of it."""
    from torch.distributed.fsdp._flat_param import FlatParamHandle, HandleShardingStrategy

    monkeypatch.setattr(FlatParamHandle, "_get_shard", staticmethod(rank0_loading._shard_as_received))
    unit = torch.nn.Sequential(torch.nn.Linear(3, 5), torch.nn.Linear(5, 2))
    params = list(unit.parameters())
    values = torch.cat([p.detach().reshape(-1) for p in params])
    handle = FlatParamHandle(
        params,
        unit,
        torch.device("cpu"),
        HandleShardingStrategy.FULL_SHARD,
        False,
        None,
        None,
        False,
        dist.group.WORLD,
        True,
    )
    flat = handle.flat_param
    # one rank: its shard is the whole flat parameter, alignment padding included
    received = flat.detach().clone()
    monkeypatch.setitem(rank0_loading._kept, id(flat), (flat, received))
    handle.shard()
    assert handle.flat_param is flat and flat.data_ptr() == received.data_ptr(), "FSDP copied the shard received"
    assert torch.equal(torch.cat([p.detach().reshape(-1) for p in unit.parameters()]), values)
    assert rank0_loading._kept == {}
