"""The checks made before anything starts look at the model_revision a run will load (TRL's and the handbook's key;
transformers reads the model and tokenizer at it), not at main: the hub cache's snapshot of that revision (offline),
the hub's answer for it (online), and that snapshot's config.json (its layer count, code of its own). Cases are
generated: each revision kind (main, a branch cached with a sane or a hostile config, one not cached) offline, and
each source (the model, its tokenizer) online, with the hub's answer both ways; and each other reader of the
model's config before training (the recipe's length check, the auto batch size's shape, check_config's model checks)
at each revision."""

from __future__ import annotations

import functools
import json
from pathlib import Path

import pytest
from conftest import REPO

from fsdp_recipes.config import model_source
from fsdp_recipes.config.model_arguments import ModelArguments
from fsdp_recipes.errors import RecipeError

REPO_ID = "someone/tiny-model"
SANE = json.loads((REPO / "assets" / "tiny-llama" / "config.json").read_text())
# revision -> the config.json cached at it
CONFIGS = {
    "main": SANE,
    "deep": {**SANE, "num_hidden_layers": 10**7},
    "coded": {**SANE, "model_type": "mystery", "auto_map": {"AutoModelForCausalLM": "modeling_mystery.Mystery"}},
    "short": {**SANE, "max_position_embeddings": 64, "num_hidden_layers": 2},
}


@pytest.fixture(autouse=True)
def fresh_hub_answers(monkeypatch):
    """hub_problem's answers are cached per process: each case asks afresh."""
    monkeypatch.setattr(model_source, "hub_problem", functools.lru_cache(model_source.hub_problem.__wrapped__))


def hub_cache(root: Path) -> Path:
    """A hub cache holding REPO_ID at each revision of CONFIGS: config.json, tokenizer files, a safetensors file."""
    import torch
    from safetensors.torch import save_file

    cache = root / "hub"
    repo = cache / f"models--{REPO_ID.replace('/', '--')}"
    for number, (revision, config) in enumerate(CONFIGS.items()):
        commit = f"{number:040x}"
        snapshot = repo / "snapshots" / commit
        snapshot.mkdir(parents=True)
        (snapshot / "config.json").write_text(json.dumps(config))
        for name in ("tokenizer.json", "tokenizer_config.json"):
            (snapshot / name).write_text((REPO / "assets" / "tiny-llama" / name).read_text())
        # its own weights
        save_file({"w": torch.full((2,), float(number))}, str(snapshot / "model.safetensors"))
        (repo / "refs").mkdir(exist_ok=True)
        (repo / "refs" / revision).write_text(commit)
    return cache


# revision -> what its line must say (None: accepted)
OFFLINE = {
    "main": None,
    "deep": "more than any model has",
    "coded": "runs no code from a model folder",
    "uncached": "neither a local folder nor in the hub cache",
}


@pytest.mark.parametrize("revision", sorted(OFFLINE))
def test_offline_the_cached_snapshot_of_the_revision_is_checked(tmp_path, monkeypatch, revision):
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(hub_cache(tmp_path)))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    if OFFLINE[revision] is None:
        ModelArguments(model_name_or_path=REPO_ID, model_revision=revision)
        return
    with pytest.raises(RecipeError) as err:
        ModelArguments(model_name_or_path=REPO_ID, model_revision=revision)
    assert OFFLINE[revision] in str(err.value) and "\n" not in str(err.value), err.value


@pytest.mark.parametrize("there", [True, False])
@pytest.mark.parametrize("source", ["model", "tokenizer"])
def test_online_the_hub_is_asked_about_the_revision(tmp_path, monkeypatch, source, there):
    import huggingface_hub
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "empty-cache"))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    asked = []

    def answer(name):
        def ask(repo_id, *args, **kwargs):
            # its second parameter
            positional = args[-1] if args and name == "revision_exists" else None
            asked.append((name, repo_id, kwargs.get("revision", positional)))
            return there

        return ask

    for name in ("file_exists", "repo_exists", "revision_exists"):
        monkeypatch.setattr(huggingface_hub, name, answer(name))
    local = str(REPO / "assets" / "tiny-llama")
    given = {"config_name": local, "tokenizer_name": REPO_ID} if source == "tokenizer" else {}
    given = given or {"model_name_or_path": REPO_ID, "tokenizer_name": local}
    if there:
        ModelArguments(**given, model_revision="v2")
    else:
        with pytest.raises(RecipeError, match="at revision 'v2'"):
            ModelArguments(**given, model_revision="v2")
    assert asked and all(revision == "v2" for _, _, revision in asked), asked


def positions_check(revision: str, tmp_path: Path) -> str | None:
    """parse_args' length check (block_size against the model's positions): its line, or None when accepted."""
    from fsdp_recipes.config.parse import parse_args

    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(
        f"model_name_or_path: {REPO_ID}\nmodel_revision: {revision}\nblock_size: 128\nmax_steps: 2\n"
        f"train_file: {REPO / 'assets' / 'data' / 'tiny_corpus.txt'}\noutput_dir: {tmp_path / 'out'}\n"
    )
    try:
        parse_args([str(recipe), "--allow_no_fsdp", "true"])
    except RecipeError as err:
        return str(err)
    return None


def shape_check(revision: str, tmp_path: Path) -> str | None:
    """The auto batch size's model shape (tools/estimate_memory.py's too): its layer count as a line."""
    from fsdp_recipes.config.memory import model_shape

    try:
        return f"{model_shape(REPO_ID, revision).layers} layers"
    except ValueError as err:
        return str(err)


def config_check(revision: str, tmp_path: Path) -> str | None:
    """tools/check_config.py's model checks with a recipe naming the hub id and its model_revision."""
    from fsdp_recipes.config.accelerate_config import check_config

    recipe = {"model_name_or_path": REPO_ID, "model_revision": revision}
    said = [f"{p.message}" for p in check_config(REPO / "accelerate_configs" / "zero3.yaml", recipe=recipe)]
    return " | ".join(said) or None


# (reader, revision) -> what it must say (None: accepted without a word)
READERS = {
    (positions_check, "main"): None,
    (positions_check, "short"): "longer than the model's 64 positions",
    (shape_check, "main"): "4 layers",
    (shape_check, "short"): "2 layers",
    (shape_check, "deep"): "more than any model has",
    (shape_check, "uncached"): "neither a local folder nor in the hub cache",
    (config_check, "main"): None,
    (config_check, "deep"): "more than any model has",
    (config_check, "coded"): "runs no code from a model folder",
    (config_check, "uncached"): "neither a local folder nor in the hub cache",
}


@pytest.mark.parametrize("reader, revision", list(READERS), ids=[f"{r.__name__}-{v}" for r, v in READERS])
def test_every_reader_of_the_config_before_training_reads_the_revision(tmp_path, monkeypatch, reader, revision):
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(hub_cache(tmp_path)))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    # transformers' own reads
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    said = reader(revision, tmp_path)
    wanted = READERS[(reader, revision)]
    assert (said is None) if wanted is None else (said is not None and wanted in said), said


@pytest.mark.parametrize("revision", sorted(CONFIGS))
def test_a_lora_base_is_recorded_at_the_revision_the_run_loads(tmp_path, monkeypatch, revision):
    """A LoRA run's base identity (checked when a checkpoint resumes) describes the snapshot the model was loaded
    from, each revision's own weights."""
    from types import SimpleNamespace

    from huggingface_hub import constants

    from fsdp_recipes.ckpt import base_identity
    from fsdp_recipes.train.modeling import lora_base_identity

    cache = hub_cache(tmp_path)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    args = SimpleNamespace(use_peft=True, model_name_or_path=REPO_ID, model_revision=revision)
    repo = cache / f"models--{REPO_ID.replace('/', '--')}"
    snapshot = repo / "snapshots" / (repo / "refs" / revision).read_text()
    said = []
    assert lora_base_identity(args, None, log=said.append) == base_identity.identity(snapshot, name=REPO_ID), said
