"""A recipe's chat template and end-of-turn token (TRL's and the handbook's chat_template, chat_template_path and
eos_token) on the tokenizer, and the model's generation config told the same end, so that the saved model stops
generating at the end of its turn."""

from __future__ import annotations

import os
from pathlib import Path

from transformers import AutoTokenizer, PreTrainedModel, PreTrainedTokenizerBase

from fsdp_recipes.bounded import JSON_LIMIT, read_text
from fsdp_recipes.config.model_arguments import ModelArguments
from fsdp_recipes.console import say
from fsdp_recipes.errors import RecipeError


def revision(args: ModelArguments, source: str | None) -> str | None:
    """model_revision for a hub id; None for a local folder (read as it is: the recipe's revision was said then)."""
    local = source is None or os.path.exists(os.path.expanduser(source))
    return None if local else getattr(args, "model_revision", None)


def apply_recipe_tokens(tokenizer: PreTrainedTokenizerBase, args: ModelArguments) -> PreTrainedTokenizerBase:
    """The tokenizer with the recipe's chat template (or its default_chat_template where the tokenizer has none) and
    eos_token; an eos_token not in its vocabulary is refused (TRL refuses it too: it would be a new token without an
    embedding)."""
    template, path, eos = (getattr(args, k, None) for k in ("chat_template", "chat_template_path", "eos_token"))
    if template is not None:
        tokenizer.chat_template = template
    elif path is not None:
        path = Path(path).expanduser()
        if path.is_file():
            tokenizer.chat_template = read_text(path, "chat_template_path", JSON_LIMIT)
        else:
            source = AutoTokenizer.from_pretrained(str(path), trust_remote_code=args.trust_remote_code)
            tokenizer.chat_template = source.chat_template
    elif not tokenizer.chat_template and getattr(args, "default_chat_template", None) is not None:
        tokenizer.chat_template = args.default_chat_template
        say(
            f"tokenizer {args.tokenizer_name!r} has no chat template: the recipe's default one is set on it (the "
            "handbook's dataset_mixer format does so), and saved with the model"
        )
    if eos is not None:
        token_id = tokenizer.convert_tokens_to_ids(eos)
        if token_id is None or token_id == tokenizer.unk_token_id:
            raise RecipeError(
                f"eos_token {eos!r} is not a token of tokenizer {args.tokenizer_name!r}: give one of its "
                "tokens (the one that ends a turn in its chat template)"
            )
        tokenizer.eos_token = eos
    return tokenizer


def align_generation_eos(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, args: ModelArguments) -> None:
    """With a recipe's eos_token, the model's config and generation config end where it does (the handbook's sft.py
    does the same before saving): generate() of the saved model stops at the end of a turn. Without one, the model's
    own ends stay (a hub model's generation config may list several)."""
    if getattr(args, "eos_token", None) is None or tokenizer.eos_token_id is None:
        return
    model.config.eos_token_id = tokenizer.eos_token_id
    if getattr(model, "generation_config", None) is not None:
        model.generation_config.eos_token_id = tokenizer.eos_token_id
