"""TrainingArguments' fields declared ``dict | str`` (DICT_VALUED): what each takes, read as TrainingArguments reads
it (a recipe's mapping, JSON text, or a JSON file for accelerator_config and fsdp_config), and a check that it names
only what its consumer takes, before TrainingArguments would raise on every rank."""

from __future__ import annotations

import json
import os
from pathlib import Path

from fsdp_recipes.bounded import MAX_DEPTH, MAX_VALUES, YAML_LIMIT, load_json
from fsdp_recipes.errors import RecipeError, UnreadableFile

# TrainingArguments' fields declared dict | str (but deepspeed, refused), which it also takes as JSON text (the form a
# flag and our parser carry): a recipe's mapping becomes that text, its keys checked where nothing later would
DICT_VALUED = (
    "accelerator_config",
    "activation_checkpointing_kwargs",
    "fsdp_config",
    "gradient_checkpointing_kwargs",
    "lr_scheduler_kwargs",
)
CHECKPOINT_KWARGS = ("activation_checkpointing_kwargs", "gradient_checkpointing_kwargs")


def mapping_of(key: str, value, example: str | None = None) -> dict | None:
    """A dict-valued TrainingArguments field's mapping, read as TrainingArguments reads it: JSON text (``{...}``), or,
    where ``example`` names a file it takes (accelerator_config, fsdp_config), a JSON file, read within bounds.
    None for None; anything else is a RecipeError naming the key."""
    if value is None or isinstance(value, dict):
        return value
    text = str(value)
    if text.lstrip().startswith("{"):
        try:
            mapping = json.loads(text)
        # JSONDecodeError, or an integer past 4300 digits
        except (ValueError, RecursionError) as err:
            raise RecipeError(f"--{key} is not valid JSON ({err}): give a JSON object") from None
    elif example is None:
        raise RecipeError(f"--{key} {text!r} is not a JSON object: give one, e.g. '{{}}'")
    elif not os.path.lexists(text):
        raise RecipeError(f"--{key} {text!r} does not exist: give a JSON file such as {example}, or JSON text")
    # a folder, FIFO, device or broken link: bounded names what it is
    else:
        try:
            mapping = load_json(Path(text), f"--{key}", YAML_LIMIT)
        except UnreadableFile as err:
            raise RecipeError(str(err)) from None
    _check_shape(key, mapping)
    return mapping


def _check_shape(key: str, mapping: dict) -> None:
    """Nesting and size bounded as a recipe's are (bounded.MAX_DEPTH, MAX_VALUES): TrainingArguments reads the text
    again and converts it recursively, where a depth json.loads survived could still exhaust the stack."""
    stack, values = [(mapping, 1)], 0
    while stack:
        value, depth = stack.pop()
        if depth > MAX_DEPTH:
            raise RecipeError(f"--{key} nests deeper than {MAX_DEPTH} levels: give a flat mapping of settings")
        items = list(value.values()) if isinstance(value, dict) else value if isinstance(value, list) else []
        values += len(items) * (2 if isinstance(value, dict) else 1)
        if values > MAX_VALUES:
            raise RecipeError(f"--{key} holds more than {MAX_VALUES} values: give a mapping of its settings alone")
        stack.extend((item, depth + 1) for item in items)


def check_dict_valued(raw) -> None:
    """Each DICT_VALUED field but fsdp_config (fsdp_recipes.config.trainer_fsdp's), from a recipe's mapping, JSON text
    or (accelerator_config) a JSON file, read as TrainingArguments reads it, names only what it is given to
    (``_accepted``): another key would be a TypeError on every rank. A file's mapping is handed on as JSON text, so
    the file is read once, within bounds."""
    for key in DICT_VALUED:
        if key == "fsdp_config" or getattr(raw, key, None) is None:
            continue
        mapping = mapping_of(key, getattr(raw, key), "accelerator_config.json" if key == "accelerator_config" else None)
        setattr(raw, key, json.dumps(mapping))
        if (accepted := _accepted(key, raw.lr_scheduler_type)) is None:
            continue
        what, taken = accepted
        if other := sorted(set(mapping) - taken):
            named = ", ".join(other[:5]) + (f" and {len(other) - 5} more" if len(other) > 5 else "")
            raise RecipeError(f"{key}: {named} is not an argument of {what} (it takes {', '.join(sorted(taken))})")


def _accepted(key: str, scheduler) -> tuple[str, set[str]] | None:
    """What a DICT_VALUED mapping is given to and the names it takes: torch.utils.checkpoint's arguments (activation_
    and gradient_checkpointing_kwargs), the schedule's (lr_scheduler_kwargs), AcceleratorConfig's fields
    (accelerator_config). None where any name is passed on, or checked elsewhere (fsdp_config's, with --fsdp:
    fsdp_recipes.config.trainer_fsdp)."""
    import dataclasses
    import inspect

    if key == "fsdp_config":
        return None
    if key == "accelerator_config":
        from transformers.trainer_pt_utils import AcceleratorConfig

        return "transformers' AcceleratorConfig", {f.name for f in dataclasses.fields(AcceleratorConfig)}
    if key in CHECKPOINT_KWARGS:
        from torch.utils.checkpoint import checkpoint

        named = set(inspect.signature(checkpoint).parameters) - {"function", "args", "kwargs"}
        # the last from its **kwargs
        return "torch.utils.checkpoint.checkpoint", named | {"preserve_rng_state"}
    from transformers.optimization import TYPE_TO_SCHEDULER_FUNCTION
    from transformers.trainer_utils import SchedulerType

    try:
        function = TYPE_TO_SCHEDULER_FUNCTION[SchedulerType(scheduler or "linear")]
    except ValueError:
        # an unknown lr_scheduler_type: its own check names it
        return None
    parameters = inspect.signature(function).parameters
    if "kwargs" in parameters:
        # the schedule passes any keyword on
        return None
    named = set(parameters) - {"optimizer", "num_warmup_steps", "num_training_steps"}
    return f"the {scheduler or 'linear'} schedule", named
