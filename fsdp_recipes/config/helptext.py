"""The training script's parser and its ``--help``: argument groups (model, LoRA, data, run, the most used
TrainingArguments), with the rest of TrainingArguments' ~110 options behind ``--help-all``. Printed by local rank 0
alone: under ``accelerate launch`` every process parses the same flags, and help once per process is noise."""

from __future__ import annotations

import argparse
import json
import os
import sys
import typing

from transformers import HfArgumentParser, TrainingArguments

from fsdp_recipes.config import flags
from fsdp_recipes.config.arguments import DataArguments
from fsdp_recipes.config.model_arguments import ModelArguments
from fsdp_recipes.config.run_arguments import RunArguments
from fsdp_recipes.console import HelpFormatter

HELP_FLAGS = ("-h", "--help", "--help-all")

LORA = (
    "use_peft",
    "lora_r",
    "lora_alpha",
    "lora_dropout",
    "lora_target_modules",
    "load_in_4bit",
    "bnb_4bit_quant_type",
    "bnb_4bit_compute_dtype",
    "bnb_4bit_quant_storage",
    "use_bnb_nested_quant",
)

# Settings that TRL and handbook recipes carry and a command line rarely gives: listed by --help-all only
RECIPE_ONLY = (
    "model_revision",
    "chat_template_path",
    "dataset_mixture",
    "default_chat_template",
    "default_chat_format",
    "auto_insert_empty_system_msg",
)

# The TrainingArguments a recipe usually sets, in the order a reader looks for them.
COMMON_TRAINING = (
    "output_dir",
    "num_train_epochs",
    "max_steps",
    "per_device_train_batch_size",
    "per_device_eval_batch_size",
    "gradient_accumulation_steps",
    "learning_rate",
    "lr_scheduler_type",
    "warmup_steps",
    "weight_decay",
    "max_grad_norm",
    "optim",
    "bf16",
    "gradient_checkpointing",
    "logging_strategy",
    "logging_steps",
    "eval_strategy",
    "eval_steps",
    "save_strategy",
    "save_steps",
    "save_total_limit",
    "resume_from_checkpoint",
    "seed",
    "report_to",
    "push_to_hub",
    "hub_model_id",
    "hub_private_repo",
)

# TrainingArguments options whose stock help describes the Trainer's behaviour, which this script replaces
OUR_MEANING = {
    "push_to_hub": "upload the final model folder (and a LoRA adapter, under adapter/) to the hub once the run has "
    "finished, in one commit; checkpoints stay local (fsdp_recipes.config.hub_push) (default: %(default)s)",
    "hub_model_id": "the hub repository --push_to_hub uploads to (your-name/model-name; default: output_dir's "
    "name)%(default).0s",
    "per_device_train_batch_size": "sequences per process and micro-batch, or auto: the largest whose memory estimate "
    "fits 90%% of the GPU, chosen before the model loads (fsdp_recipes.config.batch_size) (default: %(default)s)",
}


class _Formatter(HelpFormatter):
    """Each option once: HfArgumentParser adds a dashed spelling of every flag (--output-dir next to --output_dir),
    which doubles the help without telling anything. TRL's aliases (--max_length) are kept."""

    def _format_action_invocation(self, action):
        shown = [
            s
            for s in action.option_strings
            if "-" not in s[2:] or s.replace("-", "_")[2:] not in {o[2:] for o in action.option_strings if o != s}
        ]
        action = argparse.Action(
            shown,
            action.dest,
            nargs=action.nargs,
            default=action.default,
            type=action.type,
            choices=action.choices,
            help=action.help,
            metavar=action.metavar,
        )
        return super()._format_action_invocation(action)


def json_mapping(value_type: type | None):
    """The type of a mapping-valued TrainingArguments field (liger_kernel_config: dict[str, bool]): JSON text on the
    command line, a mapping in a recipe, its values of ``value_type``. HfArgumentParser types such a field ``dict``,
    which cannot turn any text into a mapping."""

    def mapping(given) -> dict:
        value = json.loads(given) if isinstance(given, str) else given
        if not isinstance(value, dict):
            raise ValueError(f"{given!r} is not a mapping")
        for key, item in value.items():
            if value_type is not None and type(item) is not value_type:
                raise ValueError(f"{key}: {item!r} is not a {value_type.__name__}")
        return value

    # as argparse and check_recipe_types name the type in their errors
    mapping.__name__ = "JSON mapping"
    return mapping


def build_parser(show_all: bool = False) -> HfArgumentParser:
    parser = HfArgumentParser(
        (ModelArguments, DataArguments, RunArguments, TrainingArguments),
        usage="accelerate launch --config_file accelerate_configs/zero3.yaml train_fsdp.py [recipe.yaml] "
        "[--flag value ...]",
        description="Train a causal LM with FSDP. The optional first argument is a recipe YAML whose keys set the "
        "defaults of every argument below; flags override it (without a recipe: recipes/tiny-llama/pretrain.yaml). "
        "A model or data source given as a flag replaces the recipe's. Resume with --resume_from_checkpoint true "
        "(the newest complete checkpoint in output_dir) or a checkpoint-N folder. TRL's SFTConfig names are "
        "accepted where they mean the same (shown next to ours).",
        formatter_class=_Formatter,
        # --learn is no spelling of --learning_rate
        allow_abbrev=False,
        # flags.parse_flags says each refusal in one line
        exit_on_error=False,
    )
    for action in parser._actions:
        if action.type is dict or typing.get_origin(action.type) is dict:
            action.type = json_mapping(next(iter(typing.get_args(action.type)[1:]), None))
    flags.declare(parser)
    parser.add_argument("--help-all", action="help", help="show this help with every TrainingArguments option and exit")
    groups = {g.title: g for g in parser._action_groups}
    model = groups[ModelArguments._argument_group_name]
    model.title = "model"
    lora = parser.add_argument_group("LoRA and QLoRA (TRL's ModelConfig names)")
    common = parser.add_argument_group("training (the most used transformers TrainingArguments)")
    rest = parser.add_argument_group(
        "all other transformers TrainingArguments"
        if show_all
        else "other TrainingArguments: about 110 more transformers options, listed by --help-all"
    )
    by_dest = {a.dest: a for a in parser._actions}
    _move(model, lora, [by_dest[d] for d in LORA])
    default = parser._optionals
    _move(default, common, [by_dest[d] for d in COMMON_TRAINING])
    others = [a for a in default._group_actions if a.dest not in ("help", "help_all")]
    _move(default, rest, others)
    if not show_all:
        for action in [*others, *(by_dest[d] for d in RECIPE_ONLY)]:
            action.help = argparse.SUPPRESS
        parser.epilog = (
            f"{len(others)} more transformers TrainingArguments options (fsdp, optimizer, hub, logging "
            "details ...) are accepted too: --help-all lists them."
        )
    # HfArgumentParser gives --no_<flag> the whole help of --<flag> again
    for action in parser._actions:
        if (
            action.nargs == 0
            and action.const is False
            and action.option_strings[0].startswith("--no_")
            and action.help != argparse.SUPPRESS
        ):
            # %(default) in it: no "(default: False)" added
            action.help = f"the same as --{action.dest} false%(default).0s"
    # what the option does in this script, not in the stock Trainer
    for dest, text in OUR_MEANING.items():
        by_dest[dest].help = text
    data, run = groups[DataArguments._argument_group_name], groups[RunArguments._argument_group_name]
    parser._action_groups = [parser._positionals, default, model, lora, data, run, common, rest]
    return parser


def _move(source, target, actions) -> None:
    for action in actions:
        source._group_actions.remove(action)
        target._group_actions.append(action)


def wants_help(argv: list[str]) -> bool:
    return any(a in HELP_FLAGS for a in argv)


def quiet_unless_first(argv: list[str]) -> None:
    """Help asked under a launcher: local rank 0 prints it, the other processes exit 0 without a word."""
    if wants_help(argv) and os.environ.get("LOCAL_RANK", "0") != "0":
        sys.exit(0)
