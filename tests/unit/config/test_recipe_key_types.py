"""Every recipe key, generated from the parser itself: a value of the wrong type (a mapping or a list where one
value belongs, a word where a flag's true/false belongs, a choice that is not one) is one RecipeError line naming
the key, raised by parse_args before anything starts; never a traceback, argparse's usage or a value taken as is."""

from __future__ import annotations

import datetime

import pytest
import yaml

from fsdp_recipes.config.flags import LIST_VALUED, TEXT_OR_BOOL
from fsdp_recipes.config.parse import parse_args
from fsdp_recipes.errors import RecipeError

NO_FSDP = ["--allow_no_fsdp", "true"]


def _parser():
    """The parser parse_args builds (its actions are what a recipe key may name)."""
    from transformers import HfArgumentParser, TrainingArguments

    from fsdp_recipes.config.arguments import DataArguments
    from fsdp_recipes.config.model_arguments import ModelArguments
    from fsdp_recipes.config.run_arguments import RunArguments

    return HfArgumentParser((ModelArguments, DataArguments, RunArguments, TrainingArguments))


def _typed_actions() -> dict:
    """One action per key: the typed --name of a true-by-default flag, not its untyped --no_name twin."""
    actions = {}
    for a in _parser()._actions:
        if a.option_strings and a.dest != "help" and (a.dest not in actions or actions[a.dest].type is None):
            actions[a.dest] = a
    return actions


ACTIONS = _typed_actions()


def _wrong_values(action) -> list:
    many = action.nargs in ("+", "*")
    values = [{"nested": 1}] + ([] if many else [[1, 2]])
    if action.choices:
        values.append("not-a-choice")
    if action.type is not None and getattr(action.type, "__name__", "") in ("int", "float"):
        values.append("twelve")
    if getattr(action.type, "__name__", "") in ("string_to_bool", "strtobool"):
        values.append("maybe")
    if action.type is str and action.dest not in TEXT_OR_BOOL and action.dest not in LIST_VALUED:
        # YAML's int, bool or date where text belongs (one per key, in turn: one check refuses them all)
        values.append((5, True, datetime.date(2024, 1, 1))[len(action.dest) % 3])
    return values


CASES = [(key, value) for key, action in sorted(ACTIONS.items()) for value in _wrong_values(action)]


def test_cases_cover_every_key():
    assert {key for key, _ in CASES} == set(ACTIONS) and len(ACTIONS) > 100


@pytest.mark.parametrize("key, value", CASES, ids=[f"{k}={v!r}"[:60] for k, v in CASES])
def test_a_wrong_type_in_a_recipe_is_one_line(tmp_path, key, value):
    recipe = tmp_path / "r.yaml"
    recipe.write_text(
        yaml.safe_dump({"config_name": "assets/tiny-llama", "train_file": "assets/data/tiny_corpus.txt", key: value})
    )
    with pytest.raises(RecipeError) as err:
        parse_args([str(recipe), "--output_dir", str(tmp_path / "o"), *NO_FSDP])
    message = str(err.value)
    assert "\n" not in message and key in message, message


FLAG_CASES = [
    (key, "maybe" if getattr(a.type, "__name__", "") in ("string_to_bool", "strtobool") else "not-a-choice")
    for key, a in sorted(ACTIONS.items())
    if getattr(a.type, "__name__", "") in ("string_to_bool", "strtobool") or (a.choices and a.nargs not in ("+", "*"))
]


@pytest.mark.parametrize("key, value", FLAG_CASES, ids=[f"--{k} {v}" for k, v in FLAG_CASES])
def test_a_wrong_word_for_a_flag_is_one_line(tmp_path, key, value):
    with pytest.raises(RecipeError) as err:
        parse_args(
            ["--config_name", "assets/tiny-llama", "--output_dir", str(tmp_path / "o"), *NO_FSDP, f"--{key}", value]
        )
    message = str(err.value)
    assert "\n" not in message and key in message, message


NULL_CASES = sorted(key for key, a in ACTIONS.items() if a.default is not None)


def test_null_cases_cover_the_keys_with_a_default():
    assert len(NULL_CASES) > 80 and "async_checkpoints" in NULL_CASES and "learning_rate" in NULL_CASES


@pytest.mark.parametrize("key", NULL_CASES)
def test_null_for_a_key_with_a_default_is_one_line(tmp_path, key):
    """`key: null` in a recipe became the value None, replacing the default without a word: a true-by-default bool
    read as false (async_checkpoints: null turned background saves off), a number as missing."""
    recipe = tmp_path / "r.yaml"
    recipe.write_text(
        yaml.safe_dump({"config_name": "assets/tiny-llama", "train_file": "assets/data/tiny_corpus.txt", key: None})
    )
    with pytest.raises(RecipeError) as err:
        parse_args([str(recipe), "--output_dir", str(tmp_path / "o"), *NO_FSDP])
    message = str(err.value)
    own = {"block_size": "block_size (TRL's max_length) is null: TRL's no-truncation has no equivalent here"}
    assert "\n" not in message and message.startswith(own.get(key, f"recipe key {key}: null is not a value here")), (
        message
    )


@pytest.mark.parametrize("key, value", [("resume_from_checkpoint", True), ("packing", True), ("packing", False)])
def test_true_or_false_where_a_text_field_means_it_parses(tmp_path, key, value):
    """resume_from_checkpoint: true (the newest checkpoint) and TRL's packing: true are YAML bools for text fields."""
    recipe = tmp_path / "r.yaml"
    recipe.write_text(
        yaml.safe_dump({"config_name": "assets/tiny-llama", "train_file": "assets/data/tiny_chat.jsonl", key: value})
    )
    _, _, plan = parse_args([str(recipe), "--output_dir", str(tmp_path / "o"), *NO_FSDP])
    assert getattr(plan.raw, key) is value


# keys whose value is refused by a check of their own first (a mixture's shape, DeepSpeed)
OWN_LINE = {"dataset_mixture", "deepspeed"}


def _choices(key) -> list[str]:
    return list(map(str, ACTIONS[key].choices or ()))


YAML_BOOL_CASES = [
    (key, word)
    for key, a in sorted(ACTIONS.items())
    if (a.choices or (a.type is str and key not in TEXT_OR_BOOL)) and a.nargs not in ("+", "*")
    if not {"true", "false"} & set(_choices(key)) and key not in OWN_LINE
    for word in ("no", "on")
]


@pytest.mark.parametrize("key, word", YAML_BOOL_CASES, ids=[f"{k}: {w}" for k, w in YAML_BOOL_CASES])
def test_an_unquoted_yaml_word_read_as_a_bool_where_text_belongs_says_to_quote_it(tmp_path, key, word):
    """`eval_strategy: no` is the bool false to YAML: the line says so, and to quote it where the word is a value
    there, or lists the choices where it is not (`hub_strategy: no`)."""
    recipe = tmp_path / "r.yaml"
    base = {"config_name": "assets/tiny-llama", "train_file": "assets/data/tiny_corpus.txt"}
    # unquoted, as written by hand
    recipe.write_text("".join(f"{k}: {v}\n" for k, v in {**base, key: word}.items()))
    with pytest.raises(RecipeError) as err:
        parse_args([str(recipe), "--output_dir", str(tmp_path / "o"), *NO_FSDP])
    message, choices = str(err.value), _choices(key)
    read = {"no": "False is YAML's reading of an unquoted false, no or off", "on": "True is YAML's reading of an "}
    assert message.startswith(f"recipe key {key}: {read[word]}"), message
    if not choices:
        assert message.endswith(": quote it"), message
    elif word == "no" and "no" in choices:
        assert message.endswith(f": quote it ({key}: 'no')"), message
    # quoting the word would be refused too: the line does not say to
    else:
        assert "quote it" not in message and message.endswith(f"give one of {', '.join(choices)}"), message


def test_yaml_bool_cases_include_the_strategies_and_text_fields():
    cases = set(YAML_BOOL_CASES)
    assert {("eval_strategy", "no"), ("save_strategy", "no"), ("lr_scheduler_type", "on")} <= cases
    assert {("model_name_or_path", "on"), ("report_to", "no")} <= cases
    assert not [k for k, _ in cases if k in TEXT_OR_BOOL]
