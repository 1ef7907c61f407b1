"""Flags read by argparse itself, and recipe values converted by the same types, each refusal one line naming the
key and the fix: argparse alone prints its whole usage (hundreds of lines, once per rank) and exits 2, and recipe
values, which become its defaults, bypass its conversion."""

from __future__ import annotations

import argparse
import functools

from fsdp_recipes.errors import RecipeError


class Refused(argparse.ArgumentTypeError):
    """A text a flag's type refuses, as one line naming the field; ``why`` is what follows the value."""

    def __init__(self, dest: str, text, why: str):
        super().__init__(f"{dest}={text!r}{why}")
        self.why = why


def _why(convert, text, err) -> str:
    """What is wrong with ``text``, and the fix: a whole number written as a float is named with its digits."""
    if convert is int:
        try:
            whole = float(text)
        except ValueError:
            whole = None
        fix = f"write it as {int(whole)}" if whole is not None and whole.is_integer() else "give a whole number"
        return f" is not a whole number: {fix}"
    if convert is float:
        return " is not a number: give a number"
    return f": {str(err).rstrip('.')}"


def _checked(action):
    """``action``'s type, refusing a text (or a value outside its choices) with a Refused line: argparse quotes an
    ArgumentTypeError as it is, and check_recipe_types converts recipe values with the same type."""
    convert = action.type

    @functools.wraps(convert)
    def value(text):
        try:
            out = convert(text)
        # JSON nested too deep
        except (TypeError, ValueError, RecursionError, argparse.ArgumentTypeError) as err:
            raise Refused(action.dest, text, _why(convert, text, err)) from None
        if action.choices is not None and out not in action.choices and str(out) not in map(str, action.choices):
            raise Refused(action.dest, text, f" is not one of {', '.join(map(str, action.choices))}")
        return out

    return value


def by_option(parser) -> dict[str, argparse.Action]:
    """Every option string of ``parser`` (--output_dir, --output-dir, TRL's --max_length) -> its action."""
    return {s: action for action in parser._actions for s in action.option_strings}


def declare(parser) -> None:
    """Every typed flag of ``parser`` refuses a bad value in one line naming it (Refused)."""
    for action in parser._actions:
        if action.type is not None:
            action.type = _checked(action)


# what a value-taking flag wants, where its type alone says too little
VALUE_HINTS = {
    "resume_from_checkpoint": "true (the newest checkpoint in output_dir) or a checkpoint-N folder",
    "output_dir": "the folder to write the run to",
}


def parse_flags(parser, argv: list[str]):
    """``argv`` read by argparse itself (a parser built with ``exit_on_error=False``, ``allow_abbrev=False`` and
    declare'd types): (the namespace, what no flag took). Each refusal is one line naming the flag and the fix, where
    argparse would print its whole usage (hundreds of lines, once per rank) and exit 2."""
    try:
        return parser.parse_known_args(argv)
    except argparse.ArgumentError as err:
        action = next((a for a in parser._actions if "/".join(a.option_strings) == err.argument_name), None)
        # an error of no one flag (none is required here, but argparse may add such)
        if action is None:
            raise RecipeError(err.message) from None
        # no value, or one that starts with - and reads as a flag
        if err.message.startswith("expected"):
            raise RecipeError(_missing_value(action, argv)) from None
        if err.message.startswith("ignored explicit argument"):
            raise RecipeError(f"{action.dest} takes no value: give {action.option_strings[0]} alone") from None
        # a Refused line
        refused = err.message.startswith(f"{action.dest}=")
        raise RecipeError(err.message if refused else f"{action.dest}: {err.message}") from None


def _read_as_value(text: str) -> bool:
    """Whether argparse takes ``--flag text`` with text as the value: which negative numbers it reads as numbers
    changed across Python versions (-1e-4 is a flag to 3.11's), so this asks a parser of this Python."""
    probe = argparse.ArgumentParser(add_help=False, exit_on_error=False)
    probe.add_argument("--x")
    try:
        probe.parse_args(["--x", text])
    except argparse.ArgumentError:
        return False
    return True


def _missing_value(action, argv: list[str]) -> str:
    for i, arg in enumerate(argv):
        after = argv[i + 1] if i + 1 < len(argv) else "--"
        if arg in action.option_strings and after.startswith("-") and not _read_as_value(after):
            # -inf, -1e-4: argparse takes them for a flag
            if not after.startswith("--"):
                return f"{action.dest}={after} would be read as a flag: write --{action.dest}={after}"
            break
    else:
        arg = action.option_strings[0]
    if action.dest in VALUE_HINTS:
        kind = VALUE_HINTS[action.dest]
    elif action.choices is not None:
        kind = f"one of {', '.join(map(str, action.choices))}"
    elif getattr(action.type, "__wrapped__", None) in (int, float):
        kind = "a whole number" if action.type.__wrapped__ is int else "a number"
    else:
        kind = "one or more values" if action.nargs == "+" else "a value"
    return f"{action.dest} has no value: give {kind} after {arg}"


# TrainingArguments fields typed ``str`` (so one value as a flag) that take a list too, as recipes often write them
# (alignment-handbook's ``report_to: [wandb]``, ``fsdp: [full_shard, auto_wrap]``): a recipe value is passed on as
# it is, so a list of them is fine.
LIST_VALUED = {"report_to", "fsdp"}


# text fields where a recipe's true/false means something: TRL's packing (a bool there), TrainingArguments' fsdp,
# resume_from_checkpoint: true (the newest checkpoint, ckpt.resume.requested)
TEXT_OR_BOOL = {"packing", "fsdp", "resume_from_checkpoint"}


# keys whose null means something in another tool's recipes, refused with that meaning named (DataArguments)
# TRL's max_length: null, no truncation
NULL_MEANS_MORE = {"block_size"}


# the words YAML 1.1 (PyYAML) reads as a bool, unquoted
YAML_BOOLS = {True: "true, yes or on", False: "false, no or off"}


def check_recipe_types(recipe: dict, parser) -> None:
    """Recipe values bypass argparse's conversion (they become defaults as they are): each is converted by its
    flag's own type (declare), and refused in the same words."""
    actions = {}
    # a true-by-default flag has two: --name (typed) and --no_name (store_false, untyped)
    for a in parser._actions:
        if a.dest not in actions or actions[a.dest].type is None:
            actions[a.dest] = a
    for key, value in recipe.items():
        action = actions[key]
        # it would replace the default with None: a true-by-default bool read as false, a number as missing
        if value is None and action.default is not None and key not in NULL_MEANS_MORE:
            raise RecipeError(
                f"recipe key {key}: null is not a value here (its default is {action.default!r}): give a value, "
                "or leave the key out for the default"
            )
        if value is None or action.type is None:
            continue
        many = action.nargs in ("+", "*") or key in LIST_VALUED
        for v in value if many and isinstance(value, list) else [value]:
            # helptext.json_mapping
            mapping = isinstance(v, dict) and action.type.__name__ == "JSON mapping"
            if isinstance(v, (list, dict)) and not mapping:
                raise RecipeError(
                    f"recipe key {key}: {value!r} is a {type(v).__name__}; give one {action.type.__name__}"
                )
            text = action.type.__wrapped__ is str and key not in TEXT_OR_BOOL
            choices = list(map(str, action.choices or ()))
            # eval_strategy: no, which YAML 1.1 reads as false (packing: true means true)
            if isinstance(v, bool) and (text or choices) and str(v).lower() not in choices:
                read = f"recipe key {key}: {v!r} is YAML's reading of an unquoted {YAML_BOOLS[v]}"
                if not choices:
                    raise RecipeError(f"{read}: quote it")
                if not v and "no" in choices:
                    raise RecipeError(f"{read}: quote it ({key}: 'no')")
                # quoting would not help: the word written is not one of the choices either
                raise RecipeError(f"{read}, and none of these is a choice: give one of {', '.join(choices)}")
            if key in LIST_VALUED and not isinstance(v, str) and not (isinstance(v, bool) and key in TEXT_OR_BOOL):
                raise RecipeError(f"recipe key {key}: {v!r} is not a name: give a name or a list of names")
            if text and not isinstance(v, str):
                # YAML read 5 or 2024-01-01 where a name or path belongs: a path of it would be a TypeError
                raise RecipeError(f"recipe key {key}: {v!r} is a {type(v).__name__}; give text (quote it in YAML)")
            try:
                action.type(v if mapping or isinstance(v, str) else str(v).lower() if isinstance(v, bool) else str(v))
            # a mapping's problem is named inside it, without the whole value again
            except Refused as err:
                why = err.why.removeprefix(": ") if mapping else f"{v!r}{err.why}"
                raise RecipeError(f"recipe key {key}: {why}") from None


# TrainingArguments of transformers 4 that transformers 5 removed or renamed, which recipes and habits still carry:
# a spelling match would point elsewhere (logging_dir -> "did you mean logging_first_step?")
REPLACED = {
    "evaluation_strategy": "transformers 5 calls it eval_strategy",
    "group_by_length": "transformers 5 spells it --train_sampling_strategy group_by_length",
    "logging_dir": "transformers 5 reads TensorBoard's folder from the TENSORBOARD_LOGGING_DIR environment variable",
    "no_cuda": "transformers 5 calls it use_cpu",
    "per_gpu_train_batch_size": "transformers 5 calls it per_device_train_batch_size",
    "per_gpu_eval_batch_size": "transformers 5 calls it per_device_eval_batch_size",
    "push_to_hub_model_id": "transformers 5 calls it hub_model_id",
    "push_to_hub_organization": "transformers 5 takes the organization in hub_model_id: org/name",
    "push_to_hub_token": "transformers 5 calls it hub_token",
    "include_inputs_for_metrics": "transformers 5 spells it include_for_metrics: [inputs]",
    "include_tokens_per_second": "removed in transformers 5: tokens per second are logged on every run here",
    "torchdynamo": "transformers 5 calls it torch_compile_backend",
    "fsdp_min_num_params": "an FSDP setting: the accelerate config's fsdp_config takes it",
    "fsdp_transformer_layer_cls_to_wrap": "an FSDP setting: the accelerate config's fsdp_config takes it",
    "fp16_backend": "removed in transformers 5: mixed precision comes from the accelerate config",
    "half_precision_backend": "removed in transformers 5: mixed precision comes from the accelerate config",
    "save_safetensors": "removed in transformers 5: weights are always safetensors",
    "dispatch_batches": "transformers 5 takes it in accelerator_config",
    "split_batches": "transformers 5 takes it in accelerator_config",
    # accelerate launch's --gradient_clipping is DeepSpeed's; the Trainer clips every FSDP run by max_grad_norm
    "gradient_clipping": "the Trainer calls it max_grad_norm",
}


def known_accelerate_keys() -> tuple[set[str], set[str], set[str]]:
    """(top-level, fsdp_config, parallelism_config) keys that accelerate 1.15's config files take."""
    from accelerate.commands.config.config_args import ClusterConfig

    dests = accelerate_launch_options()
    return (
        set(ClusterConfig.__dataclass_fields__),
        {d for d in dests if d.startswith("fsdp_")},
        {d for d in dests if d.startswith("parallelism_config_")},
    )


# a parser of ~100 options, built once for both callers
@functools.lru_cache(maxsize=1)
def accelerate_launch_options() -> frozenset[str]:
    """The options of `accelerate launch` itself (config_file, num_processes, dynamo_backend, ...), by dest."""
    from accelerate.commands.launch import launch_command_parser

    dests = {a.dest for a in launch_command_parser()._actions}
    return frozenset(dests - {"help", "training_script", "training_script_args"})


def with_hints(unknown: list[str], known, prefix: str = "", accelerate: bool = True) -> str:
    """'key (did you mean known_key?), other' for an error message; ``prefix`` is ignored when matching. A
    transformers 4 name gets its transformers 5 replacement, and a key of accelerate's config (mixed_precision,
    num_processes, fsdp_*) where it goes, rather than a spelling match; ``accelerate=False`` where the keys are
    not accelerate's (TrainingArguments' fsdp_config), so that only the spelling of ``known`` is suggested."""
    import difflib

    top, fsdp, parallelism = known_accelerate_keys()
    launcher = accelerate_launch_options()
    section = {**dict.fromkeys(fsdp - top, "fsdp_config"), **dict.fromkeys(parallelism - top, "parallelism_config")}

    def hint(key: str) -> list[str]:
        # accelerate launch takes --config-file for --config_file
        dest = key.replace("-", "_")
        if accelerate and dest in REPLACED:
            return [REPLACED[dest]]
        if accelerate and dest in top | fsdp | parallelism:
            under = f" under {section[dest]}:" if dest in section else ""
            return [f"an accelerate config key: set it{under} in the file given to accelerate launch --config_file"]
        if accelerate and dest in launcher:
            return ["an option of accelerate launch: give it before train_fsdp.py"]
        return [f"did you mean {m}?" for m in difflib.get_close_matches(key.removeprefix(prefix), known, 1)]

    hints = [(k, hint(k)) for k in unknown]
    return ", ".join(f"{k} ({m[0]})" if m else k for k, m in hints)
