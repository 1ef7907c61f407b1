"""accelerate_configs/ddp.yaml: real DistributedDataParallel on 2 CPU processes, and ZeRO-1 (--zero1 true): each rank
holds half of Adam's state, the weights equal DDP's, checkpoints resume exactly after a SIGKILL and merge."""

from __future__ import annotations

import math
import shutil
from pathlib import Path

import pytest
import torch
from conftest import DDP_CONFIG, QUICK, REPO, launch, logged_losses, read_json
from safetensors.torch import load_file

from fsdp_recipes.ckpt.status import checkpoint_status
from fsdp_recipes.config.launcher import LaunchSettings
from fsdp_recipes.config.memory import Setup, estimate, model_shape

ZERO1 = ("--zero1", "true")


def test_ddp_is_real_ddp_and_trains(trained):
    run = trained(DDP_CONFIG)
    report = run.report
    assert report["distributed_type"] == "MULTI_CPU" and report["fsdp_version"] is None  # gloo DDP, not N lone runs
    assert report["world_size"] == len(report["ranks"]) == 2 and report["sharding_strategy"] is None
    total = report["total_param_elements"]
    for rank in report["ranks"]:
        assert rank["wrapper"] == "DistributedDataParallel" and rank["local_param_elements"] == total
        assert rank["bytes"] == {"params": 4 * total, "grads": 4 * total, "optimizer": 8 * total}
    losses = logged_losses(run.output_dir)
    assert all(math.isfinite(x) for x in losses) and losses[-1] < 0.85 * losses[0], losses
    assert (
        read_json(run.model_dir / "config.json")["use_cache"]
        is read_json(run.output_dir / "checkpoint-12" / "config.json")["use_cache"]
        is True
    )


def test_zero1_holds_half_the_optimizer_state_per_rank(trained):
    ddp, zero1 = trained(DDP_CONFIG).report, trained(DDP_CONFIG, *ZERO1).report
    assert zero1["sharding_strategy"] == "ZERO1"
    total = zero1["total_param_elements"]
    states = [rank["bytes"]["optimizer"] for rank in zero1["ranks"]]
    assert sum(states) == 8 * total == ddp["ranks"][0]["bytes"]["optimizer"]  # all of Adam's m and v, once
    for rank in zero1["ranks"]:
        assert rank["wrapper"] == "DistributedDataParallel" and rank["local_param_elements"] == total  # replicated
        assert rank["bytes"]["params"] == rank["bytes"]["grads"] == 4 * total
        assert rank["bytes"]["optimizer"] == pytest.approx(4 * total, rel=0.05)  # 1/2, as ZeRO partitions whole tensors
        est = estimate(model_shape(str(REPO / "assets" / "tiny-llama")), Setup(strategy="ZERO1", nproc_per_node=2))
        assert rank["bytes"]["optimizer"] == pytest.approx(est.optimizer, rel=0.05)  # tools/estimate_memory.py


def test_zero1_trains_the_same_weights_as_ddp(trained):
    """Same gradients (DDP's all-reduce), the same AdamW update, each parameter updated by one rank and broadcast."""
    ddp, zero1 = (load_file(trained(DDP_CONFIG, *args).model_dir / "model.safetensors") for args in ((), ZERO1))
    assert set(ddp) == set(zero1)
    for name in ddp:
        torch.testing.assert_close(zero1[name], ddp[name], rtol=0, atol=1e-6, msg=name)


def test_zero1_checkpoint_is_whole_and_merges(trained, tmp_path):
    from transformers import AutoModelForCausalLM

    from fsdp_recipes.ckpt.merge import merge_checkpoint

    out = trained(DDP_CONFIG, *ZERO1).output_dir
    status = checkpoint_status(out / "checkpoint-12")
    assert status.resumable and status.state_dict_type == "PLAIN" and status.sharding_strategy == "ZERO1"
    optimizer = torch.load(out / "checkpoint-12" / "optimizer.pt", weights_only=True)
    params = len(list(AutoModelForCausalLM.from_pretrained(out / "model").parameters()))
    assert not (
        out / "model" / "training_args.bin"
    ).exists()  # the Trainer's save_model writes it; the model folder ships without
    assert sorted(optimizer["state"]) == list(range(params))  # every parameter's moments, gathered from both ranks
    merge_checkpoint(out / "checkpoint-12", tmp_path / "merged", log=lambda _: None)
    merged, final = load_file(tmp_path / "merged" / "model.safetensors"), load_file(out / "model" / "model.safetensors")
    assert all(torch.equal(merged[k], final[k]) for k in final)


@pytest.mark.slow
def test_zero1_resumed_run_ends_on_the_uninterrupted_weights(trained, tmp_path):
    """From checkpoint-6, as a run stopped after step 6 leaves it (how a SIGKILL'd run gets back to its last
    checkpoint is test_fault_tolerance's): the consolidated optimizer state goes back to its shards exactly."""
    reference = trained(DDP_CONFIG, *ZERO1).output_dir
    out = tmp_path / "run"
    shutil.copytree(reference / "checkpoint-6", out / "checkpoint-6")
    resumed = launch(DDP_CONFIG, *QUICK, *ZERO1, "--output_dir", str(out), "--resume_from_checkpoint", "true")
    assert f"resuming from {out / 'checkpoint-6'}" in resumed.stdout
    assert read_json(out / "trainer_state.json")["global_step"] == 12
    final, expected = (
        load_file(out / "model" / "model.safetensors"),
        load_file(reference / "model" / "model.safetensors"),
    )
    assert all(torch.equal(final[k], expected[k]) for k in expected)
    saved, again = (
        torch.load(d / "checkpoint-12" / "optimizer.pt", weights_only=True)["state"] for d in (reference, out)
    )
    for index, moments in saved.items():  # Adam's moments came back on both ranks: they end equal too
        assert all(torch.equal(again[index][k], v) for k, v in moments.items()), index


def test_a_ddp_checkpoint_is_not_resumed_under_fsdp(trained):
    from fsdp_recipes.ckpt.resume import _resumable
    from fsdp_recipes.errors import RecipeError

    status = checkpoint_status(trained(DDP_CONFIG).output_dir / "checkpoint-6")
    with pytest.raises(RecipeError, match=r"was saved without FSDP \(DDP or ZeRO-1\): resume it with the same launch"):
        _resumable(status, trainer_fsdp=True)  # what the resume decision (rank 0, preflight) does under an FSDP launch
    assert _resumable(status, trainer_fsdp=False) == status.path


def test_only_a_named_ddp_config_is_a_ddp_launch(tmp_path):
    """accelerate's default config says MULTI_GPU on any multi-GPU machine (`accelerate config default`): using it is
    not asking for DDP. A file named with --config_file, or --multi_gpu, is."""
    ddp = {"distributed_type": "MULTI_GPU", "num_processes": 2}
    assert LaunchSettings(ddp, Path("ddp.yaml"), named=True).ddp
    assert not LaunchSettings(ddp, Path("default_config.yaml"), named=False).ddp
    assert LaunchSettings(
        {"num_processes": 2, "distributed_type": "MULTI_GPU"}, None, origin={"distributed_type": "--multi_gpu"}
    ).ddp
    assert not LaunchSettings({**ddp, "fsdp_config": {"fsdp_version": 2}}, Path("x.yaml"), named=True).ddp


def test_zero1_is_refused_where_it_cannot_work(tmp_path):
    from fsdp_recipes.config.accelerate_config import check_config
    from fsdp_recipes.config.parse import parse_args
    from fsdp_recipes.config.problems import errors
    from fsdp_recipes.errors import RecipeError

    problems = errors(check_config(REPO / "accelerate_configs" / "zero3.yaml", recipe={"zero1": True}))
    assert [p.key for p in problems] == ["zero1"] and "is for DDP launches" in str(problems[0])
    assert not errors(check_config(REPO / DDP_CONFIG, recipe={"zero1": True}))
    with pytest.raises(RecipeError, match="zero1 shards the optimizer state across processes and this launch has 1"):
        parse_args(["--zero1", "true", "--allow_no_fsdp", "true", "--output_dir", str(tmp_path / "o")])
