"""A recipe's chat template and end-of-turn token (TRL's and the handbook's chat_template, chat_template_path and
eos_token) on the tokenizer, and the model's generation config told the same end, so that the saved model stops
generating at the end of its turn; and the handbook's defaults for a tokenizer without a chat template (its older
format's DEFAULT_CHAT_TEMPLATE, its current format's ChatML set-up)."""

from __future__ import annotations

from pathlib import Path

from transformers import AutoTokenizer, PreTrainedModel, PreTrainedTokenizerBase

from fsdp_recipes.bounded import JSON_LIMIT, read_text
from fsdp_recipes.ckpt.hub_source import is_local
from fsdp_recipes.config.model_arguments import ModelArguments
from fsdp_recipes.console import say
from fsdp_recipes.errors import RecipeError

# The ChatML set-up of the handbook's current sft.py (TRL's setup_chat_format, TRL 0.19 to 0.25): these turn markers
# as bos, eos (and pad) special tokens, and this template.
CHATML_START, CHATML_END = "<|im_start|>", "<|im_end|>"
CHATML_TEMPLATE = (
    "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + "
    "'\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def revision(args: ModelArguments, source: str | None) -> str | None:
    """model_revision for a hub id; None for a local folder (read as it is: the recipe's revision was said then)."""
    local = source is None or is_local(source)
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
    elif not tokenizer.chat_template and getattr(args, "default_chat_format", None) == "chatml":
        # the handbook sets the recipe's eos_token first and setup_chat_format then makes <|im_end|> the eos: the
        # only end the ChatML template writes, so the one generate() must stop at
        ignored = "" if eos in (None, CHATML_END) else f"; the recipe's eos_token {eos!r} gives way to it, as there"
        # the set-up's own, below
        eos = None
        new = [t for t in (CHATML_START, CHATML_END) if t not in tokenizer.get_vocab()]
        tokenizer.eos_token, tokenizer.pad_token, tokenizer.bos_token = CHATML_END, CHATML_END, CHATML_START
        tokenizer.add_special_tokens({"additional_special_tokens": [CHATML_START, CHATML_END]})
        tokenizer.chat_template = CHATML_TEMPLATE
        added = f"{', '.join(new)} added to its vocabulary and the model's embeddings" if new else "both its own"
        say(
            f"tokenizer {args.tokenizer_name!r} has no chat template: set up for ChatML, as the handbook's sft.py "
            f"does for its dataset_mixture recipes ({CHATML_START} and {CHATML_END} as bos and eos, {added}), and "
            f"saved with the model{ignored}"
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
    own ends stay (a hub model's generation config may list several). After the ChatML set-up (``chatml_set_up``),
    bos, eos and pad are the tokenizer's, as TRL's setup_chat_format sets them."""
    chatml = chatml_set_up(tokenizer, args)
    if (getattr(args, "eos_token", None) is None and not chatml) or tokenizer.eos_token_id is None:
        return
    names = ("eos_token_id", "bos_token_id", "pad_token_id") if chatml else ("eos_token_id",)
    for config in (model.config, getattr(model, "generation_config", None)):
        for name in names if config is not None else ():
            setattr(config, name, getattr(tokenizer, name))


def chatml_set_up(tokenizer: PreTrainedTokenizerBase, args: ModelArguments) -> bool:
    """Whether apply_recipe_tokens set the tokenizer up for ChatML (the recipe asked for it, and kept no template)."""
    return getattr(args, "default_chat_format", None) == "chatml" and tokenizer.chat_template == CHATML_TEMPLATE


def lora_growth_problem(tokenizer: PreTrainedTokenizerBase, args: ModelArguments) -> str | None:
    """Why LoRA cannot train after the ChatML set-up: the tokenizer is longer than the model's input embeddings,
    whose new rows LoRA would leave random and frozen, in no adapter-only checkpoint and not in the adapter, so a
    resume, a merge of a checkpoint and the adapter on its base would each lack them. The rows are the model's own,
    built from its config on the meta device (a config's vocab_size may be fewer, or nested), before any weight
    loads; None when nothing grows."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    if not getattr(args, "use_peft", False) or not chatml_set_up(tokenizer, args):
        return None
    source = args.model_name_or_path or args.config_name
    config = AutoConfig.from_pretrained(
        source, trust_remote_code=args.trust_remote_code, revision=revision(args, source)
    )
    try:
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config, trust_remote_code=args.trust_remote_code)
    except Exception:  # noqa: BLE001 (a config no causal LM builds from: the model's own load says why, in its words)
        return None
    rows = model.get_input_embeddings().weight.shape[0]
    if len(tokenizer) <= rows:
        return None
    return (
        f"tokenizer {args.tokenizer_name!r} has no chat template, and the ChatML set-up the recipe's format asks for "
        f"makes it {len(tokenizer)} tokens long, more than the model's {rows} embedding rows: LoRA would leave the new "
        "rows random and frozen, and its adapter cannot carry them; give a chat template (chat_template_path: a "
        ".jinja file or a tokenizer that has one), or train without use_peft"
    )


def fit_embeddings(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, args: ModelArguments) -> None:
    """After the ChatML set-up added tokens: the embeddings grown to the tokenizer (TRL's setup_chat_format resizes
    them too; transformers gives the new rows the mean of the others). A model on the meta device (a rank that
    receives rank 0's weights) gets rows of the same shape, their values filled by rank 0's."""
    rows = model.get_input_embeddings().weight.shape[0]
    if not chatml_set_up(tokenizer, args) or len(tokenizer) <= rows:
        return
    meta = model.get_input_embeddings().weight.is_meta
    # the mean cannot be taken on meta
    model.resize_token_embeddings(len(tokenizer), mean_resizing=not meta)
