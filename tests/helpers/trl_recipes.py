"""The machine edits of tests/fixtures/trl/ recipes (the handbook's and TRL's, copied unchanged): what this machine
forces and nothing else. A tiny local Llama stands for the hub model, with the hub tokenizer's chat tokens
(<|im_start|>, <|im_end|>) and the recipes' context length (65,536 rotary positions); each hub dataset becomes a local
folder with the same configurations, splits and columns (a README.md declaring them, as the hub's do), plus a column
no recipe selects, and the first text of each record starts with [its source]; flash_attention_2 becomes sdpa;
push_to_hub false, report_to none, max_steps 4; a test_split_size of 1000 rows becomes 2 (the local data is small).
Used by tests/unit/config/test_trl_recipes.py (every key) and tests/integration/test_trl_recipe_runs.py (launches)."""

from __future__ import annotations

import json
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[2]
FIXTURES = REPO / "tests" / "fixtures" / "trl"
TEXT_DATASETS = {"stanfordnlp/imdb": ("text", "label"), "roneneldan/TinyStories": ("text",)}
CHAT_TOKENS = ["<|im_start|>", "<|im_end|>"]


def tiny_model(root: Path) -> Path:
    """A randomly initialised tiny Llama with the hub chat models' turn tokens, saved with its tokenizer."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(REPO / "assets" / "tiny-llama")
    tokenizer.add_special_tokens({"additional_special_tokens": CHAT_TOKENS})
    config = AutoConfig.from_pretrained(REPO / "assets" / "tiny-llama")
    config.vocab_size = len(tokenizer)
    # the recipes' max_length (rotary positions: no weights depend on it)
    config.max_position_embeddings = 65536
    AutoModelForCausalLM.from_config(config).save_pretrained(root / "tiny-model")
    tokenizer.save_pretrained(root / "tiny-model")
    return root / "tiny-model"


def rows(kind: str, columns, count: int, tag: str) -> list[dict]:
    """``count`` records with ``columns`` (chat or text) and an extra column, ``source``; the first text of each
    starts with [tag], where they are from."""
    if kind == "text":
        lines = [x for x in (REPO / "assets" / "data" / "tiny_corpus.txt").read_text().splitlines() if x.strip()]
        made = [{"text": f"[{tag}] {lines[i]}", "label": i % 2} for i in range(count)]
    else:
        chats = [json.loads(line) for line in (REPO / "assets" / "data" / "tiny_chat.jsonl").read_text().splitlines()]
        for chat in chats[:count]:
            chat["messages"][0]["content"] = f"[{tag}] {chat['messages'][0]['content']}"
        made = [{**chats[i], "chat_template_kwargs": {"enable_thinking": False}} for i in range(count)]
    return [{**{c: r[c] for c in columns}, "source": tag} for r in made]


def local_dataset(root: Path, hub_id: str, splits: dict[tuple[str, str], tuple], count: int = 12) -> str:
    """A folder standing for hub dataset ``hub_id``: ``splits`` maps (configuration, split) to its columns."""
    folder = root / "hub" / hub_id
    folder.mkdir(parents=True, exist_ok=True)
    kind = "text" if hub_id in TEXT_DATASETS else "chat"
    configs: dict[str, list] = {}
    for (config, split), columns in splits.items():
        (folder / config).mkdir(exist_ok=True)
        with open(folder / config / f"{split}.jsonl", "w") as f:
            for record in rows(kind, columns, count, f"{hub_id}/{config}/{split}"):
                f.write(json.dumps(record) + "\n")
        configs.setdefault(config, []).append({"split": split, "path": f"{config}/{split}.jsonl"})
    card = {"configs": [{"config_name": c, "data_files": files} for c, files in configs.items()]}
    (folder / "README.md").write_text(f"---\n{yaml.safe_dump(card)}---\n")
    return str(folder)


def machine_edits(recipe: dict, root: Path, count: int = 12) -> dict:
    """The recipe as this machine can run it: the module docstring's edits, nothing else; ``count`` records a split
    in each local dataset."""
    out = dict(recipe)
    model = str(root / "tiny-model")
    out["model_name_or_path"] = model
    if "tokenizer_name_or_path" in out:
        out["tokenizer_name_or_path"] = model
    if out.get("attn_implementation") == "flash_attention_2":
        out["attn_implementation"] = "sdpa"
    if out.get("use_flash_attention_2"):
        out["use_flash_attention_2"] = False
    out.update(push_to_hub=False, report_to="none", max_steps=4)
    chat = ("messages",)
    if isinstance(out.get("dataset_name"), str):
        config = out.get("dataset_config") or "default"
        splits = [out.get("dataset_train_split", "train"), out.get("dataset_test_split", "test")]
        columns = TEXT_DATASETS.get(out["dataset_name"], chat)
        out["dataset_name"] = local_dataset(root, out["dataset_name"], {(config, s): columns for s in splits}, count)
    if "dataset_mixture" in out:
        mixture = {**out["dataset_mixture"]}
        wanted: dict[str, dict] = {}
        for d in mixture["datasets"]:
            wanted.setdefault(d["id"], {})[(d.get("config") or "default", d.get("split", "train"))] = tuple(
                d.get("columns") or chat
            )
        local = {hub_id: local_dataset(root, hub_id, splits, count) for hub_id, splits in wanted.items()}
        mixture["datasets"] = [{**d, "id": local[d["id"]]} for d in mixture["datasets"]]
        if isinstance(mixture.get("test_split_size"), int) and mixture["test_split_size"] >= 1:
            mixture["test_split_size"] = 2
        out["dataset_mixture"] = mixture
    if "dataset_mixer" in out:
        configs = out.get("dataset_configs") or ["default"] * len(out["dataset_mixer"])
        splits = out.get("dataset_splits") or ["train", "test"]
        out["dataset_mixer"] = {
            local_dataset(root, hub_id, {(config, s): chat for s in splits}, count): weight
            for (hub_id, weight), config in zip(out["dataset_mixer"].items(), configs)
        }
    if "datasets" in out:
        out["datasets"] = [
            {
                **d,
                "path": local_dataset(
                    root, d["path"], {("default", d.get("split", "train")): TEXT_DATASETS[d["path"]]}, count
                ),
            }
            for d in out["datasets"]
        ]
    return out


def read(path: Path, root: Path, drop: str | None = None, count: int = 12, **changes) -> tuple[dict, str]:
    """The fixture as loaded (without key ``drop``), and the path of the edited recipe (with ``changes``; ``count``
    records a split in its local datasets)."""
    recipe = yaml.safe_load(path.read_text())
    edited = root / "recipes" / path.parent.name / path.name
    edited.parent.mkdir(parents=True, exist_ok=True)
    recipe = {k: v for k, v in recipe.items() if k != drop}
    edited.write_text(yaml.safe_dump({**machine_edits(recipe, root, count), **changes}, sort_keys=False))
    return recipe, str(edited)
