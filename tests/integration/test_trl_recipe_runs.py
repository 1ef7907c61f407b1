"""Every recipe of tests/fixtures/trl/ (the handbook's, both formats, and TRL's CLI examples), launched with only the
machine edits (tests/helpers/trl_recipes.py), trains end to end on 2 ranks under real FSDP (zero3.yaml) and keeps the
meaning TRL gives its keys at run time: its model folder loads, it trained (2 steps, a finite loss), its chat
template and eos_token are saved, its LoRA settings are in the adapter, its evaluation ran when it asks for one, its
gradient checkpointing and warmup are in force. Two recipes are checked further: the handbook's smollm3 SFT recipe
(generate() stops at its eos; the warmup and cosine_with_min_lr in the logged rates; packing with TRL's old ffd) and
its older zephyr QLoRA recipe (evaluation by epoch). And a current-format recipe without its chat_template, on a
model whose tokenizer has none, is set up for ChatML as the handbook's sft.py does (tokens added, embeddings grown,
on rank 0 and on the rank that receives rank 0's weights).

One launch trains them all, one after another in the same processes (tests/helpers/trl_recipe_sequence.py runs
train_fsdp's own main for each): a launch per recipe would pay torch's start-up 18 times.

Besides the module's edits: each recipe gets its own output_dir and its own copy of the tiny model and local data
(two recipes write one hub id with different splits), 64 records a split (the largest recipe batch, 8 a device x 4
accumulated x 2 ranks, within one epoch), max_steps 2 and save_strategy no; dataset_num_proc (TRL) and
preprocessing_num_workers (the older handbook) are 2, this machine's cores (the recipes ask for 12 to 48);
use_liger_kernel is dropped (liger-kernel is not installed here) and so is load_in_4bit (QLoRA needs CUDA). The
smollm3 SFT recipe runs 34 steps so that its 3% warmup spans two logged steps (ceil(1.02)); the zephyr QLoRA one 8,
two epochs of 4 steps."""

from __future__ import annotations

import json
import math
import shutil
import time
from pathlib import Path

import pytest
import yaml
from conftest import REPO, launch, read_json, shared_temp
from helpers.trl_recipes import FIXTURES, read, tiny_model

pytestmark = pytest.mark.slow

SEQUENCE = Path(__file__).resolve().parents[1] / "helpers" / "trl_recipe_sequence.py"
RECIPES = sorted(p.relative_to(FIXTURES).as_posix() for p in FIXTURES.glob("*/*.yaml"))
SMOLLM3 = "handbook/smollm3-sft.yaml"
ZEPHYR_QLORA = "handbook-dataset-mixer/zephyr-7b-beta-config_qlora.yaml"
DROPPED = {"use_liger_kernel", "load_in_4bit"}
ROWS = 64
STEPS = {SMOLLM3: 34, ZEPHYR_QLORA: 8}
# a current-format recipe without its chat_template, on a model whose tokenizer has none and lacks the ChatML tokens
CHATML = "chatml/zephyr-7b-beta-config_full.yaml"
RUNS = {**{name: name for name in RECIPES}, CHATML: "handbook/zephyr-7b-beta-config_full.yaml"}


def home_of(root: Path, key: str) -> Path:
    return root / key.replace("/", "--").removesuffix(".yaml")


def plain_model(folder: Path) -> None:
    """A tiny Llama whose tokenizer has no chat template and none of the ChatML tokens (the corpus model's length)."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(REPO / "assets" / "tiny-llama")
    tokenizer.chat_template = None
    config = AutoConfig.from_pretrained(REPO / "assets" / "tiny-llama")
    config.max_position_embeddings = 65536
    AutoModelForCausalLM.from_config(config).save_pretrained(folder)
    tokenizer.save_pretrained(folder)


class Trained:
    """One run of the shared launch: the fixture as loaded, its output_dir, its result and what rank 0 said."""

    def __init__(self, key: str, root: Path, stderr: str):
        self.recipe = yaml.safe_load((FIXTURES / RUNS[key]).read_text())
        self.home = home_of(root, key)
        self.out = self.home / "out"
        edited = self.home / "recipes" / RUNS[key]
        self.result = read_json(f"{edited}.result.json")
        self.said = stderr.partition(f"=== RECIPE {edited}\n")[2].partition("=== RECIPE ")[0]


@pytest.fixture(scope="module")
def trained_recipes(tmp_path_factory) -> dict[str, Trained]:
    """Every recipe trained in one launch, once per session (pytest-xdist's workers share it under a file lock)."""
    from filelock import FileLock

    root = shared_temp(tmp_path_factory) / "trl-recipe-sequence"
    done = root / "launch.json"
    with FileLock(f"{root}.lock"):
        if not done.is_file():
            shutil.rmtree(root, ignore_errors=True)
            tiny_model(root)
            edited = []
            for key, name in RUNS.items():
                home = home_of(root, key)
                if key == CHATML:
                    plain_model(home / "tiny-model")
                else:
                    shutil.copytree(root / "tiny-model", home / "tiny-model")
                raw = yaml.safe_load((FIXTURES / name).read_text())
                changes = {k: 2 for k in ("dataset_num_proc", "preprocessing_num_workers") if k in raw}
                changes.update(max_steps=STEPS.get(name, 2), save_strategy="no", output_dir=str(home / "out"))
                drop = "chat_template" if key == CHATML else next((k for k in DROPPED if k in raw), None)
                edited.append(read(FIXTURES / name, home, drop=drop, count=ROWS, **changes)[1])
            start = time.monotonic()
            # its own datasets cache: datasets 5.2 keys a local folder's cache by its name and configuration, not
            # its files, so a session's earlier 12-record copies of the same hub ids would be read instead
            env = {"HF_DATASETS_CACHE": str(root / "datasets-cache")}
            proc = launch("accelerate_configs/zero3.yaml", *edited, script=SEQUENCE, cwd=root, env=env)
            seconds = round(time.monotonic() - start, 1)
            done.write_text(json.dumps({"stderr": proc.stderr, "seconds": seconds}))
    stderr = read_json(done)["stderr"]
    return {key: Trained(key, root, stderr) for key in RUNS}


@pytest.mark.parametrize("name", RECIPES)
def test_each_recipe_trains_and_saves_what_its_keys_mean(trained_recipes, name):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    run = trained_recipes[name]
    recipe, out = run.recipe, run.out
    assert run.result["error"] is None, run.result
    state = read_json(out / "trainer_state.json")
    assert state["global_step"] == STEPS.get(name, 2)
    assert math.isfinite(read_json(out / "train_results.json")["train_loss"])

    model_dir = out / "model"
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    own = AutoTokenizer.from_pretrained(run.home / "tiny-model").chat_template
    assert tokenizer.chat_template == recipe.get("chat_template", own)
    if "eos_token" in recipe:
        end = tokenizer.convert_tokens_to_ids(recipe["eos_token"])
        assert tokenizer.eos_token == recipe["eos_token"]
        assert model.generation_config.eos_token_id == end == model.config.eos_token_id

    if recipe.get("use_peft"):
        adapter = read_json(out / "adapter" / "adapter_config.json")
        assert (adapter["r"], adapter["lora_alpha"], adapter["lora_dropout"]) == (
            recipe["lora_r"],
            recipe["lora_alpha"],
            recipe["lora_dropout"],
        )
        assert sorted(adapter["target_modules"]) == sorted(recipe["lora_target_modules"])
    else:
        assert not (out / "adapter").exists()

    evaluates = str(recipe.get("eval_strategy", recipe.get("evaluation_strategy", "no"))) != "no"
    assert (
        ("eval_loss" in read_json(out / "eval_results.json")) if evaluates else not (out / "eval_results.json").exists()
    )

    training = read_json(out / "run_args.json")["training"]
    assert training["gradient_checkpointing"] is bool(recipe.get("gradient_checkpointing", False))
    if "warmup_ratio" in recipe:
        assert (
            training["warmup_steps"] == recipe["warmup_ratio"] and f"warmup_ratio {recipe['warmup_ratio']}" in run.said
        )


def test_smollm3_sft_generate_stops_at_its_eos_and_its_schedule_is_kept(trained_recipes):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    run = trained_recipes[SMOLLM3]
    recipe, out = run.recipe, run.out
    model_dir = out / "model"
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)

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

    # warmup_ratio 0.03 of 34 steps: the rate rises over ceil(1.02) = 2 steps to learning_rate, then decays toward
    # min_lr_rate x learning_rate (cosine_with_min_lr and its lr_scheduler_kwargs)
    rates = [e["learning_rate"] for e in read_json(out / "trainer_state.json")["log_history"] if "learning_rate" in e]
    peak, floor = recipe["learning_rate"], recipe["learning_rate"] * recipe["lr_scheduler_kwargs"]["min_lr_rate"]
    assert rates[0] < rates[1] < rates[2] == pytest.approx(peak), rates[:4]
    assert all(a >= b for a, b in zip(rates[2:], rates[3:])) and floor <= rates[-1] < rates[3], rates[-3:]
    training = read_json(out / "run_args.json")["training"]
    assert training["gradient_checkpointing_kwargs"] == recipe["gradient_checkpointing_kwargs"]
    assert "packing_strategy ffd is TRL's older name of bfd" in run.said, run.said[-3000:]


def test_zephyr_qlora_old_format_evaluates_each_epoch(trained_recipes):
    run = trained_recipes[ZEPHYR_QLORA]
    history = read_json(run.out / "trainer_state.json")["log_history"]
    evaluations = [e for e in history if "eval_loss" in e]
    # 64 train_sft rows, 4 a device on 2 ranks, 2 accumulated: 4 steps an epoch, 8 steps
    assert [e["epoch"] for e in evaluations][:2] == [1, 2] and run.recipe["eval_strategy"] == "epoch"


def test_a_current_format_recipe_sets_a_template_less_tokenizer_up_for_chatml(trained_recipes):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from fsdp_recipes.train.chat_tokens import CHATML_TEMPLATE

    run = trained_recipes[CHATML]
    assert run.result["error"] is None, run.result
    assert "set up for ChatML" in run.said and read_json(run.out / "trainer_state.json")["global_step"] == 2
    tokenizer = AutoTokenizer.from_pretrained(run.out / "model")
    model = AutoModelForCausalLM.from_pretrained(run.out / "model", dtype=torch.float32)
    assert tokenizer.chat_template == CHATML_TEMPLATE and tokenizer.eos_token == "<|im_end|>"
    assert model.get_input_embeddings().weight.shape[0] == len(tokenizer) == 476
    assert model.generation_config.eos_token_id == tokenizer.convert_tokens_to_ids("<|im_end|>")
    assert torch.isfinite(model.get_input_embeddings().weight).all()
