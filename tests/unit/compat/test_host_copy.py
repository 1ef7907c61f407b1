"""The host copy background saves stage into (fsdp_recipes.compat.host_copy.ReusedHostCopy): a snapshot that later
training steps cannot change, made once and reused by every later save (bounded memory, no growth over many
saves), made again when the state dict changes shape. Plain tensors and a DTensor on a one-process gloo mesh."""

from __future__ import annotations

import contextlib
from pathlib import Path

import pytest
import torch

from fsdp_recipes.compat.host_copy import ReusedHostCopy


def pointers(state) -> list[int]:
    from torch.distributed.tensor import DTensor

    out = []
    for v in state.values():
        if isinstance(v, dict):
            out += pointers(v)
        elif isinstance(v, DTensor):
            out.append(v.to_local().data_ptr())
        elif isinstance(v, torch.Tensor):
            out.append(v.data_ptr())
    return out


def test_a_snapshot_reused_by_every_save_and_made_again_on_a_new_shape():
    live = {"w": torch.randn(64, 8), "optim": {"exp_avg": torch.randn(64, 8), "step": torch.tensor(3.0)}}
    stager = ReusedHostCopy()
    first = stager.stage(live)
    expected = {"w": live["w"].clone(), "exp_avg": live["optim"]["exp_avg"].clone()}
    # training goes on after the save started
    live["w"].add_(1.0)
    live["optim"]["exp_avg"].mul_(2.0)
    assert torch.equal(first["w"], expected["w"]) and torch.equal(first["optim"]["exp_avg"], expected["exp_avg"])
    assert set(pointers(first)).isdisjoint(pointers(live))

    # the later saves copy into the same buffers
    for _step in range(25):
        live["w"].add_(1.0)
        again = stager.stage(live)
        assert pointers(again) == pointers(first)
        assert torch.equal(again["w"], live["w"]) and torch.equal(again["optim"]["exp_avg"], live["optim"]["exp_avg"])
    assert stager.made == 1

    # another shape: a new host copy, not a failed copy into the old one
    live["w"] = torch.randn(32, 8)
    third = stager.stage(live)
    assert stager.made == 2 and third["w"].shape == (32, 8) and torch.equal(third["w"], live["w"])


def test_a_dtensor_shard_is_copied_into_the_same_host_buffer(one_process_group):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (1,))
    live = {"model": {"w": distribute_tensor(torch.randn(16, 4), mesh, [Shard(0)])}}
    stager = ReusedHostCopy()
    first = stager.stage(live)
    assert isinstance(first["model"]["w"], DTensor) and first["model"]["w"].placements == (Shard(0),)
    before = live["model"]["w"].to_local().clone()
    live["model"]["w"].to_local().add_(1.0)
    assert torch.equal(first["model"]["w"].to_local(), before)
    second = stager.stage(live)
    assert pointers(second) == pointers(first) and stager.made == 1
    assert torch.equal(second["model"]["w"].to_local(), live["model"]["w"].to_local())


def test_a_tied_weight_gets_one_host_buffer_and_is_counted_once():
    from fsdp_recipes.compat.host_copy import local_bytes

    embedding = torch.randn(10, 4)
    live = {"model": {"embed_tokens.weight": embedding, "lm_head.weight": embedding, "norm.weight": torch.ones(4)}}
    stager = ReusedHostCopy()
    staged = stager.stage(live)
    # one buffer for both names
    assert staged["model"]["embed_tokens.weight"] is staged["model"]["lm_head.weight"]
    assert torch.equal(staged["model"]["lm_head.weight"], embedding)
    assert staged["model"]["norm.weight"].data_ptr() != staged["model"]["lm_head.weight"].data_ptr()
    assert local_bytes(live) == (10 * 4 + 4) * 4
    embedding.add_(1.0)
    again = stager.stage(live)
    assert torch.equal(again["model"]["embed_tokens.weight"], embedding) and stager.made == 1


def test_in_place_hands_host_tensors_to_the_writer_as_they_are_and_copies_nothing():
    """ReusedHostCopy(in_place=True) (--async_checkpoint_staging auto): tensors already in host memory are written from
    where they are (the caller holds the optimizer step meanwhile); any tensor elsewhere (here: meta, standing in for a
    GPU) makes the save a host copy as before."""
    from fsdp_recipes.compat.host_copy import on_host

    live = {
        "model": {"w": torch.randn(8, 4)},
        "optim": {"state": {"exp_avg": torch.randn(8, 4), "step": torch.tensor(2.0)}},
    }
    stager = ReusedHostCopy(in_place=True)
    for _ in range(3):
        staged = stager.stage(live)
        assert staged is live and stager.last_in_place and stager.made == 0 and stager.copy is None
    assert on_host(live) and not on_host({"a": [torch.ones(2), torch.empty(2, device="meta")]})
    # no tensor at all: nothing to copy
    assert on_host({"lr": 0.1, "names": ["w"]})

    # --async_checkpoint_staging copy
    copying = ReusedHostCopy()
    staged = copying.stage(live)
    assert not copying.last_in_place and copying.made == 1
    assert set(pointers(staged)).isdisjoint(pointers(live)) and torch.equal(staged["model"]["w"], live["model"]["w"])


def test_an_optimizer_that_moves_weights_outside_its_step_keeps_the_host_copy():
    """Schedule-free optimizers rewrite the weights in train()/eval(), which the Trainer calls around steps and
    evaluation, outside the step the in-place write holds back: such runs stage a host copy."""
    from types import SimpleNamespace

    from fsdp_recipes.train.async_checkpoints import AsyncCheckpoints

    class ScheduleFreeLike(torch.optim.SGD):
        def train(self):
            pass

        def eval(self):
            pass

    params = [torch.nn.Parameter(torch.ones(2))]

    def decision(optim_name, inner, staging="auto"):
        # accelerate's wrapper has train() of its own
        wrapper = SimpleNamespace(optimizer=inner, train=lambda: None)
        trainer = SimpleNamespace(
            args=SimpleNamespace(optim=optim_name), optimizer=wrapper if inner is not None else None
        )
        return AsyncCheckpoints(trainer, True, staging=staging).in_place_allowed()

    assert decision("adamw_torch", torch.optim.AdamW(params))
    # before the optimizer exists (the run's first line)
    assert decision("adamw_torch", None)
    assert not decision("adamw_torch", ScheduleFreeLike(params, lr=0.1))
    assert not decision("schedule_free_adamw", None)
    assert not decision("adamw_torch", torch.optim.AdamW(params), staging="copy")


@pytest.mark.parametrize("fails", [False, True])
def test_background_saves_ask_accelerate_for_the_shards_where_they_live(fails):
    """accelerate's FSDP2 sharded saves ask torch for state dicts with cpu_offload
    (ShardedStateDictConfig(offload_to_cpu=True)):
    on a GPU every save copied each shard into new pageable memory on the training thread, and the copies, host
    tensors, were then written "in place" with the next optimizer step held for the write (seen on an H200: 7.6 s,
    bench/results/h200/gpu-check-1). Inside our background save accelerate's own options say no offload (GPU shards
    go through the one reused pinned copy); afterwards, also after a failed save, its setting is back."""
    from types import SimpleNamespace

    from accelerate.utils import FullyShardedDataParallelPlugin
    from accelerate.utils.fsdp_utils import _prepare_sd_options

    from fsdp_recipes.train.async_checkpoints import AsyncCheckpoints

    plugin = FullyShardedDataParallelPlugin(
        fsdp_version=2, state_dict_type="SHARDED_STATE_DICT", reshard_after_forward=True
    )
    # accelerate's own choice, which the save must not inherit
    assert _prepare_sd_options(plugin).cpu_offload
    trainer = SimpleNamespace(
        accelerator=SimpleNamespace(state=SimpleNamespace(fsdp_plugin=plugin)),
        state=SimpleNamespace(save_to_json=None),
        args=SimpleNamespace(optim="adamw_torch"),
        optimizer=None,
    )
    checkpoints = AsyncCheckpoints(trainer, True)
    with pytest.raises(RuntimeError) if fails else contextlib.nullcontext():
        with checkpoints.saving(Path("checkpoint-1"), 1):
            assert not _prepare_sd_options(plugin).cpu_offload
            if fails:
                raise RuntimeError("the save failed")
    assert _prepare_sd_options(plugin).cpu_offload


def test_the_first_host_copy_is_built_around_buffers_made_ahead_and_matches_torchs_own(one_process_group):
    """The first save's host copy (compat.host_copy.HostBuffers, made after the first optimizer step on a thread of its
    own): every tensor the buffers foresaw is one of them (no allocation at the save), the copy has torch's helper's
    structure (DTensor placements, 0-dim step counters, an empty tensor, plain values, a tied weight once), holds
    the values of the save's step, and later saves reuse it. A shape nobody foresaw is made at the save."""
    from torch.distributed._state_dict_utils import _create_cpu_state_dict
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

    from fsdp_recipes.compat.host_copy import HostBuffers, _layout

    mesh = init_device_mesh("cpu", (1,))
    embedding = distribute_tensor(torch.randn(12, 4), mesh, [Shard(0)])
    norm = distribute_tensor(torch.randn(4), mesh, [Shard(0)])
    live = {
        "model": {"embed.weight": embedding, "lm_head.weight": embedding, "norm.weight": norm},
        "optim": {
            "state": {
                "norm.weight": {
                    "exp_avg": distribute_tensor(torch.randn(4), mesh, [Shard(0)]),
                    "step": torch.tensor(7.0),
                    "scale": distribute_tensor(torch.tensor(2.0), mesh, [Replicate()]),
                }
            },
            "param_groups": [{"lr": 0.1, "params": ["norm.weight"]}],
            "extra": (torch.randn(3, 2), torch.empty(0)),
        },
    }
    ahead = HostBuffers(
        HostBuffers.shapes_of([embedding, norm, live["optim"]["state"]["norm.weight"]["exp_avg"]]), pin=None
    )
    # waits for the thread: what it made can be listed (a miss, counted below)
    ahead.take(torch.int8, (1,))
    foreseen = [b.data_ptr() for found in ahead.free.values() for b in found]
    stager = ReusedHostCopy(ahead=ahead)
    staged = stager.stage(live)
    report = ahead.close()

    assert _layout(staged) == _layout(_create_cpu_state_dict(live)) == _layout(live)
    taken = {
        staged["model"]["embed.weight"].to_local().data_ptr(),
        staged["model"]["norm.weight"].to_local().data_ptr(),
        staged["optim"]["state"]["norm.weight"]["exp_avg"].to_local().data_ptr(),
    }
    # each buffer made ahead is in the copy, and nothing else of those shapes was made
    assert taken == set(foreseen)
    # tied: one buffer
    assert (
        staged["model"]["lm_head.weight"].to_local().data_ptr() == staged["model"]["embed.weight"].to_local().data_ptr()
    )
    # (3, 2) and int8: not foreseen
    assert report == {
        "bytes": (12 * 4 + 4 + 4) * 4,
        "seconds": report["seconds"],
        "pinned": None,
        "tensors_taken": 3,
        "tensors_made_at_save": 2,
        "bytes_not_taken": 0,
        "save_waited_seconds": report["save_waited_seconds"],
    }
    assert isinstance(staged["model"]["norm.weight"], DTensor) and staged["model"]["norm.weight"].placements == (
        Shard(0),
    )
    scale = live["optim"]["state"]["norm.weight"]["scale"]
    # a 0-dim DTensor: handed on as torch's helper does
    assert staged["optim"]["state"]["norm.weight"]["scale"] is scale
    assert set(pointers(staged)) & set(pointers(live)) == {scale.to_local().data_ptr()}
    for name in ("embed.weight", "norm.weight"):
        assert torch.equal(staged["model"][name].to_local(), live["model"][name].to_local())
    assert staged["optim"]["state"]["norm.weight"]["step"].item() == 7.0 and staged["optim"]["param_groups"] == [
        {"lr": 0.1, "params": ["norm.weight"]}
    ]
    assert (
        torch.equal(staged["optim"]["extra"][0], live["optim"]["extra"][0]) and staged["optim"]["extra"][1].numel() == 0
    )

    # the next save: the same buffers, the new values
    embedding.to_local().add_(1.0)
    again = stager.stage(live)
    assert pointers(again) == pointers(staged) and stager.made == 1
    assert torch.equal(again["model"]["lm_head.weight"].to_local(), embedding.to_local())


def test_buffers_that_could_not_be_made_ahead_leave_the_save_to_make_its_copy():
    """No memory for the buffers (here: a shape no tensor can have) is not the run's failure: the save makes what it
    needs as without them, and the report says why none came from ahead."""
    from fsdp_recipes.compat.host_copy import HostBuffers

    live = {"w": torch.randn(5, 3)}
    ahead = HostBuffers([(torch.float32, (5, 3)), (torch.float32, (-1,))], pin=None)
    stager = ReusedHostCopy(ahead=ahead)
    staged = stager.stage(live)
    report = ahead.close()
    assert torch.equal(staged["w"], live["w"]) and staged["w"].data_ptr() != live["w"].data_ptr()
    assert report["tensors_taken"] == 1 and "RuntimeError" in report["error"], report


def test_a_first_copy_that_cannot_be_built_around_the_buffers_is_torchs_and_says_why(monkeypatch):
    """Where building the copy around the buffers fails (a torch whose DTensor moved, here: an injected error), the
    save's copy is torch's helper's, as before the buffers existed, and the report names why."""
    from fsdp_recipes.compat import host_copy

    def moved(*args):
        raise RuntimeError("empty_like is not a DTensor op here")

    monkeypatch.setattr(host_copy, "_host_copy", moved)
    live = {"w": torch.randn(5, 3), "step": torch.tensor(1.0)}
    ahead = host_copy.HostBuffers([(torch.float32, (5, 3))], pin=None)
    stager = ReusedHostCopy(ahead=ahead)
    staged = stager.stage(live)
    report = ahead.close()
    assert torch.equal(staged["w"], live["w"]) and staged["w"].data_ptr() != live["w"].data_ptr() and stager.made == 1
    assert (
        report["tensors_taken"] == 0 and "made by torch's helper instead (RuntimeError: empty_like" in report["error"]
    ), report


@pytest.mark.slow
def test_the_first_save_benchmark_runs_both_kinds_and_checks_their_copies(tmp_path):
    """bench/first_save.py on CPU (tiny): both kinds run in fresh processes, every staged copy equals the live
    tensors (checked in the child), and the buffers made ahead are the whole first copy."""
    import json
    import subprocess
    import sys

    from conftest import REPO

    proc = subprocess.run(
        [
            sys.executable,
            str(REPO / "bench" / "first_save.py"),
            "--gigabytes",
            "0.01",
            "--repeats",
            "1",
            "--output",
            str(tmp_path),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    runs = json.loads((tmp_path / "results.json").read_text())
    assert [r["kind"] for r in runs] == ["at-save", "ahead"]
    ahead = runs[1]["ahead"]
    assert ahead["bytes"] == runs[1]["staged_bytes"] and ahead["tensors_made_at_save"] == 0 and "error" not in ahead, (
        ahead
    )
    assert "First save, made ahead (now): faulted in on 4 threads" in (tmp_path / "README.md").read_text()
