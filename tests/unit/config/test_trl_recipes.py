"""The real recipes of the alignment handbook (current and dataset_mixer formats) and TRL's CLI examples
(tests/fixtures/trl/*/, copied unchanged), read with only the edits this machine forces (tests/helpers/trl_recipes.py):
every key is taken with the meaning TRL gives it, or refused by name in one line with the reason; each mixture loads
with its proportions, columns and test split."""

from __future__ import annotations

import importlib.util
import json
import re
from pathlib import Path

import pytest
import yaml
from helpers.trl_recipes import FIXTURES, read, tiny_model

from fsdp_recipes.config import dict_fields, mixture, trl_recipe
from fsdp_recipes.config.arguments import TRL_ALIASES
from fsdp_recipes.config.parse import parse_args
from fsdp_recipes.errors import RecipeError

CORPUS = sorted(p for p in FIXTURES.rglob("*.yaml") if p.parent != FIXTURES)
NO_FSDP = ("--allow_no_fsdp", "true")
# recipes refused here, and the words of the one line that says why
REFUSED = {
    # QLoRA: CUDA and bitsandbytes only
    "zephyr-7b-beta-config_qlora.yaml": "load_in_4bit",
    # where liger-kernel is not installed (TRL fails there too)
    "smollm3-mid.yaml": "use_liger_kernel",
    "smollm3-sft.yaml": "use_liger_kernel",
}
# keys set by the machine edits (their values are ours, not the recipe's)
EDITED = {"model_name_or_path", "tokenizer_name_or_path", "attn_implementation", "use_flash_attention_2"}
EDITED |= {"push_to_hub", "report_to", "max_steps", "dataset_name"}


def test_corpus_holds_every_handbook_sft_recipe_and_trls_examples():
    names = {p.relative_to(FIXTURES).as_posix() for p in CORPUS}
    assert len([n for n in names if n.startswith("handbook/")]) == 11, names
    assert len([n for n in names if n.startswith("handbook-dataset-mixer/")]) == 4, names
    assert len([n for n in names if n.startswith("trl-cli/")]) == 3, names
    for path in CORPUS:
        assert re.match(r"# Source: huggingface/\S+ \S+.* at commit [0-9a-f]{40}", path.read_text()), path


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> Path:
    """A tiny model with the hub chat models' turn tokens, in a working folder where the recipes' paths land."""
    root = tmp_path_factory.mktemp("trl-recipes")
    tiny_model(root)
    return root


def landed(key: str, value, model_args, data_args, plan, said: str) -> bool:
    """Whether recipe key ``key`` holds ``value`` here with TRL's meaning."""
    raw = vars(plan.raw)
    if key in ("dataset_mixture", "dataset_mixer", "datasets"):
        taken = mixture.read_plan(data_args.dataset_mixture)
        if key == "dataset_mixer":
            return [d["weight"] for d in taken["datasets"]][:: len(taken["datasets"]) // len(value)] == list(
                value.values()
            )
        entries = value["datasets"] if key == "dataset_mixture" else value
        weights = [e.get("weight", 1.0) if key == "dataset_mixture" else e.get("fraction") for e in entries]
        return [d["weight"] for d in taken["datasets"]] == weights and [d["split"] for d in taken["datasets"]] == [
            e.get("split", "train") for e in entries
        ]
    if key in ("dataset_splits", "dataset_configs", "test_split_size", "streaming"):
        return data_args.dataset_mixture is not None
    if key == "warmup_ratio":
        return raw["warmup_steps"] == value and "warmup_ratio" in said
    if key in trl_recipe.RENAMED:
        return raw[trl_recipe.RENAMED[key]] == value and key in said
    # a local folder: said
    if key == "model_revision":
        return "model_revision" in said
    if key == "use_liger_kernel":
        return raw.get("use_liger_kernel") is True or "use_liger_kernel" in said
    if key == "dataset_kwargs":
        return set(value) <= {"add_special_tokens", "append_concat_token"} and not value.get("add_special_tokens")
    if key == "packing_strategy" and value in trl_recipe.PACKING_STRATEGIES:
        return raw["packing_strategy"] == trl_recipe.PACKING_STRATEGIES[value] and value in said
    if key in ("dataset_train_split", "dataset_config") and data_args.dataset_mixture is None:
        return raw[TRL_ALIASES[key]] == value
    if key in dict_fields.DICT_VALUED:
        return json.loads(raw[key]) == value
    if key == "packing":
        return data_args.trl_packing is value
    ours = TRL_ALIASES.get(key, trl_recipe.HANDBOOK_ALIASES.get(key, key))
    return ours in raw and raw[ours] == value


@pytest.mark.parametrize("path", CORPUS, ids=lambda p: p.relative_to(FIXTURES).as_posix())
def test_each_recipe_is_read_with_trls_meaning_or_refused_in_one_line(path, root, monkeypatch, capsys):
    monkeypatch.chdir(root)
    recipe, edited = read(path, root)
    refused = REFUSED.get(path.name) if path.parent.name.startswith("handbook") else None
    if refused == "use_liger_kernel" and importlib.util.find_spec("liger_kernel") is not None:
        refused = None
    if refused is not None:
        with pytest.raises(RecipeError) as err:
            parse_args([edited, *NO_FSDP])
        assert "\n" not in str(err.value) and refused in str(err.value), str(err.value)
        # and every other key holds
        recipe, edited = read(path, root, drop=refused)
    model_args, data_args, plan = parse_args([edited, *NO_FSDP])
    said = capsys.readouterr().err
    wrong = [
        key
        for key, value in recipe.items()
        if key not in EDITED and not landed(key, value, model_args, data_args, plan, said)
    ]
    assert not wrong, (wrong, said)


MIXTURE_KEYS = ("dataset_mixture", "dataset_mixer", "datasets")
MIXTURES = [p for p in CORPUS if set(MIXTURE_KEYS) & set(yaml.safe_load(p.read_text()))]


def _fewest_datasets(key: str) -> Path:
    def count(p):
        entries = yaml.safe_load(p.read_text())[key]
        return len(entries["datasets"] if key == "dataset_mixture" else entries)

    return min((p for p in MIXTURES if key in yaml.safe_load(p.read_text())), key=count)


# The same rows in the same order on every load is the seed's work in each format's code, not a recipe's: loaded twice
# for the smallest mixture of each format (smollm3's 25 datasets took 3.4 s more)
LOADED_TWICE = {_fewest_datasets(key) for key in MIXTURE_KEYS}


def tags(dataset) -> list[str]:
    first = [r["messages"][0]["content"] if "messages" in r else r["text"] for r in dataset]
    return [re.match(r"\[(.*?)\]", text).group(1).split("/hub/")[-1] for text in first]


@pytest.mark.parametrize("path", MIXTURES, ids=lambda p: p.relative_to(FIXTURES).as_posix())
def test_each_mixture_loads_with_its_proportions_columns_and_test_split(path, root, monkeypatch):
    """Loaded as the script of its format loads it: each dataset's share of rows, the columns selected (the extra
    one dropped), the test split held out; the same rows in the same order on every load (the seed)."""
    from collections import Counter

    from fsdp_recipes.train.data import load_raw

    monkeypatch.chdir(root)
    recipe, edited = read(path, root, drop=REFUSED.get(path.name))
    _, data_args, plan = parse_args([edited, *NO_FSDP])
    train, evaluation = load_raw(data_args, plan.raw.seed)
    if path in LOADED_TWICE:
        assert tags(train) == tags(load_raw(data_args, plan.raw.seed)[0])
    both = Counter(tags(train)) + Counter(tags(evaluation) if evaluation is not None else [])
    if "dataset_mixture" in recipe:
        mixture = recipe["dataset_mixture"]
        expected = Counter()
        for d in mixture["datasets"]:
            expected[f"{d['id']}/{d.get('config', 'default')}/{d['split']}"] += int(12 * d.get("weight", 1.0))
        assert both == +expected
        size = mixture.get("test_split_size")
        assert (evaluation is None) == (size is None)
        if size is not None:
            assert len(evaluation) == (2 if size >= 1 else -(-sum(expected.values()) * size // 1))
        columns = set(mixture["datasets"][0].get("columns", ["messages"]))
        assert set(train.column_names) == columns
    elif "dataset_mixer" in recipe:
        splits, configs = recipe["dataset_splits"], recipe.get("dataset_configs") or ["default"] * 9
        for (hub_id, weight), config in zip(recipe["dataset_mixer"].items(), configs):
            for split in splits:
                rows = int(12 * weight) if "train" in split else 12
                assert Counter(tags(train if "train" in split else evaluation))[f"{hub_id}/{config}/{split}"] == rows
        assert train.column_names == ["messages"]
    # no columns given: every column kept
    else:
        assert both == Counter({f"{d['path']}/default/train": 12 for d in recipe["datasets"]}) and evaluation is None
        assert {"text", "source"} <= set(train.column_names)


def test_the_docs_table_of_trl_names_is_the_code_s():
    """docs/training.md shows TRL_NAMES, the table the translation keeps (a key or meaning changed in one place
    and not the other fails here)."""
    docs = (FIXTURES.parents[2] / "docs" / "training.md").read_text()
    rows = [line for line in docs.splitlines() if line.startswith("| `")]
    shown = {r.split(" | ")[0].strip("| ").replace("`", ""): r.split(" | ")[1].rstrip(" |") for r in rows}
    assert {k: v for k, v in shown.items() if k in trl_recipe.TRL_NAMES} == trl_recipe.TRL_NAMES
    assert all(f"`{key}`" in docs for key in trl_recipe.NO_EQUIVALENT)


# Every field of TRL's SFTConfig (with its _BaseConfig), ModelConfig and ScriptArguments (trl f2cd577) and of the
# handbook's argument dataclasses (925acdf, and c8f5bdf's older ones), at its default value there
TRL_FIELDS = {
    "learning_rate": 2e-05,
    "model_init_kwargs": None,
    "router_aux_loss_coef": 0.001,
    "trust_remote_code": False,
    "chat_template_path": None,
    "dataset_text_field": "text",
    "dataset_kwargs": None,
    "dataset_num_proc": None,
    "eos_token": None,
    "max_length": 1024,
    "truncation_mode": "keep_start",
    "shuffle_dataset": False,
    "packing": False,
    "packing_strategy": "bfd",
    "padding_free": False,
    "pad_to_multiple_of": None,
    "eval_packing": None,
    "completion_only_loss": None,
    "assistant_only_loss": False,
    "loss_type": None,
    "activation_offloading": False,
    "pad_token": None,
    "logging_steps": 10,
    "gradient_checkpointing": True,
    "bf16": None,
    "lr_scheduler_kwargs": None,
    "use_liger_kernel": False,
    "torch_empty_cache_steps": None,
    "model_revision": "main",
    "dtype": "float32",
    "attn_implementation": None,
    "use_peft": False,
    "lora_r": 16,
    "lora_alpha": 32,
    "lora_dropout": 0.05,
    "lora_target_modules": None,
    "lora_target_parameters": None,
    "lora_modules_to_save": None,
    "lora_task_type": "CAUSAL_LM",
    "use_rslora": False,
    "use_dora": False,
    "load_in_8bit": False,
    "load_in_4bit": False,
    "bnb_4bit_quant_type": "nf4",
    "use_bnb_nested_quant": False,
    "bnb_4bit_quant_storage": None,
    "dataset_name": None,
    "dataset_config": None,
    "dataset_train_split": "train",
    "dataset_test_split": "test",
    "dataset_streaming": False,
    "ignore_bias_buffers": False,
    "datasets": None,
    "streaming": False,
    "test_split_size": None,
    "dataset_mixture": None,
    "chat_template": None,
    "base_model_revision": None,
    "model_code_revision": None,
    "torch_dtype": None,
    "tokenizer_name_or_path": None,
    "dataset_mixer": None,
    "text_column": "text",
    "dataset_splits": None,
    "dataset_configs": None,
    "preprocessing_num_workers": None,
    "truncation_side": None,
    "auto_insert_empty_system_msg": True,
    "hub_model_revision": "main",
    "logging_first_step": True,
}


@pytest.mark.parametrize("key, value", sorted(TRL_FIELDS.items()))
def test_every_trl_and_handbook_field_at_its_default_is_taken_or_refused_with_its_reason(
    key, value, root, monkeypatch, tmp_path
):
    """A recipe may write any of their fields at its default: it is taken, or refused in one line naming it with
    the reason (never as an unknown key): with chat data, auto_insert_empty_system_msg true and dataset_test_split
    beside a local file; and a null where ours has a value."""
    monkeypatch.chdir(root)
    recipe = {"model_name_or_path": str(root / "tiny-model"), "train_file": str(FIXTURES.parents[2] / "assets")}
    recipe["train_file"] += "/data/tiny_chat.jsonl"
    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump({**recipe, key: value, "output_dir": str(tmp_path / "out")}))
    try:
        parse_args([str(path), *NO_FSDP])
    except RecipeError as err:
        message = str(err)
        assert key in message and "unknown key" not in message and "\n" not in message, message
        refused = ("auto_insert_empty_system_msg", "dataset_test_split")
        assert key in refused or (value is None and "null is not a value here" in message), message
