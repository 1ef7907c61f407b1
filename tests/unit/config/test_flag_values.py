"""Every flag of train_fsdp.py, generated from its parser: a value its type or choices refuse is one RecipeError line
naming the flag, raised by argparse's own parse (flags.parse_flags), never argparse's usage and exit 2."""

from __future__ import annotations

import pytest

from fsdp_recipes.config.flags import parse_flags
from fsdp_recipes.config.helptext import build_parser
from fsdp_recipes.errors import RecipeError

PARSER = build_parser(show_all=True)


def _bad_text(action) -> str | None:
    """A text ``action`` refuses (None: its type takes any text)."""
    convert = getattr(action.type, "__wrapped__", action.type)
    if action.choices:
        return "not-a-choice"
    if convert in (int, float):
        return "twelve"
    if getattr(convert, "__name__", "") == "string_to_bool":
        return "maybe"
    if getattr(convert, "__name__", "") == "JSON mapping":
        return "[1]"
    return None


CASES = [
    (a.option_strings[0], text)
    for a in PARSER._actions
    if a.option_strings and a.type is not None and (text := _bad_text(a)) is not None
]


def test_cases_cover_the_typed_flags():
    assert len(CASES) > 80, len(CASES)


@pytest.mark.parametrize("flag, text", CASES)
def test_a_value_a_flag_refuses_is_one_line_naming_it(flag, text):
    dest = next(a.dest for a in PARSER._actions if flag in a.option_strings)
    for argv in ([flag, text], [f"{flag}={text}"]):
        with pytest.raises(RecipeError) as err:
            parse_flags(PARSER, argv)
        assert str(err.value).startswith(f"{dest}={text!r}") and "\n" not in str(err.value), err.value


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--max_steps", "1e3"], "max_steps='1e3' is not a whole number: write it as 1000"),
        (["--weight_decay", "-1e-4"], "weight_decay=-1e-4 would be read as a flag: write --weight_decay=-1e-4"),
        (["--max_steps", "2", "--max_steps"], "max_steps has no value: give a whole number after --max_steps"),
        (["--no_remove_unused_columns=true"], "remove_unused_columns takes no value: give --no_remove_unused_columns"),
        # JSON deeper than Python's stack
        (["--liger_kernel_config", "[" * 50000], r"liger_kernel_config='\[\[\["),
    ],
)
def test_argparse_refusals_are_one_line_with_the_fix(argv, message):
    with pytest.raises(RecipeError, match=f"^{message}"):
        parse_flags(PARSER, argv)


def test_a_negative_number_is_a_value():
    assert parse_flags(PARSER, ["--max_steps", "-1", "--seed", "3"])[0].max_steps == -1


def test_what_no_flag_takes_is_named_in_one_line():
    from fsdp_recipes.config.trl_names import check_unknown_flags

    for extras, message in (
        (["--learnig_rate", "1"], "unknown flag(s): learnig_rate (did you mean learning_rate?)"),
        (["stray"], "'stray' follows no flag"),
        (["--", "--max_steps", "5"], "'--' ends the flags"),
    ):
        with pytest.raises(RecipeError) as err:
            check_unknown_flags(extras, PARSER)
        assert str(err.value).startswith(message) and "\n" not in str(err.value), err.value


def test_words_after_a_lone_double_dash_are_refused_as_such():
    from fsdp_recipes.config.trl_names import check_unknown_flags

    with pytest.raises(RecipeError, match="^'--' ends the flags"):
        check_unknown_flags(parse_flags(PARSER, ["--seed", "1", "--", "--max_steps", "5"])[1], PARSER)


def test_what_no_flag_takes_is_handed_back():
    """Unknown flags and stray words are fsdp_recipes.config.trl_names.check_unknown_flags' to name."""
    assert parse_flags(PARSER, ["--learnig_rate", "1", "stray"])[1] == ["--learnig_rate", "1", "stray"]
    # no abbreviation of --learning_rate
    assert parse_flags(PARSER, ["--learn", "1"])[1] == ["--learn", "1"]
