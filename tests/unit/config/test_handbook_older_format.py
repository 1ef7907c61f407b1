"""The alignment handbook's older dataset_mixer format keeps that format's defaults where ours differ: its
auto_insert_empty_system_msg (true: an empty system turn first in each conversation without one, where the chat
template has system turns, as its maybe_insert_system_message does) and its DEFAULT_CHAT_TEMPLATE for a tokenizer
without a chat template (as its get_tokenizer does). Elsewhere a tokenizer without one is refused for chat data,
naming the keys that give one. Cases are generated: every handbook recipe of the corpus (both formats) with the key
unset, true and false; templates with and without system turns; conversations with and without one."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
from conftest import REPO
from datasets import Dataset
from helpers.trl_recipes import FIXTURES, read, tiny_model

from fsdp_recipes.config.arguments import DataArguments
from fsdp_recipes.config.parse import parse_args
from fsdp_recipes.config.trl_recipe import HANDBOOK_CHAT_TEMPLATE
from fsdp_recipes.errors import RecipeError
from fsdp_recipes.train.data import tokenize_chat
from fsdp_recipes.train.modeling import load_tokenizer

NO_FSDP = ("--allow_no_fsdp", "true")
TINY = REPO / "assets" / "tiny-llama"
CHAT = str(REPO / "assets" / "data" / "tiny_chat.jsonl")
HANDBOOK = sorted(p for p in FIXTURES.glob("handbook*/*.yaml"))
REFUSED = {"zephyr-7b-beta-config_qlora.yaml": "load_in_4bit", "smollm3-mid.yaml": "use_liger_kernel"}
REFUSED["smollm3-sft.yaml"] = "use_liger_kernel"
SETTINGS = [(p, s) for p in HANDBOOK for s in ((None, True, False) if "dataset-mixer" in p.parent.name else (None,))]


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("handbook")
    tiny_model(root)
    return root


@pytest.mark.parametrize("path, setting", SETTINGS, ids=[f"{p.parent.name}/{p.stem}-{s}" for p, s in SETTINGS])
def test_each_handbook_recipe_keeps_its_formats_defaults(path, setting, root, monkeypatch, capsys):
    monkeypatch.chdir(root)
    older = path.parent.name == "handbook-dataset-mixer"
    changes = {} if setting is None else {"auto_insert_empty_system_msg": setting}
    recipe, edited = read(path, root, drop=REFUSED.get(path.name), **changes)
    model_args, data_args, _ = parse_args([edited, *NO_FSDP])
    said = capsys.readouterr().err
    assert data_args.auto_insert_empty_system_msg is (older if setting is None else setting)
    assert ("auto_insert_empty_system_msg is true" in said) == (older and setting is None), said
    own = recipe.get("chat_template") is not None
    assert model_args.default_chat_template == (HANDBOOK_CHAT_TEMPLATE if older and not own else None)


def tokenizer_with(template: str | None, root: Path):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(TINY)
    tokenizer.chat_template = template
    return tokenizer


# template -> whether it renders system turns (the handbook's test: 'system' or <|im_start|> in it)
TEMPLATES = {
    "handbook_default": (HANDBOOK_CHAT_TEMPLATE, True),
    "chatml": (
        "{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}{% endfor %}",
        True,
    ),
    "roles_only": ("{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}<|end|>{% endfor %}", False),
}
TURNS = [{"role": "user", "content": "How many cats?"}, {"role": "assistant", "content": "Ada has 4 cats."}]
RENDER = [(t, first, flag) for t in TEMPLATES for first in ("user", "system") for flag in (True, False)]


@pytest.mark.parametrize("template, first, flag", RENDER, ids=[f"{t}-{f}-first-{g}" for t, f, g in RENDER])
def test_an_empty_system_turn_begins_a_conversation_where_the_template_has_them(tmp_path, template, first, flag):
    text, has_system = TEMPLATES[template]
    tokenizer = tokenizer_with(text, tmp_path)
    messages = TURNS if first == "user" else [{"role": "system", "content": "Be brief."}, *TURNS]
    args = DataArguments(train_file=CHAT, block_size=128, auto_insert_empty_system_msg=flag)
    row = tokenize_chat(Dataset.from_dict({"messages": [messages]}), tokenizer, args)[0]
    inserted = flag and has_system and first == "user"
    expected = [{"role": "system", "content": ""}, *messages] if inserted else messages
    assert row["input_ids"] == list(
        tokenizer.apply_chat_template(expected, tokenize=True, return_dict=True)["input_ids"]
    )


def model_args(**given) -> SimpleNamespace:
    base = {"tokenizer_name": None, "trust_remote_code": False, "model_revision": "main", "chat_template": None}
    base |= {"chat_template_path": None, "eos_token": None, "default_chat_template": None}
    return SimpleNamespace(**(base | given))


@pytest.mark.parametrize("own", [True, False])
@pytest.mark.parametrize("default", [True, False])
def test_a_default_chat_template_is_for_a_tokenizer_without_one(tmp_path, capsys, own, default):
    folder = tmp_path / "tokenizer"
    tokenizer_with(TEMPLATES["roles_only"][0] if own else None, tmp_path).save_pretrained(folder)
    args = model_args(tokenizer_name=str(folder), default_chat_template=HANDBOOK_CHAT_TEMPLATE if default else None)
    tokenizer = load_tokenizer(args)
    said = capsys.readouterr().err
    expected = TEMPLATES["roles_only"][0] if own else HANDBOOK_CHAT_TEMPLATE if default else None
    assert tokenizer.chat_template == expected
    assert ("has no chat template" in said) == (default and not own), said
    # no template: chat data is refused naming what gives one
    if expected is None:
        with pytest.raises(RecipeError) as err:
            tokenize_chat(Dataset.from_dict({"messages": [TURNS]}), tokenizer, DataArguments(train_file=CHAT))
        assert "chat_template" in str(err.value) and "chat_template_path" in str(err.value), err.value
