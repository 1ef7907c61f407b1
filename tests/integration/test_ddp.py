"""accelerate_configs/ddp.yaml: real DistributedDataParallel on 2 CPU processes, and ZeRO-1 (--zero1 true): each rank
holds half of Adam's state, the weights equal DDP's, checkpoints resume exactly after a SIGKILL and merge.

The DDP run, the ZeRO-1 run and the ZeRO-1 resume train one after another in one launch (``runs``): a launch each
would pay torch's and the process group's start-up every time."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from conftest import DDP_CONFIG, QUICK, REPO, logged_losses, read_json, shared_temp
from helpers.launch_sequence import SequencedRun, launch_sequence
from safetensors.torch import load_file

from fsdp_recipes.ckpt.status import checkpoint_status
from fsdp_recipes.config.launcher import LaunchSettings
from fsdp_recipes.config.memory import Setup, estimate, model_shape

ZERO1 = ("--zero1", "true")


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """``runs(name)`` -> (output_dir, SequencedRun), ended normally: "ddp" (QUICK settings), "zero1" (the same with
    --zero1 true) and "resumed" (zero1's run resumed from its checkpoint-6, by its path, into an output_dir of its
    own), trained in that order in one launch of DDP_CONFIG (tests/helpers/launch_sequence.py), which pytest-xdist's
    workers share. Only this file trains on DDP_CONFIG: no other test reads these runs."""
    folder = shared_temp(tmp_path_factory) / "ddp-runs"
    zero1 = folder / "zero1"
    get = launch_sequence(
        folder,
        DDP_CONFIG,
        {
            "ddp": [*QUICK, "--output_dir", str(folder / "ddp")],
            "zero1": [*QUICK, *ZERO1, "--output_dir", str(zero1)],
            # after zero1's run, whose checkpoint-6 it reads; it writes into its own output_dir, not zero1's
            "resumed": [
                *QUICK,
                *ZERO1,
                "--output_dir",
                str(folder / "resumed"),
                "--resume_from_checkpoint",
                str(zero1 / "checkpoint-6"),
            ],
        },
    )

    def run(name: str) -> tuple[Path, SequencedRun]:
        return folder / name, get(name)

    return run


# the shared launch
@pytest.mark.slow
def test_ddp_is_real_ddp_and_trains(runs):
    out, _ = runs("ddp")
    report = read_json(out / "fsdp_report.json")
    # gloo DDP, not N lone runs
    assert report["distributed_type"] == "MULTI_CPU" and report["fsdp_version"] is None
    assert report["world_size"] == len(report["ranks"]) == 2 and report["sharding_strategy"] is None
    total = report["total_param_elements"]
    for rank in report["ranks"]:
        assert rank["wrapper"] == "DistributedDataParallel" and rank["local_param_elements"] == total
        assert rank["bytes"] == {"params": 4 * total, "grads": 4 * total, "optimizer": 8 * total}
    losses = logged_losses(out)
    assert all(math.isfinite(x) for x in losses) and losses[-1] < 0.85 * losses[0], losses
    assert (
        read_json(out / "model" / "config.json")["use_cache"]
        is read_json(out / "checkpoint-12" / "config.json")["use_cache"]
        is True
    )


# the shared launch
@pytest.mark.slow
def test_zero1_holds_half_the_optimizer_state_per_rank(runs):
    ddp, zero1 = (read_json(runs(name)[0] / "fsdp_report.json") for name in ("ddp", "zero1"))
    assert zero1["sharding_strategy"] == "ZERO1"
    total = zero1["total_param_elements"]
    states = [rank["bytes"]["optimizer"] for rank in zero1["ranks"]]
    # all of Adam's m and v, once
    assert sum(states) == 8 * total == ddp["ranks"][0]["bytes"]["optimizer"]
    for rank in zero1["ranks"]:
        # replicated
        assert rank["wrapper"] == "DistributedDataParallel" and rank["local_param_elements"] == total
        assert rank["bytes"]["params"] == rank["bytes"]["grads"] == 4 * total
        # 1/2, as ZeRO partitions whole tensors
        assert rank["bytes"]["optimizer"] == pytest.approx(4 * total, rel=0.05)
        est = estimate(model_shape(str(REPO / "assets" / "tiny-llama")), Setup(strategy="ZERO1", nproc_per_node=2))
        # tools/estimate_memory.py
        assert rank["bytes"]["optimizer"] == pytest.approx(est.optimizer, rel=0.05)


# the shared launch
@pytest.mark.slow
def test_zero1_trains_the_same_weights_as_ddp(runs):
    """Same gradients (DDP's all-reduce), the same AdamW update, each parameter updated by one rank and broadcast."""
    ddp, zero1 = (load_file(runs(name)[0] / "model" / "model.safetensors") for name in ("ddp", "zero1"))
    assert set(ddp) == set(zero1)
    for name in ddp:
        torch.testing.assert_close(zero1[name], ddp[name], rtol=0, atol=1e-6, msg=name)


# the shared launch
@pytest.mark.slow
def test_zero1_checkpoint_is_whole_and_merges(runs, tmp_path):
    from transformers import AutoModelForCausalLM

    from fsdp_recipes.ckpt.merge import merge_checkpoint

    out, _ = runs("zero1")
    status = checkpoint_status(out / "checkpoint-12")
    assert status.resumable and status.state_dict_type == "PLAIN" and status.sharding_strategy == "ZERO1"
    optimizer = torch.load(out / "checkpoint-12" / "optimizer.pt", weights_only=True)
    params = len(list(AutoModelForCausalLM.from_pretrained(out / "model").parameters()))
    # the Trainer's save_model writes it; the model folder ships without
    assert not (out / "model" / "training_args.bin").exists()
    # every parameter's moments, gathered from both ranks
    assert sorted(optimizer["state"]) == list(range(params))
    merge_checkpoint(out / "checkpoint-12", tmp_path / "merged", log=lambda _: None)
    merged, final = load_file(tmp_path / "merged" / "model.safetensors"), load_file(out / "model" / "model.safetensors")
    assert all(torch.equal(merged[k], final[k]) for k in final)


# the shared launch
@pytest.mark.slow
def test_zero1_resumed_run_ends_on_the_uninterrupted_weights(runs):
    """From the uninterrupted run's checkpoint-6, as a run stopped after step 6 leaves it (how a SIGKILL'd run gets
    back to its last checkpoint is test_fault_tolerance's; how `true` finds it, test_resume_decision's): the
    consolidated optimizer state goes back to its shards exactly."""
    reference, _ = runs("zero1")
    out, resumed = runs("resumed")
    assert f"resuming from {reference / 'checkpoint-6'}" in resumed.stdout
    assert read_json(out / "trainer_state.json")["global_step"] == 12
    final, expected = (
        load_file(out / "model" / "model.safetensors"),
        load_file(reference / "model" / "model.safetensors"),
    )
    assert all(torch.equal(final[k], expected[k]) for k in expected)
    saved, again = (
        torch.load(d / "checkpoint-12" / "optimizer.pt", weights_only=True)["state"] for d in (reference, out)
    )
    # Adam's moments came back on both ranks: they end equal too
    for index, moments in saved.items():
        assert all(torch.equal(again[index][k], v) for k, v in moments.items()), index


# the shared launch
@pytest.mark.slow
def test_a_ddp_checkpoint_is_not_resumed_under_fsdp(runs):
    from fsdp_recipes.ckpt.resume import _resumable
    from fsdp_recipes.errors import RecipeError

    status = checkpoint_status(runs("ddp")[0] / "checkpoint-6")
    with pytest.raises(RecipeError, match=r"was saved without FSDP \(DDP or ZeRO-1\): resume it with the same launch"):
        # what the resume decision (rank 0, preflight) does under an FSDP launch
        _resumable(status, trainer_fsdp=True)
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
