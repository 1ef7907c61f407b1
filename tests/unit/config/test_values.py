"""Numeric values that would train nothing, something other than asked, or nonsense: refused in one line that
names the field, in parse_args (before any process group), or warned where legitimate but surprising.

The cases are generated three ways, so that a wrong rule table cannot make its own test pass: values no numeric
field accepts (not a number, not finite), whatever the table says; verdicts written here by hand for the fields
whose meaning is plain; and the boundaries of each rule in the table."""

from __future__ import annotations

import importlib.util
import math
import os
import sys
from types import SimpleNamespace

import pytest
from conftest import REPO

from fsdp_recipes.config.parse import parse_args
from fsdp_recipes.config.values import (
    FINITE_ONLY,
    MAX_COUNT,
    VALUE_RULES,
    batches_per_process,
    check_run_length,
    numeric_fields,
    steps_per_epoch,
    value_problem,
)
from fsdp_recipes.errors import RecipeError

# parse_args in this process: no launcher, no FSDP config
NO_FSDP = ("--allow_no_fsdp", "true")
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
    # "on purpose" says why
    assert all(why.strip() for why in FINITE_ONLY.values())
    must_have_rules = {
        "max_steps",
        "num_train_epochs",
        "per_device_train_batch_size",
        "per_device_eval_batch_size",
        "gradient_accumulation_steps",
        "learning_rate",
        "weight_decay",
        "warmup_steps",
        "max_grad_norm",
        "adam_beta1",
        "adam_beta2",
        "adam_epsilon",
        "seed",
        "logging_steps",
        "eval_steps",
        "save_steps",
        "save_total_limit",
        "dataloader_num_workers",
        "block_size",
        "lora_r",
        "lora_dropout",
        "validation_split_percentage",
    }
    assert must_have_rules <= set(VALUE_RULES)
    # the derivation found the fields (dataclasses.fields, int and float types)
    assert len(NUMERIC) >= 30


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
    recipe.write_text(
        f"config_name: {REPO}/assets/tiny-llama\ntrain_file: {REPO}/assets/data/tiny_corpus.txt\n{field}: {value}\n"
    )
    with pytest.raises(RecipeError) as err:
        parse_args([str(recipe), *CONTEXT.get(field, ()), "--output_dir", str(out / "o"), *NO_FSDP])
    assert "\n" not in str(err.value) and field in str(err.value), str(err.value)


# Written from what each value means, not from VALUE_RULES: (refused, accepted), as flags would give them.
BY_HAND = {
    "num_train_epochs": (["0", "-1", "1e30"], ["0.5", "3"]),
    "max_steps": (["-5", "-2", "0", str(2**63)], ["-1", "1", "1000"]),
    "per_device_train_batch_size": (["0", "-1"], ["1", "64"]),
    "per_device_eval_batch_size": (["0", "-3"], ["1", "16"]),
    # 1000 against the data: check_run_length
    "gradient_accumulation_steps": (["0", "-1"], ["1", "1000"]),
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
    # 100000 forked until the machine stopped
    "dataloader_num_workers": (["-1", "100000"], ["0", "2"]),
    "preprocessing_num_workers": (["0", "-1", "100000"], ["1", "4"]),
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
    # a float count of steps or epochs
    elif rule.high == MAX_COUNT:
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
    # without the other values: read
    assert value_problem("save_steps", 0.0) is not None
    assert value_problem("save_steps", 0.0, SimpleNamespace(save_strategy="epoch")) is None


def test_flag_forms(tmp_path):
    """A value after a space reads like one after '=', but argparse takes -inf (or -1e-4) for a flag of its own:
    one line says how to write it. A whole number written as a float is named with its digits."""
    with pytest.raises(
        RecipeError,
        match=r"^max_steps=-5 is less than 1: give a positive number of optimizer steps, or -1 to train "
        r"num_train_epochs$",
    ):
        parse(tmp_path, "--max_steps", "-5")
    with pytest.raises(RecipeError, match=r"^weight_decay=-inf would be read as a flag: write --weight_decay=-inf$"):
        # -1e-4 too, where argparse reads it as a flag (3.11 does)
        parse(tmp_path, "--weight_decay", "-inf")
    with pytest.raises(RecipeError, match=r"^max_steps='1e3' is not a whole number: write it as 1000$"):
        parse(tmp_path, "--max_steps", "1e3")
    with pytest.raises(RecipeError, match=r"^per_device_train_batch_size has no value"):
        parse(tmp_path, "--per_device_train_batch_size", "--max_steps", "5")
    with pytest.raises(RecipeError, match=r"^learning_rate=nan is not a finite number: give a rate such as 2e-5"):
        # argparse's dashed alias of the same flag
        parse(tmp_path, "--learning-rate", "nan")
    assert parse(tmp_path, "--max_steps", "-1", "--num_train_epochs", "0.5")[2].raw.max_steps == -1


@pytest.mark.parametrize(
    "argv, message",
    [
        (
            ["--num_train_epochs", "0", "--max_steps", "-1"],
            "num_train_epochs=0 is not positive: give a positive number of epochs",
        ),
        (
            ["--max_steps=-5"],
            "max_steps=-5 is less than 1: give a positive number of optimizer steps, or -1 to train num_train_epochs",
        ),
        (
            ["--save_steps", "0"],
            "save_steps=0 is not positive: give a whole number of optimizer steps, or a fraction of the run below 1",
        ),
        (["--learning_rate", "nan"], "learning_rate=nan is not a finite number"),
        (["--learning_rate", "inf"], "learning_rate=inf is not a finite number"),
        (["--per_device_train_batch_size", "0"], "per_device_train_batch_size=0 is less than 1"),
        (["--output_dir", ""], "output_dir='' is empty: give the folder to write the run to"),
        (["--output_dir", "  "], "output_dir='  ' is empty"),
        (
            ["--learning_rate", "0.5", "--weight_decay", "2"],
            "weight_decay=2 with learning_rate=0.5 would multiply every weight by 1 - learning_rate x "
            "weight_decay = 0 each step",
        ),
        (["--seed", "4294967296"], "seed=4294967296 is more than 4294967295: give a seed from 0 to 4294967295"),
    ],
)
def test_values_out_of_range_are_one_line_before_anything_starts(argv, message, tmp_path):
    """Each is one line before anything starts, not a run that exits 0 or a traceback."""
    with pytest.raises(RecipeError) as err:
        parse_args([*argv, *(["--output_dir", str(tmp_path / "o")] if "--output_dir" not in argv else []), *NO_FSDP])
    assert message in str(err.value) and "\n" not in str(err.value)


def test_refused_before_training_arguments_join_the_process_group(tmp_path, monkeypatch):
    from transformers import TrainingArguments

    def built(self):
        raise AssertionError("TrainingArguments was built before the input was checked")

    monkeypatch.setattr(TrainingArguments, "__post_init__", built)
    for argv in (
        ["--learning_rate", "nan"],
        ["--max_steps=-5"],
        ["--save_steps", "0"],
        ["--output_dir", ""],
        ["--seed", "abc"],
    ):
        with pytest.raises(RecipeError):
            parse_args([*argv, *NO_FSDP])


def test_legitimate_but_surprising_values_are_warned(tmp_path, capsys):
    """A warmup as long as the run never reaches the learning rate: a learning-rate range test does exactly that."""
    parse(tmp_path, "--max_steps", "120", "--warmup_steps", "120")
    assert "warning: warmup_steps=120 covers the whole run of 120 optimizer steps" in capsys.readouterr().err
    parse(tmp_path, "--max_steps", "120", "--warmup_steps", "119")
    # a fraction: half the run
    parse(tmp_path, "--max_steps", "120", "--warmup_steps", "0.5")
    assert "warmup_steps" not in capsys.readouterr().err
    # no step at all: only the learning-rate warning
    parse(tmp_path, "--learning_rate", "0", "--weight_decay", "1e6")
    assert "warning: learning_rate=0" in capsys.readouterr().err


# ---------- the checks that need the training set's size (train_fsdp.py, before the Trainer is built) ----------


@pytest.mark.parametrize(
    "examples, batch, processes, drop_last, batches",
    [
        # ceil(100 / 8)
        (100, 8, 1, False, 13),
        # 13 batches over 2 processes: one wraps around
        (100, 8, 2, False, 7),
        # 12 full batches, 6 each
        (100, 8, 2, True, 6),
        # 10 batches: 4, 3 + 1 wrapped, 3 + 1 wrapped
        (37, 4, 3, False, 4),
        # 9 full batches
        (37, 4, 3, True, 3),
        (16, 8, 2, False, 1),
        # one full batch for two processes: dropped
        (10, 8, 2, True, 0),
        (1, 8, 4, False, 1),
    ],
)
def test_batches_per_process(examples, batch, processes, drop_last, batches):
    assert batches_per_process(examples, batch, processes, drop_last) == batches


def test_batches_per_process_is_what_accelerate_deals_out():
    """Against accelerate's own sharding of a DataLoader (no process group needed to build one)."""
    import torch
    from accelerate.data_loader import prepare_data_loader
    from torch.utils.data import DataLoader

    for examples in (1, 7, 37, 64, 100):
        for batch in (1, 4, 8):
            for processes in (1, 2, 3, 4):
                for drop_last in (False, True):
                    loader = DataLoader(list(range(examples)), batch_size=batch, drop_last=drop_last)
                    lengths = {
                        len(
                            prepare_data_loader(
                                loader,
                                torch.device("cpu"),
                                num_processes=processes,
                                process_index=p,
                                put_on_device=False,
                            )
                        )
                        for p in range(processes)
                    }
                    assert lengths == {batches_per_process(examples, batch, processes, drop_last)}, (
                        examples,
                        batch,
                        processes,
                        drop_last,
                    )


@pytest.mark.parametrize(
    "batches, accumulation, steps", [(10, 1, 10), (10, 3, 4), (20, 10, 2), (21, 10, 3), (10, 1000, 1), (1, 1, 1)]
)
def test_steps_per_epoch_as_the_trainer_counts_them(batches, accumulation, steps):
    assert steps_per_epoch(batches, accumulation) == steps


def run_args(**kw):
    """The TrainingArguments fields check_run_length reads (train_fsdp.py passes the real object)."""
    from transformers import TrainingArguments

    values = {
        "per_device_train_batch_size": 8,
        "world_size": 2,
        "gradient_accumulation_steps": 1,
        "dataloader_drop_last": False,
        "max_steps": -1,
        "num_train_epochs": 3.0,
        "warmup_steps": 0,
        "learning_rate": 3e-3,
    } | kw
    # the same names as the real thing
    assert all(hasattr(TrainingArguments, k) for k in values)
    return SimpleNamespace(**values)


def test_accumulation_longer_than_an_epoch_is_refused():
    """100 examples, 8 per process, 2 processes: 7 micro-batches each an epoch. Accumulating 1000 would make every
    optimizer step average 7: under 1% of what was asked."""
    with pytest.raises(RecipeError) as err:
        check_run_length(run_args(gradient_accumulation_steps=1000), 100)
    assert str(err.value) == (
        "gradient_accumulation_steps=1000 is more than the 7 micro-batches an epoch gives each process (100 examples / "
        "(per_device_train_batch_size=8 x 2 processes)): every optimizer step would average 7 instead of 1000: use "
        "gradient_accumulation_steps 7 or less, a smaller per_device_train_batch_size, or more data"
    )
    with pytest.raises(RecipeError, match="gradient_accumulation_steps=8 is more than the 7 micro-batches"):
        # with max_steps too
        check_run_length(run_args(gradient_accumulation_steps=8, max_steps=50), 100)
    # 1 step an epoch, 3 epochs
    assert check_run_length(run_args(gradient_accumulation_steps=7), 100) == 3
    # ceil(7 / 3) x 2
    assert check_run_length(run_args(gradient_accumulation_steps=3, num_train_epochs=2.0), 100) == 6
    # ceil(13 x 0.5)
    assert check_run_length(run_args(num_train_epochs=0.5, world_size=1), 100) == 7
    with pytest.raises(RecipeError, match=r"^per_device_train_batch_size=8 leaves no batch with dataloader_drop_last"):
        check_run_length(run_args(dataloader_drop_last=True), 10)


def test_profile_steps_beyond_an_epoch_based_run_are_refused():
    """With max_steps -1 the run's end comes from the data: 7 batches, accumulating 3, 2 epochs = 6 steps."""
    two_epochs = run_args(gradient_accumulation_steps=3, num_train_epochs=2.0)
    with pytest.raises(RecipeError) as err:
        check_run_length(two_epochs, 100, "5-8")
    # as many steps, ending with the run
    assert str(err.value) == (
        "profile_steps=5-8 ends after the run's 6 optimizer steps (num_train_epochs=2 x 3 steps an "
        "epoch): profile steps within the run, e.g. 3-6"
    )
    assert check_run_length(two_epochs, 100, "5-6") == 6
    # max_steps sets the end, not the epochs
    assert check_run_length(run_args(max_steps=10), 100, "9-10") == 10
    with pytest.raises(
        RecipeError,
        match=r"profile_steps=11 ends after the run's 10 optimizer steps \(max_steps=10\): profile steps within "
        r"the run, e.g. 10-10$",
    ):
        check_run_length(run_args(max_steps=10), 100, "11")


def test_warmup_longer_than_an_epoch_based_run_is_warned(capsys):
    # 7 steps an epoch x 3
    check_run_length(run_args(warmup_steps=30), 100)
    assert "warning: warmup_steps=30 covers the whole run of 21 optimizer steps" in capsys.readouterr().err
    check_run_length(run_args(warmup_steps=20), 100)
    assert capsys.readouterr().err == ""


def _rules_on(monkeypatch, cpus):
    """fsdp_recipes/config/rules.py imported afresh (as another module) on a machine with ``cpus`` CPUs."""
    monkeypatch.setattr(os, "cpu_count", lambda: cpus)
    spec = importlib.util.spec_from_file_location(
        "fsdp_recipes._rules_probe", REPO / "fsdp_recipes" / "config" / "rules.py"
    )
    module = importlib.util.module_from_spec(spec)
    # dataclasses look their module up there
    monkeypatch.setitem(sys.modules, spec.name, module)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("cpus, bound", [(None, 64), (1, 64), (2, 64), (16, 64), (17, 68), (40, 160), (256, 1024)])
@pytest.mark.parametrize("field", ["dataloader_num_workers", "preprocessing_num_workers"])
def test_worker_counts_are_bounded_by_the_machine(monkeypatch, cpus, bound, field):
    """Worker processes are at most max(64, 4 x the machine's CPUs), in one line saying so."""
    from fsdp_recipes.config import rules

    assert VALUE_RULES[field].high == rules.MAX_WORKERS and rules.WORKERS_BOUND in VALUE_RULES[field].fix
    arguments = _rules_on(monkeypatch, cpus)
    # the bound the field's rule takes, on that machine
    rule = arguments.Rule(0, arguments.MAX_WORKERS, arguments.WORKERS_BOUND)
    assert arguments.problem(field, bound, rule) is None
    for value in (bound + 1, 100000, arguments.MAX_COUNT):
        problem = arguments.problem(field, value, rule)
        assert problem.startswith(f"{field}={value} is more than {bound}: "), problem
        assert f"at most {bound}: max(64, 4 x the {cpus or 1} CPUs of this machine)" in problem and "\n" not in problem


def test_a_fork_bomb_of_workers_is_refused_by_parse_args(tmp_path):
    from fsdp_recipes.config.values import MAX_WORKERS

    for field in ("dataloader_num_workers", "preprocessing_num_workers"):
        with pytest.raises(RecipeError, match=rf"^{field}=100000 is more than {MAX_WORKERS}: .*CPUs of this machine"):
            parse_args([f"--{field}", "100000", "--output_dir", str(tmp_path / "o"), "--allow_no_fsdp", "true"])
