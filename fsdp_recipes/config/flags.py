"""Flags and recipe values checked the way argparse would, but as one line naming the key and the fix: argparse
itself prints its whole usage (hundreds of lines, once per rank) and exits 2; recipe values bypass it entirely."""

from __future__ import annotations

import argparse
import functools

from fsdp_recipes.errors import RecipeError


def check_flags(argv: list[str], parser) -> None:
    """An unknown flag is one line with the closest known one (argparse would print its 120-line usage per rank)."""
    options = {s for action in parser._actions for s in action.option_strings}
    unknown = [a.split("=", 1)[0] for a in argv if a.startswith("--") and a.split("=", 1)[0] not in options]
    if unknown:
        names = {o.removeprefix("--") for o in options}
        raise RecipeError(
            f"unknown flag(s): {with_hints([u.removeprefix('--') for u in unknown], names)}; see `train_fsdp.py --help`"
        )


# what a value-taking flag wants, where its type alone says too little
VALUE_HINTS = {
    "resume_from_checkpoint": "true (the newest checkpoint in output_dir) or a checkpoint-N folder",
    "output_dir": "the folder to write the run to",
}


def _bare(argv: list[str], i: int) -> bool:
    """``argv[i]`` (a flag without =value) is followed by no value: the end, or the next flag."""
    return i + 1 == len(argv) or argv[i + 1].startswith("--")


def check_missing_values(argv: list[str], parser) -> None:
    """A flag that takes a value, given none (``--max_steps`` last, ``--output_dir --bf16 true``): one line naming
    it. argparse would print its usage per rank, or the repeat check would compare the flag with an empty value."""
    actions = {s: a for a in parser._actions for s in a.option_strings if a.nargs in (None, "+")}
    for i, arg in enumerate(argv):
        if (action := actions.get(arg)) is None or not _bare(argv, i):
            continue
        if action.dest in VALUE_HINTS:
            kind = VALUE_HINTS[action.dest]
        elif action.choices is not None:
            kind = f"one of {', '.join(map(str, action.choices))}"
        elif action.type in (int, float):
            kind = "a whole number" if action.type is int else "a number"
        else:
            kind = "one or more values" if action.nargs == "+" else "a value"
        raise RecipeError(f"{action.dest} has no value: give {kind} after {arg}")


def bare_flags_as_values(argv: list[str], parser) -> list[str]:
    """argv with each bare true/false flag (``--use_peft``, ``--packing``: HfArgumentParser's and TRL's way to say
    true) written with its value, ``--use_peft=true``: a flag given bare and then with true is then the same value
    to the repeat check, as it is to argparse."""
    optional = {s: a for a in parser._actions for s in a.option_strings if a.nargs == "?" and a.const is not None}
    out = list(argv)
    for i, arg in enumerate(argv):
        if (action := optional.get(arg)) is None or not _bare(argv, i):
            continue
        word = str(action.const).lower()
        try:
            same = action.type is not None and action.type(word) == action.const
        except (TypeError, ValueError, argparse.ArgumentTypeError):
            same = False
        if same:  # a const no word spells (TrainingArguments' --fsdp: True, a str field) stays bare, for argparse
            out[i] = f"{arg}={word}"
    return out


def check_flag_values(argv: list[str], parser) -> None:
    """A number flag whose value is not a number is one line naming it (argparse would print its usage and exit
    with status 2 on every rank), as is a negative value argparse would take for a flag (-inf, -1e-4)."""
    actions = {s: a for a in parser._actions for s in a.option_strings if a.type in (int, float)}
    for i, arg in enumerate(argv):
        flag, eq, value = arg.partition("=")
        if (action := actions.get(flag)) is None:
            continue
        name, kind = action.dest, "a whole number" if action.type is int else "a number"
        if not eq:
            if i + 1 == len(argv) or argv[i + 1].startswith("--"):
                raise RecipeError(f"{name} has no value: give {kind} after --{name}")
            value = argv[i + 1]
            if value.startswith("-") and not _argparse_reads_as_value(value):
                raise RecipeError(f"{name}={value} would be read as a flag: write --{name}={value}")
        try:
            action.type(value)
        except ValueError:
            try:
                whole = float(value)
            except ValueError:
                whole = None
            hint = (
                f"write it as {int(whole)}"
                if action.type is int and whole is not None and whole.is_integer()
                else f"give {kind}"
            )
            raise RecipeError(f"{name}={value!r} is not {kind}: {hint}") from None


def check_flag_words(argv: list[str], parser) -> None:
    """A true/false flag given a word that is neither, or a flag given a value outside its choices: one line naming
    it (argparse would print its usage and exit with status 2 on every rank)."""
    actions = {s: a for a in parser._actions for s in a.option_strings if a.type not in (None, int, float) or a.choices}
    for i, arg in enumerate(argv):
        flag, eq, value = arg.partition("=")
        if (action := actions.get(flag)) is None:
            continue
        if not eq:
            if i + 1 == len(argv) or argv[i + 1].startswith("--"):
                continue  # bare: a true/false flag means true; a missing value is check_missing_values'
            value = argv[i + 1]
        try:
            converted = action.type(value) if action.type is not None else value
        except (TypeError, ValueError, argparse.ArgumentTypeError) as err:
            raise RecipeError(f"{action.dest}={value!r}: {str(err).rstrip('.')}") from None
        if (
            action.choices is not None
            and converted not in action.choices
            and str(converted) not in map(str, action.choices)
        ):
            raise RecipeError(f"{action.dest}={value!r} is not one of {', '.join(map(str, action.choices))}")


def _argparse_reads_as_value(text: str) -> bool:
    """Whether argparse takes ``--flag text`` with text as the value: which negative numbers it reads as numbers
    changed across Python versions (-1e-4 is a flag to 3.11's), so this asks a parser of this Python."""
    import argparse

    probe = argparse.ArgumentParser(add_help=False, exit_on_error=False)
    probe.add_argument("--x")
    try:
        probe.parse_args(["--x", text])
    except argparse.ArgumentError:
        return False
    return True


# TrainingArguments fields typed ``str`` (so one value as a flag) that take a list too, as recipes often write them
# (alignment-handbook's ``report_to: [wandb]``): a recipe value is passed on as it is, so a list of them is fine.
LIST_VALUED = {"report_to"}


# keys whose null means something in another tool's recipes, refused with that meaning named (DataArguments)
NULL_MEANS_MORE = {"block_size"}  # TRL's max_length: null, no truncation


def check_recipe_types(recipe: dict, parser) -> None:
    """Recipe values bypass argparse's conversion (they become defaults as they are): check them the same way."""
    actions = {}
    for a in parser._actions:  # a true-by-default flag has two: --name (typed) and --no_name (store_false, untyped)
        if a.dest not in actions or actions[a.dest].type is None:
            actions[a.dest] = a
    for key, value in recipe.items():
        action = actions[key]
        if value is None and action.default is not None and key not in NULL_MEANS_MORE:  # it would replace the default
            # with None: a true-by-default bool read as false, a number as missing
            raise RecipeError(
                f"recipe key {key}: null is not a value here (its default is {action.default!r}): give a value, "
                "or leave the key out for the default"
            )
        if value is None or action.type is None:
            continue
        many = action.nargs in ("+", "*") or key in LIST_VALUED
        values = value if many and isinstance(value, list) else [value]
        for v in values:
            if key in LIST_VALUED and not isinstance(v, str):
                raise RecipeError(f"recipe key {key}: {v!r} is not a name: give a name or a list of names")
            if isinstance(v, dict) and getattr(action.type, "__name__", None) == "JSON mapping":
                try:  # a YAML mapping is what the field takes (helptext.json_mapping reads the flag's JSON)
                    action.type(v)
                except ValueError as err:
                    raise RecipeError(f"recipe key {key}: {err}") from None
                continue
            if isinstance(v, (list, dict)):
                raise RecipeError(
                    f"recipe key {key}: {value!r} is a {type(v).__name__}; give one "
                    f"{getattr(action.type, '__name__', 'value')}"
                )
            try:
                converted = action.type(str(v).lower() if isinstance(v, bool) else v if isinstance(v, str) else str(v))
            except (TypeError, ValueError, argparse.ArgumentTypeError) as err:  # string_to_bool raises the last
                raise RecipeError(
                    f"recipe key {key}: {v!r} is not a valid {getattr(action.type, '__name__', 'value')} ({err})"
                ) from None
            if (
                action.choices is not None
                and converted not in action.choices
                and str(converted) not in map(str, action.choices)
            ):
                raise RecipeError(f"recipe key {key}: {v!r} is not one of {', '.join(map(str, action.choices))}")


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


@functools.lru_cache(maxsize=1)  # a parser of ~100 options, built once for both callers
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
        dest = key.replace("-", "_")  # accelerate launch takes --config-file for --config_file
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
