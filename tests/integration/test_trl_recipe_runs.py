"""Two real recipes, launched with only the machine edits (tests/helpers/trl_recipes.py), keep the meaning TRL gives
their keys at run time: the handbook's smollm3 SFT recipe (current format: a 25-dataset mixture, a chat template,
eos_token, warmup_ratio, cosine_with_min_lr with its kwargs, gradient checkpointing, packing with TRL's old ffd) and
its older zephyr QLoRA recipe (dataset_mixer with train and test splits, LoRA settings, evaluation by epoch).

Besides the module's edits: use_liger_kernel is dropped (liger-kernel is not installed here) and so is load_in_4bit
(QLoRA needs CUDA); max_steps is raised to 40 for smollm3 so that its 3% warmup spans two logged steps."""

from __future__ import annotations

import json
import math

import pytest
import yaml
from conftest import launch, read_json
from helpers.trl_recipes import FIXTURES, read, tiny_model

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    root = tmp_path_factory.mktemp("trl-runs")
    tiny_model(root)
    return root


def test_smollm3_sft_saves_its_template_and_eos_and_generate_stops_there(root):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = FIXTURES / "handbook" / "smollm3-sft.yaml"
    recipe, edited = read(path, root, drop="use_liger_kernel", max_steps=40, save_strategy="no")
    proc = launch("accelerate_configs/zero3.yaml", edited, cwd=root)
    out = root / recipe["output_dir"]
    model_dir = out / "model"
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    assert tokenizer.chat_template == recipe["chat_template"] and tokenizer.eos_token == "<|im_end|>"
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    assert model.generation_config.eos_token_id == end == model.config.eos_token_id

    # generate() with the saved generation config stops at the end of the turn: <|im_end|> forced as the 3rd token
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": "How many cows?"}], add_generation_prompt=True, return_tensors="pt"
    )
    prompt = prompt["input_ids"] if not torch.is_tensor(prompt) else prompt
    start = prompt.shape[1]

    def third_is_end(batch_id, ids):
        return [end] if len(ids) == start + 2 else list(range(len(tokenizer)))

    made = model.generate(prompt, max_new_tokens=20, do_sample=False, prefix_allowed_tokens_fn=third_is_end)
    assert made.shape[1] == start + 3 and made[0, -1].item() == end

    # warmup_ratio 0.03 of 40 steps: the rate rises over ceil(1.2) = 2 steps to learning_rate, then decays toward
    # min_lr_rate x learning_rate (cosine_with_min_lr and its lr_scheduler_kwargs)
    rates = [e["learning_rate"] for e in read_json(out / "trainer_state.json")["log_history"] if "learning_rate" in e]
    peak, floor = recipe["learning_rate"], recipe["learning_rate"] * recipe["lr_scheduler_kwargs"]["min_lr_rate"]
    assert rates[0] < rates[1] < rates[2] == pytest.approx(peak), rates[:4]
    assert all(a >= b for a, b in zip(rates[2:], rates[3:])) and floor <= rates[-1] < rates[3], rates[-3:]
    training = read_json(out / "run_args.json")["training"]
    assert training["gradient_checkpointing"] is True
    assert training["gradient_checkpointing_kwargs"] == recipe["gradient_checkpointing_kwargs"]
    said = proc.stderr
    assert "packing_strategy ffd is TRL's older name of bfd" in said and "warmup_ratio 0.03" in said, said[-3000:]
    assert math.isfinite(read_json(out / "train_results.json")["train_loss"])


def test_zephyr_qlora_old_format_trains_its_lora_and_evaluates_each_epoch(root):
    path = FIXTURES / "handbook-dataset-mixer" / "zephyr-7b-beta-config_qlora.yaml"
    recipe, edited = read(path, root, drop="load_in_4bit", max_steps=6, save_strategy="no")
    launch("accelerate_configs/zero3.yaml", edited, cwd=root)
    out = root / recipe["output_dir"]
    adapter = json.loads((out / "adapter" / "adapter_config.json").read_text())
    assert (adapter["r"], adapter["lora_alpha"], adapter["lora_dropout"]) == (
        recipe["lora_r"],
        recipe["lora_alpha"],
        recipe["lora_dropout"],
    )
    assert sorted(adapter["target_modules"]) == sorted(recipe["lora_target_modules"])
    history = read_json(out / "trainer_state.json")["log_history"]
    evaluations = [e for e in history if "eval_loss" in e]
    # 12 train_sft rows a split (tests/helpers/trl_recipes.py), 4 a device on 2 ranks: 2 steps an epoch, 3 epochs
    assert [e["epoch"] for e in evaluations][:3] == [1, 2, 3] and "eval_loss" in read_json(out / "eval_results.json")
    assert yaml.safe_load(path.read_text())["eval_strategy"] == "epoch"
