"""A recipe's chat_template and eos_token (TRL's and the handbook's) on the tokenizer, and on the model's config and
generation config, so that generate() of the saved model stops at the end of a turn."""

from __future__ import annotations

import re
from types import SimpleNamespace

import pytest
from conftest import REPO

from fsdp_recipes.errors import RecipeError
from fsdp_recipes.train.modeling import load_model, load_tokenizer

TINY = str(REPO / "assets" / "tiny-llama")
TEMPLATE = "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}<|end|>{% endfor %}"


def args(**given) -> SimpleNamespace:
    base = {"model_name_or_path": None, "config_name": TINY, "tokenizer_name": TINY, "trust_remote_code": False}
    base |= {"dtype": "float32", "attn_implementation": "sdpa", "load_in_4bit": False, "use_peft": False}
    base |= {"model_revision": "main", "chat_template": None, "chat_template_path": None, "eos_token": None}
    return SimpleNamespace(**(base | given))


def test_chat_template_and_eos_token_reach_the_tokenizer_and_the_generation_config():
    a = args(chat_template=TEMPLATE, eos_token="<|end|>")
    tokenizer = load_tokenizer(a)
    assert tokenizer.chat_template == TEMPLATE and tokenizer.eos_token == "<|end|>"
    model = load_model(a, tokenizer)
    end = tokenizer.convert_tokens_to_ids("<|end|>")
    assert model.generation_config.eos_token_id == end == model.config.eos_token_id


def test_without_eos_token_the_models_own_end_stays():
    tokenizer = load_tokenizer(args())
    assert load_model(args(), tokenizer).generation_config.eos_token_id == 2 and tokenizer.eos_token == "</s>"


def test_chat_template_path_reads_a_jinja_file(tmp_path):
    (tmp_path / "t.jinja").write_text(TEMPLATE)
    assert load_tokenizer(args(chat_template_path=str(tmp_path / "t.jinja"))).chat_template == TEMPLATE


def test_an_eos_token_outside_the_vocabulary_is_one_line():
    with pytest.raises(RecipeError, match=re.escape("eos_token '<|im_end|>' is not a token of tokenizer")):
        load_tokenizer(args(eos_token="<|im_end|>"))
