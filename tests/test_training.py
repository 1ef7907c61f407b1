"""Every shipped config, launched for real: 2+ CPU processes, the tiny default model, real FSDP."""

from __future__ import annotations

import math

import pytest
import torch
from safetensors.torch import load_file

from conftest import ALL_CONFIGS, launch, logged_losses, read_json

@pytest.mark.parametrize("config", ALL_CONFIGS)
def test_really_fsdp_and_sharded(trained, config):
    run = trained(config)
    report = run.report
    assert report["distributed_type"] == "FSDP"
    assert report["fsdp_version"] == run.fsdp_version
    assert report["world_size"] == run.world_size == len(report["ranks"])
    total = report["total_param_elements"]
    assert total > 200_000  # the whole tiny model, not an empty or partial count
    for rank in report["ranks"]:
        assert rank["wrapper"] == f"FSDP{run.fsdp_version}"
        # exact: every weight dimension of the tiny model divides evenly by 2
        assert rank["local_param_elements"] * run.shard_group == total, rank


@pytest.mark.parametrize("config", ALL_CONFIGS)
def test_loss_finite_and_falling(trained, config):
    losses = logged_losses(trained(config).output_dir)
    assert len(losses) == 6
    assert all(math.isfinite(x) for x in losses)
    assert losses[-1] < 0.85 * losses[0], losses


@pytest.mark.parametrize("config", ALL_CONFIGS)
def test_sharded_checkpoints_on_disk(trained, config):
    run = trained(config)
    for step in (6, 12):
        shards = run.output_dir / f"checkpoint-{step}" / "pytorch_model_fsdp_0"
        assert (shards / ".metadata").is_file()
        assert sorted(p.name for p in shards.glob("*.distcp")) == [f"__{r}_0.distcp" for r in range(run.world_size)]
        assert (run.output_dir / f"checkpoint-{step}" / "optimizer_0" / ".metadata").is_file()


@pytest.mark.parametrize("config", ALL_CONFIGS)
def test_final_folder_loads_with_trained_weights(trained, config, tmp_path):
    from accelerate.utils import merge_fsdp_weights
    from transformers import AutoModelForCausalLM, AutoTokenizer

    run = trained(config)
    out = run.output_dir
    assert read_json(out / "config.json")["architectures"] == ["LlamaForCausalLM"]
    assert (out / "generation_config.json").is_file()
    assert not (out / ".final-sharded").exists() and not (out / ".export-tmp").exists()
    model = AutoModelForCausalLM.from_pretrained(out)
    tokenizer = AutoTokenizer.from_pretrained(out)
    assert len(tokenizer) == model.config.vocab_size

    # Reference: accelerate's own merger over the last training checkpoint (taken after the final step).
    merge_fsdp_weights(str(out / "checkpoint-12" / "pytorch_model_fsdp_0"), str(tmp_path), safe_serialization=True)
    reference = load_file(tmp_path / "model.safetensors")
    loaded = model.state_dict()
    assert set(loaded) == set(reference)
    for name, tensor in reference.items():
        assert torch.equal(loaded[name], tensor), name
    initial = AutoModelForCausalLM.from_config(model.config)
    assert not torch.equal(initial.state_dict()["lm_head.weight"], loaded["lm_head.weight"])


def test_finetune_from_local_folder_loads_the_weights_on_every_rank(trained, tmp_path):
    """model_name_or_path = a folder train_fsdp.py wrote. With learning rate 0 the final weights must equal the
    folder's: a rank that got uninitialised or unsynced weights (cpu_ram_efficient_loading) would change them."""
    base = trained("accelerate_configs/zero3.yaml").output_dir
    out = tmp_path / "lr0"
    launch(
        "accelerate_configs/fsdp1/zero3.yaml", "recipes/tiny-llama/chat_sft.yaml", "--model_name_or_path", str(base),
        "--learning_rate", "0", "--max_steps", "2", "--save_steps", "2", "--output_dir", str(out),
    )
    before, after = load_file(base / "model.safetensors"), load_file(out / "model.safetensors")
    assert set(before) == set(after)
    for name in before:
        assert torch.equal(before[name], after[name]), name


def test_chat_sft_from_local_folder(trained, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    base = trained("accelerate_configs/zero3.yaml").output_dir
    out = tmp_path / "chat"
    launch(
        "accelerate_configs/zero3.yaml", "recipes/tiny-llama/chat_sft.yaml", "--model_name_or_path", str(base),
        "--max_steps", "12", "--logging_steps", "2", "--save_steps", "12", "--output_dir", str(out),
    )
    losses = logged_losses(out)
    assert all(math.isfinite(x) for x in losses) and losses[-1] < losses[0], losses
    tokenizer = AutoTokenizer.from_pretrained(out)
    assert "{% generation %}" in tokenizer.chat_template
    AutoModelForCausalLM.from_pretrained(out)
