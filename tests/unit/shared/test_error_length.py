"""Every error line is short enough to read whatever it quotes: a value of any length (a flag's, a file's, a path)
leaves the start of the line (what is wrong) and its end (the fix), with the middle said to be left out."""

from __future__ import annotations

import re

import pytest
import yaml
from conftest import cli, one_line_error

from fsdp_recipes import errors
from fsdp_recipes.config.parse import parse_args
from fsdp_recipes.config.problems import Problem
from fsdp_recipes.errors import MESSAGE_LIMIT, bounded

HUGE = "x" * 100_000


@pytest.mark.parametrize("length", [0, 1, MESSAGE_LIMIT - 1, MESSAGE_LIMIT, MESSAGE_LIMIT + 1, 5_000, 1_000_000])
def test_bounded_keeps_a_short_message_and_the_ends_of_a_long_one(length):
    message = ("start " + "v" * length + " fix")[: max(length, 0) + 10]
    out = bounded(message)
    assert len(out) <= MESSAGE_LIMIT
    if len(message) <= MESSAGE_LIMIT:
        assert out == message
    else:
        head, _, rest = out.partition(" [... ")
        left_out, _, tail = rest.partition(" characters ...] ")
        assert (
            message.startswith(head)
            and message.endswith(tail)
            and int(left_out) == len(message) - len(head) - len(tail)
        )


ERROR_TYPES = [
    errors.RecipeError,
    errors.CheckpointError,
    errors.RefusedRemoval,
    errors.NotShardedError,
    errors.InternalsChanged,
    lambda message: errors.UnreadableFile(message, "recipe", "is refused", "the fix"),
    lambda message: errors.UnknownToThisVersion(message, "a dtype", "dtype", "2.9"),
]


@pytest.mark.parametrize("make", ERROR_TYPES)
def test_every_error_type_of_the_package_is_bounded(make):
    message, short = str(make(f"start {HUGE} end")), str(make("start end"))
    assert len(message) <= MESSAGE_LIMIT and "characters ...]" in message
    head, tail = short.partition("start")[0] + "start ", " end" + short.rpartition("end")[2]
    assert message.startswith(head) and message.endswith(tail), (head, tail)


@pytest.mark.parametrize("error_type", [t for t in ERROR_TYPES if isinstance(t, type)])
def test_an_error_type_takes_one_message_so_no_part_escapes_the_bound(error_type):
    with pytest.raises(TypeError):
        error_type("start", HUGE)


@pytest.mark.parametrize("make", ERROR_TYPES)
def test_every_error_type_survives_pickle_and_copy_whole(make):
    """A worker process's error reaches its parent pickled (datasets.map, multiprocessing): same type, message and
    attributes."""
    import copy
    import pickle

    error = make("a value")
    for again in (pickle.loads(pickle.dumps(error)), copy.copy(error)):
        assert type(again) is type(error) and str(again) == str(error) and vars(again) == vars(error)


def test_a_problem_line_of_the_config_check_is_bounded():
    line = str(Problem("error", "zero3.yaml", "mixed_precision", f"{HUGE!r} is not one of no, bf16", "use bf16"))
    assert len(line) <= MESSAGE_LIMIT and line.startswith("error: zero3.yaml: mixed_precision: 'xxx")
    assert line.endswith("; fix: use bf16")


FLAGS = [["--learning_rate", HUGE], ["--lr_scheduler_type", HUGE], [f"--{HUGE}", "1"], ["--max_steps", f"1{HUGE}"]]


@pytest.mark.parametrize("argv", FLAGS, ids=["number", "choice", "unknown flag", "int"])
def test_a_huge_flag_value_is_one_bounded_line(tmp_path, argv):
    with pytest.raises(errors.RecipeError) as err:
        parse_args(["--config_name", "assets/tiny-llama", "--output_dir", str(tmp_path / "o"), *argv])
    assert len(str(err.value)) <= MESSAGE_LIMIT and "\n" not in str(err.value)


@pytest.mark.parametrize("key", ["lr_scheduler_type", "learning_rate", "model_name_or_path_typo"])
def test_a_huge_recipe_value_is_one_bounded_line(tmp_path, key):
    recipe = tmp_path / "r.yaml"
    recipe.write_text(yaml.safe_dump({"config_name": "assets/tiny-llama", key: HUGE}))
    with pytest.raises(errors.RecipeError) as err:
        parse_args([str(recipe), "--output_dir", str(tmp_path / "o")])
    assert len(str(err.value)) <= MESSAGE_LIMIT and key in str(err.value)


@pytest.mark.parametrize(
    "tool, argv",
    [
        ("merge_checkpoint", [f"/nonexistent/{HUGE}", "out"]),
        ("merge_checkpoint", ["in", "out", "--dtype", HUGE]),
        ("estimate_memory", [HUGE]),
        ("estimate_memory", ["7B", "--strategy", HUGE]),
        ("check_config", [f"/nonexistent/{HUGE}.yaml"]),
    ],
    ids=["merge input", "merge option", "estimate model", "estimate option", "config file"],
)
def test_a_tool_given_a_huge_value_says_one_bounded_line(tool, argv, capsys):
    assert cli(tool, argv) != 0
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.strip()]
    assert lines and all(len(line) <= MESSAGE_LIMIT for line in lines), [len(line) for line in lines]
    # cut once, and saying how much: a second cut would have hidden the first's count
    counts = [int(n) for n in re.findall(r" \[\.\.\. (\d+) characters \.\.\.\] ", err)]
    assert len(counts) == 1 and counts[0] >= len(HUGE) - MESSAGE_LIMIT, counts
    one_line_error(err, f"{tool}.py: error: " if tool != "check_config" else "")


def test_a_tool_prints_a_long_error_of_the_package_with_one_cut_that_says_how_much(tmp_path, capsys):
    """The error's own message is bounded with room for the tool's prefix: the printed line is not cut again (a
    second cut would leave the count of a first cut's remains)."""
    deep = tmp_path.joinpath(*[f"{i:02d}" + "d" * 238 for i in range(12)])
    deep.mkdir(parents=True)
    assert cli("merge_checkpoint", [str(deep), "--inspect"]) == 1
    line = one_line_error(capsys.readouterr().err, "merge_checkpoint.py: error: ")
    counts = [int(n) for n in re.findall(r" \[\.\.\. (\d+) characters \.\.\.\] ", line)]
    assert len(line) <= MESSAGE_LIMIT and len(counts) == 1 and counts[0] >= len(str(deep)) - MESSAGE_LIMIT, counts
