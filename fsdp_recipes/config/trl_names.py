"""TRL's names for our settings (trl.SFTConfig, ScriptArguments, ModelConfig), so a recipe written for TRL's
``sft.py`` runs here where its keys mean the same thing. The exact equivalents are extra spellings of our flags
(arguments.TRL_ALIASES, shown in --help); TRL's packing, packing_strategy, assistant_only_loss and
completion_only_loss are DataArguments fields that translate or refuse themselves. What TRL has and we do not is
named, all of it in one line, rather than dropped."""

from __future__ import annotations

import argparse
import itertools
import shlex

from fsdp_recipes.config import trl_recipe
from fsdp_recipes.config.arguments import TRL_ALIASES
from fsdp_recipes.config.flags import by_option, with_hints
from fsdp_recipes.errors import RecipeError

# TRL / alignment-handbook keys with no equivalent here, each with its reason (fsdp_recipes.config.trl_recipe, where
# their harmless values, TRL's defaults, are taken): a recipe or a flag holding another value is refused, naming them.
NO_EQUIVALENT = {key: reason for key, (_, reason) in trl_recipe.NO_EQUIVALENT.items()}


def rename_recipe_keys(recipe: dict) -> dict:
    """The recipe with TRL's spellings under our names; an alias and our name (or two aliases) giving different
    values is an error naming both."""
    out = {k: v for k, v in recipe.items() if k not in TRL_ALIASES}
    origin = {k: k for k in out}
    for alias, ours in TRL_ALIASES.items():
        if alias not in recipe:
            continue
        if ours in out and out[ours] != recipe[alias]:
            raise RecipeError(
                f"recipe keys {origin[ours]}: {out[ours]!r} and {alias}: {recipe[alias]!r} are the same "
                f"setting ({alias} is TRL's name for {ours}) with different values: keep one"
            )
        out[ours], origin[ours] = recipe[alias], alias
    return out


def check_flag_aliases(argv: list[str], parser) -> None:
    """One setting given twice with different values, by two spellings (``--max_length 512 --block_size 256``,
    ``--no_x`` and ``--x true``) or by the same flag (``--learning_rate 1e-3 ... --learning_rate 2e-3``, a flag
    appended to a long command): one line naming both (argparse would silently keep the last). Values are compared
    as the flag's type reads them, so the same value twice (``--use_peft`` and ``--use_peft true``, 5 and 05) passes;
    a flag missing its value is argparse's to name."""
    actions = {s: a for s, a in by_option(parser).items() if a.nargs in (None, "?", 0, "+", "*") and a.dest != "help"}
    seen: dict[str, tuple[str, str, object, list[str]]] = {}
    for i, arg in enumerate(argv):
        values: list[str] = []
        flag, eq, text = arg.partition("=")
        if (action := actions.get(flag)) is None:
            continue
        # a list: its values up to the next flag (argparse keeps the last list)
        if action.nargs in ("+", "*"):
            values = [text] if eq else list(itertools.takewhile(lambda a: not a.startswith("--"), argv[i + 1 :]))
            text, value = " ".join(values), tuple(_read(action, v) for v in values)
        else:
            if not eq:
                bare = action.nargs == 0 or i + 1 == len(argv) or argv[i + 1].startswith("--")
                if bare and action.nargs is None:
                    continue
                text = "" if bare else argv[i + 1]
            value = action.const if not text and action.nargs in ("?", 0) else _read(action, text)
        # the flag as a shell gives it: a value holding a space ('my label') is one value, and stays one when named
        typed = shlex.join([flag, *(v for v in values or [text] if v)])
        if (earlier := seen.get(action.dest)) and earlier[2] != value:
            what = f"the same setting ({action.dest})" if earlier[0] != flag else "given twice"
            fix = "give one"
            # what was likely meant: one list of both, each value as given
            if action.nargs in ("+", "*"):
                fix += f" list, e.g. {flag} {shlex.join(dict.fromkeys(earlier[3] + values))}"
            raise RecipeError(f"{earlier[1]} and {typed} are {what} with different values: {fix}")
        seen[action.dest] = (flag, typed, value, values)


def _read(action, text: str):
    """``text`` as the flag's type reads it; a text it refuses is argparse's to name, and compared as it is."""
    try:
        return action.type(text) if action.type is not None else text
    except argparse.ArgumentTypeError:
        return text


UNKNOWN_FIX = "remove them (see `train_fsdp.py --help`)"


def unknown_keys(unknown: list[str], known, kind: str = "key") -> str:
    """Every recipe key (or flag) that means nothing here, named: TRL's first, then the rest with hints."""
    trl = [k for k in unknown if k in NO_EQUIVALENT]
    other = [k for k in unknown if k not in NO_EQUIVALENT]
    parts = []
    if trl:
        parts.append(f"TRL {kind}(s) with no equivalent here: {', '.join(f'{k} ({NO_EQUIVALENT[k]})' for k in trl)}")
    if other:
        parts.append(f"unknown {kind}(s): {with_hints(other, known)}")
    return "; ".join(parts)


def unknown_keys_problem(unknown: list[str], known, what: str = "recipe", kind: str = "key") -> str:
    """One line naming every recipe key (or flag) that means nothing here (``unknown_keys``), and the fix."""
    return f"{what}: {unknown_keys(unknown, known, kind)}: {UNKNOWN_FIX}"


def check_unknown_flags(extras: list[str], parser) -> None:
    """What no flag of ``parser`` took (parse_flags): every unknown flag named in one line, a TRL flag with no
    equivalent as TRL's, the others with the closest known flag."""
    known = {s.removeprefix("--") for s in by_option(parser)}
    # argparse reads everything after a lone -- as positional (some versions drop the -- itself)
    if "--" in extras or any(a.startswith("--") and a.split("=", 1)[0][2:] in known for a in extras):
        raise RecipeError("'--' ends the flags, and train_fsdp.py takes no words after them: drop it")
    unknown = [a.split("=", 1)[0].removeprefix("--") for a in extras if a.startswith("--")]
    if set(unknown) & set(NO_EQUIVALENT):
        raise RecipeError(unknown_keys_problem(unknown, known, "flags", "flag"))
    if unknown:
        raise RecipeError(f"unknown flag(s): {with_hints(unknown, known)}; see `train_fsdp.py --help`")
    if extras:
        raise RecipeError(f"{extras[0]!r} follows no flag: give flags as --name value (a recipe YAML comes first)")
