"""A resume refuses, in one line before the first step, a checkpoint of another model (other heads of the same
shapes), another learning rate, another optimizer, or fp32 weights into bf16 parameters (a LoRA run's frozen base:
tests/integration/test_lora.py): nothing trained or written, the run's record untouched. A bf16 model's own resume
under mixed precision is not refused, and an FSDP1 FULL_STATE_DICT run resumes to the same bits or is refused."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from conftest import QUICK, REPO
from helpers.launch_sequence import launch_sequence, run_and_resume
from helpers.zero3_runs import zero3_runs as shared_zero3_runs

TINY = REPO / "assets" / "tiny-llama"
FULL = ("--fsdp_state_dict_type", "FULL_STATE_DICT")


ZERO3, FSDP1 = "accelerate_configs/zero3.yaml", "accelerate_configs/fsdp1/zero3.yaml"
# Mixed precision off for every refused resume, as a CPU without native bf16 turns it off itself: with it on, FSDP2
# keeps fp32 master weights and a --dtype bfloat16 resume of an fp32 run is right to go on
# (test_a_bf16_models_resume_under_mixed_precision_is_not_refused). The other refusals do not depend on it. A LoRA
# run's bf16 resume, refused with mixed precision on or off, is tests/integration/test_lora.py's.
NO_MIXED = ("--mixed_precision", "no")


def checkpoint_6_of(trained, config: str, run: Path, record: bool) -> Path:
    """A run folder holding a copy of the config's trained run's checkpoint-6 (and, with ``record``, its
    run_args.json; without, the resume of a folder that has no record)."""
    source = trained(config).output_dir
    shutil.copytree(source / "checkpoint-6", run / "checkpoint-6")
    if record:
        shutil.copy(source / "run_args.json", run / "run_args.json")
    return run


@pytest.fixture(scope="module")
def refused(trained, tmp_path_factory):
    """``refused(name)`` -> (run folder, SequencedRun): each resume below refused, the resumes of one config in one
    launch (tests/helpers/launch_sequence.py), each of its own copy. Each refusal must be the same one-line error on
    every rank; its folder is read after the launch."""
    root = tmp_path_factory.mktemp("refused")
    # half the heads of twice the size (every weight shape the same), gelu
    other = root / "other-heads"
    config = json.loads((TINY / "config.json").read_text())
    heads = config["num_attention_heads"] // 2
    changes = {
        "num_attention_heads": heads,
        "num_key_value_heads": max(1, config["num_key_value_heads"] // 2),
        "head_dim": config["hidden_size"] // heads,
        "hidden_act": "gelu",
    }
    other.mkdir()
    (other / "config.json").write_text(json.dumps({**config, **changes}))
    lr = json.loads((trained(FSDP1).output_dir / "run_args.json").read_text())["training"]["learning_rate"]
    resume = ("--resume_from_checkpoint", "true")
    cases = {
        ZERO3: {
            "heads": ("--config_name", str(other), "--tokenizer_name", str(TINY)),
            "optimizer": ("--optim", "sgd"),
            "bf16": ("--dtype", "bfloat16"),
        },
        FSDP1: {"lr": ("--learning_rate", str(lr / 3)), "bf16": ("--dtype", "bfloat16")},
    }
    folders, sequences = {}, {}
    for config_name, runs in cases.items():
        commands = {}
        slug = config_name.removeprefix("accelerate_configs/").removesuffix(".yaml").replace("/", "-")
        for name, flags in runs.items():
            run = folders[config_name, name] = root / slug / name
            checkpoint_6_of(trained, config_name, run, record=name == "heads")
            commands[name] = [*QUICK, *flags, "--output_dir", str(run), *resume]
        sequences[config_name] = launch_sequence(root / slug / "launch", config_name, commands, launch_args=NO_MIXED)

    def get(name: str, config: str = ZERO3):
        return folders[config, name], sequences[config](name, refused=True)

    return get


def test_resuming_a_model_of_the_same_shapes_but_other_heads_stops_before_loading(refused, trained):
    """Half the heads of twice the size (every weight shape the same) and another activation: the check by config.json,
    the subtler of the two (fewer layers, found by the weights' names, is tests/unit/ckpt/test_model_match.py's); the
    run's record still describes the run that wrote the checkpoint (a refused resume rewrote it before)."""
    run, said = refused("heads")
    assert "its config.json differs in" in said.refusal and "hidden_act" in said.refusal, said.refusal
    assert not (run / "checkpoint-12").exists()
    assert (run / "run_args.json").read_bytes() == (trained(ZERO3).output_dir / "run_args.json").read_bytes()


def test_resuming_with_another_learning_rate_stops_before_the_first_step(refused, trained):
    """The stock Trainer resumes with the checkpoint's learning rate whatever --learning_rate says (its optimizer and
    scheduler state carry it): a changed one is refused in one line, nothing trained or written. FSDP1 here, FSDP2 in
    the optimizer's test below (the same check of the loaded param groups: tests/unit/ckpt/test_model_match.py)."""
    run, said = refused("lr", FSDP1)
    trained_with = json.loads((trained(FSDP1).output_dir / "run_args.json").read_text())["training"]["learning_rate"]
    assert (
        f"--learning_rate is {trained_with / 3} in this run, but checkpoint-6 was trained with {trained_with}"
        in said.refusal
    ), said.refusal
    assert not (run / "checkpoint-12").exists() and not (run / "model").exists()


def test_resuming_with_another_optimizer_is_one_line(refused):
    """--optim sgd on resume of an AdamW checkpoint is one line, not torch's 'Missing key in checkpoint state_dict:
    optimizer.param_groups.0.momentum' on every rank."""
    run, said = refused("optimizer")
    assert "checkpoint-6's optimizer state does not fit this run's optimizer (--optim sgd" in said.refusal
    assert not (run / "checkpoint-12").exists()


@pytest.mark.parametrize("config", [ZERO3, FSDP1])
def test_resuming_an_fp32_run_in_bf16_stops_before_the_first_step(refused, config):
    """--dtype bfloat16 on the resume of an fp32 run would round every master weight and Adam state to bf16 without a
    word (both FSDP versions, mixed precision off: the parameters are bf16): it stops first."""
    run, said = refused("bf16", config)
    assert "checkpoint-6 holds float32 weights and this run's parameters are bfloat16" in said.refusal
    assert not (run / "checkpoint-12").exists() and not (run / "model").exists()


@pytest.fixture(scope="module")
def zero3_runs(trained, tmp_path_factory):
    """tests/helpers/zero3_runs.py's runs, one launch shared with other test files."""
    return shared_zero3_runs(trained, tmp_path_factory)


@pytest.mark.slow
def test_a_bf16_models_resume_under_mixed_precision_is_not_refused(zero3_runs):
    """The case a check before prepare refused: a model built in bf16 under FSDP2 mixed precision has fp32 master
    weights once accelerate upcast them, so its checkpoint holds fp32 and its own resume loads fp32 into fp32. The
    run and its resume (from its checkpoint-2, with the same flags, into an output_dir of its own) are
    tests/helpers/zero3_runs.py's "bf16" and "bf16-resumed", trained one after the other in a launch shared with
    other runs; the resume ended normally, or zero3_runs would have failed the test with its error."""
    from fsdp_recipes.ckpt.dcp_pickles import read_layout

    # quick(max_steps="2", save_steps="2") with BF16's flags
    trained_bf16, _ = zero3_runs("bf16")
    # the resume writes into its own folder: the checkpoint it read is still as the run left it
    weights = read_layout(trained_bf16 / "checkpoint-2" / "pytorch_model_fsdp_0").tensors.values()
    assert {t.dtype for t in weights} == {"float32"}
    # quick(max_steps="4", save_steps="2"), the same flags
    run, said = zero3_runs("bf16-resumed")
    # past the checks before the first step
    assert f"resuming from {trained_bf16 / 'checkpoint-2'}" in said.stdout
    assert (run / "checkpoint-4").is_dir() and (run / "model").is_dir()


@pytest.mark.slow
def test_fsdp1_full_state_dict_resumes_exactly_or_not_at_all(tmp_path):
    """FSDP1 FULL_STATE_DICT (accelerate's FSDP1 default) with use_orig_params: torch 2.13 loads weights and Adam state
    that equal the saved ones, yet the first update after the resume differs (measured). The run says so at start,
    and the resume is refused in one line naming the fix; with use_orig_params false a run resumes to the same bits.
    A LoRA checkpoint's model card (peft's README.md, saved under FULL_STATE_DICT) does not stop the rotation.

    Two launches (tests/helpers/launch_sequence.py), one per set of launch flags: the use_orig_params false run and
    its resume (from its checkpoint-3, into another output_dir), then the LoRA run and its refused resume."""
    import torch
    from safetensors.torch import load_file

    config, no_orig = "accelerate_configs/fsdp1/zero3.yaml", (*FULL, "--fsdp_use_orig_params", "false")
    args = ["--max_steps", "4", "--save_steps", "3", "--logging_steps", "1"]
    exact, whole, resumed = run_and_resume(tmp_path / "exact", config, args, "checkpoint-3", no_orig)
    exact("run")
    said = exact("resumed")
    assert f"resuming from {whole / 'checkpoint-3'}" in said.stdout + said.stderr
    a, b = load_file(whole / "model" / "model.safetensors"), load_file(resumed / "model" / "model.safetensors")
    assert set(a) == set(b) and all(torch.equal(a[k], b[k]) for k in a)

    lora = tmp_path / "lora"
    lora_args = [
        "recipes/tiny-llama/lora_sft.yaml",
        "--save_steps",
        "1",
        "--save_total_limit",
        "1",
        "--output_dir",
        str(lora),
    ]
    # the refused resume is a user's: `true` in the LoRA run's own output_dir, trained first in the same launch (the
    # sequence lets go of a run's output_dir lock when it ends, as its process would)
    runs = launch_sequence(
        tmp_path / "lora-launch",
        config,
        {
            "lora": [*lora_args, "--max_steps", "3"],
            "refused": [*lora_args, "--max_steps", "5", "--resume_from_checkpoint", "true"],
        },
        launch_args=FULL,
    )
    done = runs("lora")
    assert "writes checkpoints that do not resume exactly" in done.stdout + done.stderr
    assert (
        sorted(p.name for p in lora.glob("checkpoint-*")) == ["checkpoint-3"]
        # every rank's output, both runs
        and "not a checkpoint holding nothing else" not in done.launch_output
    )
    # peft's model card: the reason it is a checkpoint's file
    assert (lora / "checkpoint-3" / "README.md").is_file()
    refused = runs("refused", refused=True).refusal
    assert "FSDP1 with fsdp_use_orig_params: true does not resume exactly" in refused, refused
    assert "SHARDED_STATE_DICT" in refused and not (lora / "checkpoint-4").exists()
