"""The torchrun route: TrainingArguments' own ``--fsdp`` and ``--fsdp_config`` (no accelerate config file). Its
fsdp_config is checked against the keys TrainingArguments reads, which it otherwise ignores without a word."""

from __future__ import annotations

import functools

from transformers.trainer_utils import FSDPOption

from fsdp_recipes.compat import internals
from fsdp_recipes.config.accelerate_config import COMPILE_UNDER_FSDP1, compile_asked
from fsdp_recipes.config.dict_fields import mapping_of
from fsdp_recipes.config.flags import with_hints
from fsdp_recipes.config.recipe_checks import unsteppable_optimizer
from fsdp_recipes.console import say
from fsdp_recipes.errors import RecipeError


@functools.cache
def trainer_fsdp_keys() -> frozenset[str] | None:
    """The fsdp_config keys TrainingArguments reads, taken from its own code (``_process_fsdp_args``): every
    ``fsdp_config["key"]``, ``.get("key")``, ``.setdefault("key")`` and ``"key" in fsdp_config`` there. A key a newer
    transformers reads is accepted without a change here; one it stops reading is refused again. Keys may carry an
    "fsdp_" prefix (TrainingArguments strips it); keys starting with "_" are comments."""
    import inspect

    method = internals.get("transformers.training_args.TrainingArguments._process_fsdp_args")
    try:
        source = inspect.getsource(method)
    # an install without .py sources: the keys cannot be read, so they are not checked
    except (OSError, TypeError):
        say(
            "warning: transformers' source is not installed, so --fsdp_config keys are not checked against the ones "
            "TrainingArguments reads (a misspelt key would be ignored by it)"
        )
        return None
    keys = keys_read(source)
    # the method was rewritten in a way this reading no longer sees
    if len(keys) < 5:
        raise internals.problem(
            "transformers.training_args.TrainingArguments._process_fsdp_args",
            f" reading fsdp_config keys as this repository expects (found {sorted(keys)})",
        )
    return frozenset(keys)


def keys_read(source: str) -> set[str]:
    """The string keys a function's source reads from ``<anything>.fsdp_config``."""
    import ast
    import textwrap

    def is_config(node) -> bool:
        return isinstance(node, ast.Attribute) and node.attr == "fsdp_config"

    def text(node) -> str | None:
        return node.value if isinstance(node, ast.Constant) and isinstance(node.value, str) else None

    keys = set()
    for node in ast.walk(ast.parse(textwrap.dedent(source))):
        if isinstance(node, ast.Subscript) and is_config(node.value):
            keys.add(text(node.slice))
        elif (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and is_config(node.func.value)
            and node.args
        ):
            keys.add(text(node.args[0]))
        elif (
            isinstance(node, ast.Compare)
            and any(isinstance(op, ast.In) for op in node.ops)
            and is_config(node.comparators[0])
        ):
            keys.add(text(node.left))
    keys.discard(None)
    return keys


def fsdp_version(config: dict) -> int:
    """The FSDP version TrainingArguments._process_fsdp_args takes from an fsdp_config: its fsdp_-prefixed keys
    overwrite the plain ones, then int() of version, 2 where none is given."""
    stripped = dict(config)
    for key in list(stripped):
        if key.startswith("fsdp_"):
            stripped[key[5:]] = stripped.pop(key)
    try:
        version = int(stripped.get("version", 2))
    except (TypeError, ValueError, OverflowError):
        version = None
    if version not in (1, 2):
        raise RecipeError(f"fsdp_config's version is {stripped.get('version')!r}: give 2 (FSDP2, the default) or 1")
    return version


def unknown_fsdp_options(fsdp) -> list[str]:
    """The words of a string or list --fsdp that TrainingArguments refuses ("Unknown `fsdp` option"), by its rule:
    an FSDPOption, or a sharding strategy in any case. Checked before the launch's process count, which it would
    otherwise only reach after."""
    from accelerate.utils.constants import FSDP_SHARDING_STRATEGY

    words = fsdp.split() if isinstance(fsdp, str) else fsdp if isinstance(fsdp, list) else []
    options = {o.value for o in FSDPOption}
    return [w for w in map(str, words) if w not in options and w.upper() not in FSDP_SHARDING_STRATEGY]


def check_trainer_fsdp(raw) -> bool:
    """Normalise TrainingArguments' --fsdp (the torchrun route) and check its fsdp_config; True if FSDP is asked for.

    ``--fsdp true`` arrives as the string "true", which TrainingArguments rejects ("Unknown fsdp option"): it
    becomes True, the non-deprecated form. fsdp_config is a JSON file or JSON text (a recipe's mapping arrives as
    that text), as TrainingArguments reads it; a key it does not read, or fsdp_config without fsdp, is an error."""
    if isinstance(raw.fsdp, str) and raw.fsdp.lower() in ("true", "false", ""):
        raw.fsdp = raw.fsdp.lower() == "true" or None
    if unknown := unknown_fsdp_options(raw.fsdp):
        raise RecipeError(
            f"--fsdp {' '.join(unknown)}: not an option of TrainingArguments' fsdp; give true (the rest in "
            f"--fsdp_config) or some of {', '.join(o.value for o in FSDPOption)}"
        )
    if not raw.fsdp:
        # TrainingArguments reads it only with fsdp: the run would train without it, silently
        if raw.fsdp_config:
            raise RecipeError(
                "fsdp_config is read only with --fsdp (TrainingArguments' FSDP, for torchrun without accelerate): "
                "give --fsdp true, or drop fsdp_config (under accelerate launch the accelerate config's is in force)"
            )
        return False
    config = mapping_of("fsdp_config", raw.fsdp_config, "accelerate_configs/torchrun/zero3.json")
    if (keys := trainer_fsdp_keys()) is None:
        return True
    unknown = [k for k in (config or {}) if not k.startswith("_") and k.removeprefix("fsdp_") not in keys]
    if unknown:
        raise RecipeError(
            f"fsdp_config has key(s) TrainingArguments would silently ignore: "
            f"{with_hints(unknown, keys, 'fsdp_', accelerate=False)}; its keys: {', '.join(sorted(keys))} "
            "(accelerate_configs/torchrun/zero3.json is zero3.yaml in them)"
        )
    version = fsdp_version(config or {})
    if version == 1 and (asked := compile_asked(vars(raw))):
        raise RecipeError(f'{asked} {COMPILE_UNDER_FSDP1[0]}; fix: compile under FSDP2 ("version": 2 in --fsdp_config)')
    if version == 2 and (problem := unsteppable_optimizer(getattr(raw, "optim", None))):
        raise RecipeError(f'--optim {problem[0]}; fix: {problem[1]} (--fsdp_config with "version": 1)')
    return True
