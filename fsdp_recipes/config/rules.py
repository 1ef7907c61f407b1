"""The values a field of the argument dataclasses accepts, declared beside the fields: each dataclass's ``RULES``
(a Rule per numeric field) and its fields' ``choices``, checked in one pass by ``check`` in ``__post_init__``.
TrainingArguments is transformers': its rules are fsdp_recipes.config.values' table, checked the same way."""

from __future__ import annotations

import dataclasses
import math
import os
from dataclasses import dataclass

from fsdp_recipes.errors import RecipeError


@dataclass(frozen=True)
class Rule:
    """The values a numeric field accepts: from ``low`` to ``high`` (an end marked open is itself refused), plus
    ``special`` values with a meaning of their own (max_steps -1: train num_train_epochs). ``fraction``: a step
    count where transformers 5 reads a float in (0, 1) as a fraction of the run; from 1 up it must be a whole
    number. ``strategy``: the field is read only when that strategy is "steps" (otherwise only finite)."""

    low: float
    high: float
    # what to give instead: the part of the message after the colon
    fix: str
    low_open: bool = False
    high_open: bool = False
    special: tuple = ()
    fraction: bool = False
    strategy: str | None = None


INF = float("inf")


# the largest int64: whole numbers (counts, steps, sizes) beyond it overflow where torch keeps them
MAX_COUNT = 2**63 - 1


# Worker processes (dataloader_num_workers per training process, preprocessing_num_workers for datasets.map) are
# forked as asked: 100000 forked until the machine stopped. More than a few per core only queue for the cores, so
# the bound follows this machine (computed once, at import); 64 stays allowed on small machines, where a recipe
# written for a large node may still ask for that many.
CPUS = os.cpu_count() or 1


MAX_WORKERS = max(64, 4 * CPUS)


WORKERS_BOUND = f"at most {MAX_WORKERS}: max(64, 4 x the {CPUS} CPUs of this machine)"


def shown(value) -> str:
    """A number as a flag would give it: 0 rather than 0.0, 1e+30 as Python writes it."""
    if isinstance(value, float) and value.is_integer() and abs(value) < 1e16:
        return str(int(value))
    return str(value)


def _steps_strategy(raw, key: str) -> bool:
    value = getattr(raw, key, None)
    # a string from argparse, an enum from a caller
    return str(getattr(value, "value", value)).lower() == "steps"


def problem(name: str, value, rule: Rule | None, raw=None) -> str | None:
    """Why ``value`` is refused for the numeric field ``name`` (None: it is fine). Anything but a finite number,
    or an integer beyond int64, is refused for every field, with a rule or without; then the field's ``rule`` applies.
    ``raw`` (the other values) tells whether a step interval is read at all; without it, it is."""
    fix = rule.fix if rule else "give a finite number"
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return f"{name}={value!r} is not a number: {fix}"
    text = shown(value)
    if not math.isfinite(value):
        return f"{name}={text} is not a finite number: {fix}"
    if isinstance(value, int) and abs(value) > MAX_COUNT:
        return f"{name}={text} is beyond {MAX_COUNT}, the largest 64-bit integer: {fix}"
    if rule is None or value in rule.special:
        return None
    if rule.strategy and raw is not None and not _steps_strategy(raw, rule.strategy):
        # logging_steps is also the evaluation interval when eval_strategy is steps and eval_steps is unset
        if not (
            name == "logging_steps" and _steps_strategy(raw, "eval_strategy") and not getattr(raw, "eval_steps", None)
        ):
            return None
    if value < rule.low or (rule.low_open and value == rule.low):
        why = (
            ("is not positive" if rule.low == 0 else f"is not above {shown(rule.low)}")
            if rule.low_open
            else f"is less than {shown(rule.low)}"
        )
    elif value > rule.high or (rule.high_open and value == rule.high):
        why = f"is not below {shown(rule.high)}" if rule.high_open else f"is more than {shown(rule.high)}"
    elif rule.fraction and value > 1 and not float(value).is_integer():
        why = "is neither a fraction of the run (below 1) nor a whole number of steps"
    else:
        return None
    return f"{name}={text} {why}: {fix}"


def check(arguments) -> None:
    """One pass over an argument dataclass's declared rules: no text field empty or blank (none means anything so:
    an empty path is the folder you launch from, an empty name no dataset or token; an unset one is None), a text in
    its field's choices, a number within its Rule (``RULES``)."""
    for f in dataclasses.fields(arguments):
        value = getattr(arguments, f.name)
        if isinstance(value, str) and not value.strip():
            raise RecipeError(f"{f.name}={value!r} is empty: give a value, or leave it unset")
        choices = f.metadata.get("choices")
        # a non-text value is compared as a flag spells it (TRL's packing true); None only where it is the default
        if (
            choices
            and not (value is None and f.default is None)
            and (value if isinstance(value, str) else str(value).lower()) not in choices
        ):
            raise RecipeError(f"{f.name}={value!r} is not one of {', '.join(choices)}")
        if f.name in arguments.RULES and (why := problem(f.name, value, arguments.RULES[f.name])):
            raise RecipeError(why)
