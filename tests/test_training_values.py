"""Numeric values that would train nothing, something other than asked, or nonsense: refused in one line that
names the field, in parse_args (before any process group), or warned where legitimate but surprising.

The cases are generated three ways, so that a wrong rule table cannot make its own test pass: values no numeric
field accepts (not a number, not finite), whatever the table says; verdicts written here by hand for the fields
whose meaning is plain; and the boundaries of each rule in the table."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest

from conftest import REPO
from fsdp_recipes.arguments import FINITE_ONLY, MAX_COUNT, VALUE_RULES, RecipeError, numeric_fields, parse_args, value_problem

NO_FSDP = ("--allow_no_fsdp", "true")  # parse_args in this process: no launcher, no FSDP config
NUMERIC = numeric_fields()
# What a field needs around it to be read at all: eval_steps only under eval_strategy steps, which needs eval data.
CONTEXT = {"eval_steps": ("--eval_strategy", "steps", "--validation_split_percentage", "10")}


@pytest.fixture(scope="module")
def out(tmp_path_factory):
    """One folder for the module: parse_args only reads, and hundreds of cases need no folder of their own."""
    return tmp_path_factory.mktemp("values")


def parse(folder, *argv):
    return parse_args([*argv, "--output_dir", str(folder / "o"), *NO_FSDP])


def refused(folder, field: str, value: str, *argv: str) -> str:
    """parse_args refuses ``--field=value`` (after ``argv``) with one RecipeError line naming the field."""
    with pytest.raises(RecipeError) as err:
        parse(folder, *CONTEXT.get(field, ()), *argv, f"--{field}={value}")
    message = str(err.value)
    assert "\n" not in message and f"{field}=" in message, message
    return message


def accepted(folder, field: str, value: str, *argv: str) -> None:
    parse(folder, *CONTEXT.get(field, ()), *argv, f"--{field}={value}")


def test_every_numeric_field_has_a_decision():
    """Every int or float field we expose has a rule, or is finite-only on purpose: a field a new transformers
    adds fails here until someone decides. The fields below are the ones whose meaning is plain: a rule each."""
    assert set(NUMERIC) == set(VALUE_RULES) | set(FINITE_ONLY), (
        f"without a decision: {sorted(set(NUMERIC) - set(VALUE_RULES) - set(FINITE_ONLY))}; "
        f"stale (no such numeric field): {sorted((set(VALUE_RULES) | set(FINITE_ONLY)) - set(NUMERIC))}"
    )
    assert not set(VALUE_RULES) & set(FINITE_ONLY)
    assert all(why.strip() for why in FINITE_ONLY.values())  # "on purpose" says why
    must_have_rules = {
        "max_steps", "num_train_epochs", "per_device_train_batch_size", "per_device_eval_batch_size",
        "gradient_accumulation_steps", "learning_rate", "weight_decay", "warmup_steps", "max_grad_norm", "adam_beta1",
        "adam_beta2", "adam_epsilon", "seed", "logging_steps", "eval_steps", "save_steps", "save_total_limit",
        "dataloader_num_workers", "block_size", "lora_r", "lora_dropout", "validation_split_percentage",
    }
    assert must_have_rules <= set(VALUE_RULES)
    assert len(NUMERIC) >= 30  # the derivation found the fields (dataclasses.fields, int and float types)


@pytest.mark.parametrize("value", ["nan", "inf", "abc", "True"])
@pytest.mark.parametrize("field", sorted(NUMERIC))
def test_no_numeric_field_takes_a_value_that_is_not_a_finite_number(field, value, out):
    """Whatever the table says: nan, inf, words and booleans are refused for every numeric field, by name."""
    refused(out, field, value)


@pytest.mark.parametrize("value", [".nan", "abc"])
@pytest.mark.parametrize("field", sorted(NUMERIC))
def test_recipe_values_that_are_not_finite_numbers(field, value, out):
    """The same through a recipe, whose values skip argparse (YAML's .nan is a float nan, abc a string)."""
    recipe = out / f"{field}-{value}.yaml"
    recipe.write_text(f"config_name: {REPO}/assets/tiny-llama\ntrain_file: {REPO}/assets/data/tiny_corpus.txt\n{field}: {value}\n")
    with pytest.raises(RecipeError) as err:
        parse_args([str(recipe), *CONTEXT.get(field, ()), "--output_dir", str(out / "o"), *NO_FSDP])
    assert "\n" not in str(err.value) and field in str(err.value), str(err.value)


# Written from what each value means, not from VALUE_RULES: (refused, accepted), as flags would give them.
BY_HAND = {
    "num_train_epochs": (["0", "-1", "1e30"], ["0.5", "3"]),
    "max_steps": (["-5", "-2", "0", str(2**63)], ["-1", "1", "1000"]),
    "per_device_train_batch_size": (["0", "-1"], ["1", "64"]),
    "per_device_eval_batch_size": (["0", "-3"], ["1", "16"]),
    "gradient_accumulation_steps": (["0", "-1"], ["1", "1000"]),  # 1000 against the data: check_run_length
    "learning_rate": (["-1e-4", "1e30", "11"], ["0", "2e-5", "1"]),
    "weight_decay": (["-0.1", "1e30"], ["0", "0.1"]),
    "warmup_steps": (["-1", "2.5", "1e30"], ["0", "0.1", "10"]),
    "max_grad_norm": (["-1"], ["0", "1.0", "1e30"]),
    "adam_beta1": (["-0.1", "1", "1.5"], ["0", "0.9"]),
    "adam_beta2": (["-0.1", "1"], ["0.999"]),
    "adam_epsilon": (["0", "-1e-8", "1e30"], ["1e-8", "1"]),
    "label_smoothing_factor": (["-0.1", "1"], ["0", "0.1"]),
    "seed": (["-1", str(2**32)], ["0", str(2**32 - 1)]),
    "data_seed": (["-1", str(2**32)], ["0", "1234"]),
    "logging_steps": (["0", "-5", "1.5"], ["0.1", "1", "10"]),
    "save_steps": (["0", "-1", "2.5"], ["0.5", "1", "100"]),
    "eval_steps": (["0", "-1", "6.5"], ["0.25", "6"]),
    "save_total_limit": (["0", "-1"], ["1", "5"]),
    "dataloader_num_workers": (["-1"], ["0", "2"]),
    "block_size": (["0", "-1", "1"], ["8", "256"]),
    "lora_r": (["0", "-1"], ["1", "16"]),
    "lora_dropout": (["-0.1", "1"], ["0", "0.5"]),
    "validation_split_percentage": (["0", "-1", "80", "100"], ["1", "50"]),
    "max_train_samples": (["0", "-1"], ["1"]),
    "eval_delay": (["-1"], ["0", "2"]),
}


@pytest.mark.parametrize("field", sorted(BY_HAND))
def test_verdicts_written_by_hand(field, out):
    wrong, right = BY_HAND[field]
    for value in wrong:
        refused(out, field, value)
    for value in right:
        accepted(out, field, value)


def _below(value, kind):
    return value - 1 if kind is int else value - max(abs(value) * 1e-6, 1e-9)


def _above(value, kind):
    return value + 1 if kind is int else value + max(abs(value) * 1e-6, 1e-9)


def _flag(value, kind) -> str:
    return str(int(value)) if kind is int else repr(float(value))


@pytest.mark.parametrize("field", sorted(VALUE_RULES))
def test_rule_boundaries(field, out):
    """Each rule's ends: an included end passes and one step beyond is refused; an excluded end is refused and one
    step inside passes. Integers beyond int64 are refused for every field; a float without an upper end (a clipping
    threshold, a weight decay) needs only be finite."""
    rule, kind = VALUE_RULES[field], NUMERIC[field]
    low = rule.low
    if rule.low_open:
        refused(out, field, _flag(low, kind))
        accepted(out, field, _flag(_above(low, kind), kind))
    else:
        accepted(out, field, _flag(low, kind))
        below = _below(low, kind)
        while below in rule.special:
            below = _below(below, kind)
        refused(out, field, _flag(below, kind))
    for special in rule.special:
        accepted(out, field, _flag(special, kind))
    if math.isfinite(rule.high) and rule.high < MAX_COUNT:
        if rule.high_open:
            refused(out, field, _flag(rule.high, kind))
            accepted(out, field, _flag(_below(rule.high, kind), kind))
        else:
            accepted(out, field, _flag(rule.high, kind))
            refused(out, field, _flag(_above(rule.high, kind), kind))
    elif kind is int:
        refused(out, field, str(MAX_COUNT + 1))
    elif rule.high == MAX_COUNT:  # a float count of steps or epochs
        refused(out, field, "1e19")
    if rule.fraction:
        accepted(out, field, "0.5")
        refused(out, field, "3.5")


def test_step_intervals_are_read_only_under_their_strategy(tmp_path):
    """save_steps 0 under save_strategy no is never read: allowed (it must still be a finite number). logging_steps
    is the evaluation interval too when eval_strategy is steps and eval_steps is unset."""
    accepted(tmp_path, "save_steps", "0", "--save_strategy", "no")
    refused(tmp_path, "save_steps", "nan", "--save_strategy", "no")
    accepted(tmp_path, "logging_steps", "0", "--logging_strategy", "no")
    evaluating = ("--eval_strategy", "steps", "--validation_split_percentage", "10", "--logging_strategy", "no")
    refused(tmp_path, "logging_steps", "0", *evaluating)
    accepted(tmp_path, "logging_steps", "0", *evaluating, "--eval_steps", "5")
    assert value_problem("save_steps", 0.0) is not None  # without the other values: read
    assert value_problem("save_steps", 0.0, SimpleNamespace(save_strategy="epoch")) is None


def test_flag_forms(tmp_path):
    """A value after a space reads like one after '=', but argparse takes -inf (or -1e-4) for a flag of its own:
    one line says how to write it. A whole number written as a float is named with its digits."""
    with pytest.raises(RecipeError, match=r"^max_steps=-5 is less than 1: give a positive number of optimizer steps, or -1 to train num_train_epochs$"):
        parse(tmp_path, "--max_steps", "-5")
    with pytest.raises(RecipeError, match=r"^weight_decay=-inf would be read as a flag: write --weight_decay=-inf$"):
        parse(tmp_path, "--weight_decay", "-inf")  # -1e-4 too, where argparse reads it as a flag (3.11 does)
    with pytest.raises(RecipeError, match=r"^max_steps='1e3' is not a whole number: write it as 1000$"):
        parse(tmp_path, "--max_steps", "1e3")
    with pytest.raises(RecipeError, match=r"^per_device_train_batch_size has no value"):
        parse(tmp_path, "--per_device_train_batch_size", "--max_steps", "5")
    with pytest.raises(RecipeError, match=r"^learning_rate=nan is not a finite number: give a rate such as 2e-5"):
        parse(tmp_path, "--learning-rate", "nan")  # argparse's dashed alias of the same flag
    assert parse(tmp_path, "--max_steps", "-1", "--num_train_epochs", "0.5")[2].raw.max_steps == -1


@pytest.mark.parametrize("argv, message", [
    (["--num_train_epochs", "0", "--max_steps", "-1"], "num_train_epochs=0 is not positive: give a positive number of epochs"),
    (["--max_steps=-5"], "max_steps=-5 is less than 1: give a positive number of optimizer steps, or -1 to train num_train_epochs"),
    (["--save_steps", "0"], "save_steps=0 is not positive: give a whole number of optimizer steps, or a fraction of the run below 1"),
    (["--learning_rate", "nan"], "learning_rate=nan is not a finite number"),
    (["--learning_rate", "inf"], "learning_rate=inf is not a finite number"),
    (["--per_device_train_batch_size", "0"], "per_device_train_batch_size=0 is less than 1"),
    (["--output_dir", ""], "output_dir='' is empty: give the folder to write the run to"),
    (["--output_dir", "  "], "output_dir='  ' is empty"),
    (["--learning_rate", "0.5", "--weight_decay", "2"], "weight_decay=2 with learning_rate=0.5 would multiply every weight by 1 - learning_rate x weight_decay = 0 each step"),
    (["--seed", "4294967296"], "seed=4294967296 is more than 4294967295: give a seed from 0 to 4294967295"),
])
def test_the_hostile_testers_cases(argv, message, tmp_path):
    """Each exited 0 (or printed a traceback) before: now one line, before anything starts."""
    with pytest.raises(RecipeError) as err:
        parse_args([*argv, *(["--output_dir", str(tmp_path / "o")] if "--output_dir" not in argv else []), *NO_FSDP])
    assert message in str(err.value) and "\n" not in str(err.value)


def test_refused_before_training_arguments_join_the_process_group(tmp_path, monkeypatch):
    from transformers import TrainingArguments

    def built(self):
        raise AssertionError("TrainingArguments was built before the input was checked")

    monkeypatch.setattr(TrainingArguments, "__post_init__", built)
    for argv in (["--learning_rate", "nan"], ["--max_steps=-5"], ["--save_steps", "0"], ["--output_dir", ""], ["--seed", "abc"]):
        with pytest.raises(RecipeError):
            parse_args([*argv, *NO_FSDP])


def test_legitimate_but_surprising_values_are_warned(tmp_path, capsys):
    """A warmup as long as the run never reaches the learning rate: a learning-rate range test does exactly that."""
    parse(tmp_path, "--max_steps", "120", "--warmup_steps", "120")
    assert "warning: warmup_steps=120 covers the whole run of 120 optimizer steps" in capsys.readouterr().err
    parse(tmp_path, "--max_steps", "120", "--warmup_steps", "119")
    parse(tmp_path, "--max_steps", "120", "--warmup_steps", "0.5")  # a fraction: half the run
    assert "warmup_steps" not in capsys.readouterr().err
    parse(tmp_path, "--learning_rate", "0", "--weight_decay", "1e6")  # no step at all: only the learning-rate warning
    assert "warning: learning_rate=0" in capsys.readouterr().err
