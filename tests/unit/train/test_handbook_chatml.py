"""A recipe whose tokenizer has no chat template gets its format's default: the handbook's current dataset_mixture
format the ChatML set-up its sft.py makes (TRL's setup_chat_format: the ChatML template, <|im_start|> and <|im_end|>
as bos, eos and pad, added where the vocabulary lacks them, the embeddings grown to match, the config and generation
config told), the older dataset_mixer format its DEFAULT_CHAT_TEMPLATE, TRL's own formats none (chat data is refused
there, as TRL fails). Cases are generated: every recipe of the corpus without its chat_template; tokenizers with and
without the ChatML tokens and with a template of their own; the model on the CPU and on the meta device (a rank that
receives rank 0's weights)."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from conftest import REPO
from helpers.trl_recipes import FIXTURES, read, tiny_model

from fsdp_recipes.config.parse import parse_args
from fsdp_recipes.config.trl_recipe import HANDBOOK_CHAT_TEMPLATE
from fsdp_recipes.train.chat_tokens import CHATML_TEMPLATE, fit_embeddings
from fsdp_recipes.train.modeling import load_model, load_tokenizer

TINY = REPO / "assets" / "tiny-llama"
CORPUS = sorted(FIXTURES.glob("*/*.yaml"))
# not installed here / CUDA only (tests/unit/config/test_trl_recipes.py)
REFUSED = {"use_liger_kernel", "load_in_4bit"}


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("chatml")
    tiny_model(root)
    return root


@pytest.mark.parametrize("path", CORPUS, ids=[f"{p.parent.name}/{p.stem}" for p in CORPUS])
def test_each_recipe_without_a_template_gets_its_formats_default(path, root, monkeypatch):
    import yaml

    monkeypatch.chdir(root)
    fixture = yaml.safe_load(path.read_text())
    drop = next((k for k in REFUSED if k in fixture), None)
    _, edited = read(path, root, drop=drop, chat_template=None)
    model_args, _, _ = parse_args([edited, "--allow_no_fsdp", "true"])
    assert model_args.default_chat_format == ("chatml" if "dataset_mixture" in fixture else None)
    assert model_args.default_chat_template == (HANDBOOK_CHAT_TEMPLATE if "dataset_mixer" in fixture else None)


def tokenizer_folder(tmp_path: Path, kind: str) -> Path:
    """A tokenizer without a chat template: the tiny Llama's ("plain", no ChatML tokens), or the corpus model's
    ("chat_tokens", <|im_start|> and <|im_end|> already in its vocabulary); or "own_template", the tiny Llama's with
    its template."""
    from transformers import AutoTokenizer

    folder = tmp_path / kind
    tokenizer = AutoTokenizer.from_pretrained(TINY)
    if kind == "chat_tokens":
        tokenizer.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>"]})
    if kind != "own_template":
        tokenizer.chat_template = None
    tokenizer.save_pretrained(folder)
    return folder


def args(tokenizer: Path, **given) -> SimpleNamespace:
    base = {"model_name_or_path": None, "config_name": str(TINY), "tokenizer_name": str(tokenizer)}
    base |= {"trust_remote_code": False, "dtype": "float32", "attn_implementation": "sdpa", "load_in_4bit": False}
    base |= {"use_peft": False, "model_revision": "main", "chat_template": None, "chat_template_path": None}
    base |= {"eos_token": None, "default_chat_format": "chatml"}
    return SimpleNamespace(**(base | given))


@pytest.mark.parametrize("kind", ["plain", "chat_tokens", "own_template"])
def test_the_chatml_set_up_reaches_the_tokenizer_the_embeddings_and_the_generation_config(tmp_path, kind, capsys):
    from transformers import AutoTokenizer

    given = args(tokenizer_folder(tmp_path, kind))
    before = AutoTokenizer.from_pretrained(given.tokenizer_name)
    tokenizer = load_tokenizer(given)
    model = load_model(given, tokenizer)
    said = capsys.readouterr().err
    rows = model.get_input_embeddings().weight.shape[0]
    # the tokenizer's own template wins: nothing changes
    if kind == "own_template":
        assert tokenizer.chat_template == before.chat_template and tokenizer.eos_token == before.eos_token
        assert len(tokenizer) == len(before) and rows == 474 and "ChatML" not in said
        return
    assert tokenizer.chat_template == CHATML_TEMPLATE and "set up for ChatML" in said and "\n" not in said.strip()
    assert (tokenizer.bos_token, tokenizer.eos_token, tokenizer.pad_token) == (
        "<|im_start|>",
        "<|im_end|>",
        "<|im_end|>",
    )
    assert rows == len(tokenizer) == 476 == model.get_output_embeddings().weight.shape[0]
    assert torch.isfinite(model.get_input_embeddings().weight).all()
    ids = (tokenizer.bos_token_id, tokenizer.eos_token_id, tokenizer.pad_token_id)
    for config in (model.config, model.generation_config):
        assert (config.bos_token_id, config.eos_token_id, config.pad_token_id) == ids
    rendered = tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False)
    assert rendered == "<|im_start|>user\nhi<|im_end|>\n"


@pytest.mark.parametrize(
    "kind, vocab_size, refused",
    [
        # the set-up adds both tokens: the embeddings would grow
        ("plain", 474, True),
        # the tokenizer holds them past the model's rows: they would grow too
        ("chat_tokens", 474, True),
        # the model has rows for them
        ("chat_tokens", 476, False),
        # a vocabulary padded beyond the tokenizer: room for the new tokens
        ("plain", 480, False),
        # no set-up
        ("own_template", 474, False),
    ],
)
def test_lora_is_refused_where_the_chatml_set_up_would_grow_the_embeddings(tmp_path, kind, vocab_size, refused):
    """LoRA leaves the rows the embeddings grow by random and frozen, in neither its checkpoints nor its adapter:
    refused in one line naming the fix, from the config alone, before any weight loads. Where the model has rows
    for every token, or the tokenizer keeps its own template, LoRA trains as before."""
    from transformers import AutoConfig

    from fsdp_recipes.errors import RecipeError

    config = tmp_path / "config"
    AutoConfig.from_pretrained(TINY, vocab_size=vocab_size).save_pretrained(config)
    given = args(tokenizer_folder(tmp_path, kind), use_peft=True, config_name=str(config))
    if not refused:
        assert len(load_tokenizer(given)) <= vocab_size
        return
    with pytest.raises(RecipeError) as err:
        load_tokenizer(given)
    said = str(err.value)
    assert "\n" not in said and f"more than the model's {vocab_size} embedding rows" in said, said
    assert "chat_template_path" in said and "use_peft" in said, said


def test_a_rank_on_the_meta_device_grows_its_embeddings_alike(tmp_path):
    from transformers import AutoConfig, AutoModelForCausalLM

    given = args(tokenizer_folder(tmp_path, "plain"))
    tokenizer = load_tokenizer(given)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(TINY))
    fit_embeddings(model, tokenizer, given)
    assert model.get_input_embeddings().weight.shape == (476, model.config.hidden_size)
    assert model.get_input_embeddings().weight.is_meta and model.config.vocab_size == 476


@pytest.mark.parametrize("eos", ["<|im_end|>", "</s>", "<|im_start|>"])
def test_the_chatml_set_up_ends_turns_at_im_end_whatever_eos_token_the_recipe_gives(tmp_path, eos, capsys):
    """The handbook sets the recipe's eos_token, then setup_chat_format makes <|im_end|> the eos: the only end the
    ChatML template writes. Another eos would leave generate() running past the end of every turn."""
    tokenizer = load_tokenizer(args(tokenizer_folder(tmp_path, "chat_tokens"), eos_token=eos))
    said = capsys.readouterr().err
    assert tokenizer.eos_token == "<|im_end|>" and tokenizer.chat_template == CHATML_TEMPLATE
    assert ("gives way to it" in said) is (eos != "<|im_end|>") and "\n" not in said.strip(), said
