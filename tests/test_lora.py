"""LoRA (peft) under FSDP2 and FSDP1: only the adapter trains, sharded like the rest; a resume from the mid-run
checkpoint ends on the same bits (how a SIGKILL'd or preempted run comes back to that checkpoint is
test_fault_tolerance's); the run ends with the merged model (equal to peft's own merge_and_unload of the trained
adapter) and the adapter folder PeftModel loads."""

from __future__ import annotations

import shutil

import pytest
import torch
from safetensors.torch import load_file

from conftest import QUICK, REPO, launch, logged_losses, read_json

LORA = ["--use_peft", "true", "--lora_r", "8", "--lora_alpha", "16", "--lora_dropout", "0.0", "--learning_rate", "1e-2"]
CONFIGS = ["accelerate_configs/zero3.yaml", "accelerate_configs/fsdp1/zero3.yaml"]


@pytest.mark.slow
@pytest.mark.parametrize("config", CONFIGS, ids=["fsdp2", "fsdp1"])
def test_lora_trains_resumes_exactly_and_ends_merged_and_as_adapter(trained, config, tmp_path):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    base = trained("accelerate_configs/zero3.yaml").output_dir  # a pre-trained folder to adapt
    args = [*QUICK, "--model_name_or_path", str(base), *LORA]
    whole, out = tmp_path / "whole", tmp_path / "resumed"
    launch(config, *args, "--output_dir", str(whole))
    losses = logged_losses(whole)
    assert losses[-1] < losses[0], losses

    report = read_json(whole / "fsdp_report.json")
    assert 0 < report["trainable_param_elements"] < report["total_param_elements"] / 5
    assert sum(r["local_trainable_elements"] for r in report["ranks"]) == report["trainable_param_elements"]
    assert all(0 < r["local_trainable_elements"] < report["trainable_param_elements"] for r in report["ranks"])  # sharded
    assert report["trainable"] and all(".lora_A." in n or ".lora_B." in n for n in report["trainable"])

    shutil.copytree(whole / "checkpoint-6", out / "checkpoint-6")  # what a run stopped after step 6 leaves
    resumed = launch(config, *args, "--output_dir", str(out), "--resume_from_checkpoint", "true")
    assert f"resuming from {out / 'checkpoint-6'}" in resumed.stdout
    for name in ("model.safetensors", "adapter/adapter_model.safetensors"):
        resumed, reference = load_file(out / name), load_file(whole / name)
        assert set(resumed) == set(reference)
        for key in reference:
            assert torch.equal(resumed[key], reference[key]), (name, key)

    merged = AutoModelForCausalLM.from_pretrained(whole).state_dict()
    by_peft = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base), whole / "adapter").merge_and_unload().state_dict()
    untouched = AutoModelForCausalLM.from_pretrained(base).state_dict()
    assert set(merged) == set(by_peft)
    changed = 0
    for key in by_peft:
        torch.testing.assert_close(merged[key], by_peft[key], rtol=0, atol=1e-6)
        changed += not torch.equal(merged[key], untouched[key])
    assert changed == 4 * 7  # every targeted linear of the 4 layers moved; nothing else did


@pytest.mark.slow
def test_lora_recipe_on_a_fresh_checkout_names_a_base_that_loads(tmp_path, monkeypatch):
    """recipes/tiny-llama/lora_sft.yaml builds its base from a config: the run saves that base once, and the adapter
    loads onto it exactly as a new user would write it, from where the recipe was launched."""
    import json

    from peft import PeftModel
    from transformers import AutoConfig, AutoModelForCausalLM, set_seed

    for folder in ("assets", "recipes"):  # what a fresh checkout has, and no runs/
        shutil.copytree(REPO / folder, tmp_path / folder)
    launch("accelerate_configs/zero3.yaml", "recipes/tiny-llama/lora_sft.yaml", "--max_steps", "10", "--save_steps", "5", cwd=tmp_path)
    monkeypatch.chdir(tmp_path)

    # the new user's code, word for word
    adapter = "runs/tiny-llama-lora/adapter"
    base = json.loads(open(f"{adapter}/adapter_config.json").read())["base_model_name_or_path"]
    model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base), adapter)

    assert base == "runs/tiny-llama-lora/base_model"
    base_weights = AutoModelForCausalLM.from_pretrained(base).state_dict()
    set_seed(42)  # the recipe's seed: the base is the config's model as the run built it, random and frozen
    built = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained("assets/tiny-llama")).state_dict()
    assert set(built) == set(base_weights) and all(torch.equal(built[k], base_weights[k]) for k in built)
    merged = AutoModelForCausalLM.from_pretrained("runs/tiny-llama-lora").state_dict()
    by_peft = model.merge_and_unload().state_dict()
    assert set(merged) == set(by_peft)
    changed = 0
    for key in by_peft:
        torch.testing.assert_close(merged[key], by_peft[key], rtol=0, atol=1e-6)
        changed += not torch.equal(merged[key], base_weights[key])
    assert changed == 4 * 7  # every targeted linear moved; the frozen rest is the base's, bit for bit


def test_only_an_exported_adapter_folder_is_replaced(tmp_path):
    """The next export replaces output_dir/adapter only when it holds nothing but adapter files in a real folder."""
    from fsdp_recipes.train.export import is_exported_adapter

    ours = tmp_path / "adapter"
    ours.mkdir()
    (ours / "adapter_config.json").write_text("{}")
    (ours / "adapter_model.safetensors").write_bytes(b"")
    assert is_exported_adapter(ours)
    link = tmp_path / "link"
    link.symlink_to(ours)
    assert not is_exported_adapter(link)
    (ours / "notes.txt").write_text("a user's file")
    assert not is_exported_adapter(ours)
    assert not is_exported_adapter(tmp_path / "missing")
