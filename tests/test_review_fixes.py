"""Findings of the hostile review, each refused in one line where it was accepted (or a traceback) before: LoRA
adapter configs whose numbers merge into NaN weights, worker counts that fork-bomb the machine, merge sizes that
are not sizes, YAML keys given twice, parameter counts beyond any model. In this process, fast; the bad values
are generated, and the shipped files that must still pass are walked."""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

import pytest

from conftest import REPO
from fsdp_recipes.arguments import RecipeError, load_recipe
from fsdp_recipes.bounded import UnreadableFile, load_yaml

TOOLS = REPO / "tools"
SHIPPED_YAML = sorted(p for folder in ("accelerate_configs", "recipes") for p in (REPO / folder).rglob("*") if p.suffix in (".yaml", ".yml"))


def cli(tool: str, argv: list[str]) -> int:
    """A tool's main(argv) in this process (argparse's exit is a SystemExit, returned as its code)."""
    spec = importlib.util.spec_from_file_location(f"{tool}_cli", TOOLS / f"{tool}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    try:
        return module.main(argv)
    except SystemExit as stop:
        return stop.code


def one_line(text: str, prefix: str) -> str:
    lines = [line for line in text.strip().splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith(prefix), text
    return lines[0]


# --- 4. YAML keys given twice ---------------------------------------------------------------------------------------

def test_every_shipped_yaml_loads():
    assert len(SHIPPED_YAML) >= 10 and any("recipes" in p.parts for p in SHIPPED_YAML)
    for path in SHIPPED_YAML:
        assert isinstance(load_yaml(path, "shipped file"), dict), path


def _key_lines(text: str, indent: bool) -> list[tuple[int, str]]:
    """(index, line) of each `key: value` line with a scalar value, at the top level or indented."""
    pattern = r"\s+[A-Za-z_][\w.-]*:\s*\S.*" if indent else r"[A-Za-z_][\w.-]*:\s*\S.*"
    return [(i, line) for i, line in enumerate(text.splitlines()) if re.fullmatch(pattern, line) and not line.strip().startswith("#")]


@pytest.mark.parametrize("path", SHIPPED_YAML, ids=lambda p: p.relative_to(REPO).as_posix())
def test_a_key_given_twice_is_refused_at_any_level(path, tmp_path):
    """Each shipped file with one of its own keys repeated (a top-level one at the end, a nested one right after
    itself): refused, naming the key and both lines, where pyyaml took the last."""
    lines = path.read_text().splitlines()
    cases = []
    if top := _key_lines(path.read_text(), indent=False):
        i, line = top[0]
        cases.append(([*lines, line], line.split(":")[0], i + 1, len(lines) + 1))
    if nested := _key_lines(path.read_text(), indent=True):
        i, line = nested[0]
        cases.append(([*lines[: i + 1], line, *lines[i + 1:]], line.split(":")[0].strip(), i + 1, i + 2))
    assert cases, path
    for text, key, first, second in cases:
        bad = tmp_path / path.name
        bad.write_text("\n".join(text) + "\n")
        with pytest.raises(UnreadableFile) as err:
            load_yaml(bad, "file")
        assert f"has the key {key!r} twice (lines {first} and {second})" in str(err.value), str(err.value)
        assert "\n" not in str(err.value)


def test_a_recipe_with_learning_rate_twice(tmp_path):
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text("learning_rate: 1.0e-4\nblock_size: 64\nlearning_rate: 3.0e-4\n")
    with pytest.raises(RecipeError, match=r"has the key 'learning_rate' twice \(lines 1 and 3\): keep one"):
        load_recipe(recipe)
    recipe.write_text("learning_rate: 1.0e-4\nblock_size: 64\n")
    assert load_recipe(recipe) == {"learning_rate": 1.0e-4, "block_size": 64}


def test_an_accelerate_config_with_num_processes_twice(tmp_path, capsys):
    config = tmp_path / "config.yaml"
    text = (REPO / "accelerate_configs" / "zero3.yaml").read_text()
    config.write_text(text + "num_processes: 8\n")
    assert "num_processes:" in text  # the shipped config's own count, then 8
    assert cli("check_config", [str(config)]) == 1
    assert "has the key 'num_processes' twice" in capsys.readouterr().err
    config.write_text(text)
    assert cli("check_config", [str(config)]) == 0


def test_equal_keys_in_different_mappings_are_fine(tmp_path):
    path = tmp_path / "ok.yaml"
    path.write_text("a:\n  x: 1\nb:\n  x: 2\nc: [{x: 1}, {x: 2}]\n")
    assert load_yaml(path, "file") == {"a": {"x": 1}, "b": {"x": 2}, "c": [{"x": 1}, {"x": 2}]}
    path.write_text("c: [{x: 1, 'x': 2}]\n")  # a quoted key is the same key
    with pytest.raises(UnreadableFile, match="has the key 'x' twice"):
        load_yaml(path, "file")


# --- 2. worker processes bounded by the machine ---------------------------------------------------------------------

def _arguments_on(monkeypatch, cpus):
    """fsdp_recipes/arguments.py imported afresh (as another module) on a machine with ``cpus`` CPUs."""
    import os
    import sys

    monkeypatch.setattr(os, "cpu_count", lambda: cpus)
    spec = importlib.util.spec_from_file_location("fsdp_recipes._arguments_probe", REPO / "fsdp_recipes" / "arguments.py")
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, spec.name, module)  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("cpus, bound", [(None, 64), (1, 64), (2, 64), (16, 64), (17, 68), (40, 160), (256, 1024)])
@pytest.mark.parametrize("field", ["dataloader_num_workers", "preprocessing_num_workers"])
def test_worker_counts_are_bounded_by_the_machine(monkeypatch, cpus, bound, field):
    arguments = _arguments_on(monkeypatch, cpus)
    assert arguments.value_problem(field, bound) is None
    for value in (bound + 1, 100000, arguments.MAX_COUNT):
        problem = arguments.value_problem(field, value)
        assert problem.startswith(f"{field}={value} is more than {bound}: "), problem
        assert f"at most {bound}: max(64, 4 x the {cpus or 1} CPUs of this machine)" in problem and "\n" not in problem


def test_a_fork_bomb_of_workers_is_refused_by_parse_args(tmp_path):
    from fsdp_recipes.arguments import MAX_WORKERS, parse_args

    for field in ("dataloader_num_workers", "preprocessing_num_workers"):
        with pytest.raises(RecipeError, match=rf"^{field}=100000 is more than {MAX_WORKERS}: .*CPUs of this machine"):
            parse_args([f"--{field}", "100000", "--output_dir", str(tmp_path / "o"), "--allow_no_fsdp", "true"])


# --- 3. merge_checkpoint.py sizes -----------------------------------------------------------------------------------

NOT_SIZES = ["0", "1", "-5", "5", "", "  ", "nanGB", "NaNMB", "infGB", "-infMB", "1e400GB", "fiveGB", "5XB", "GB", "5 G B"]
NOT_POSITIVE = ["0KB", "-5GB", "-0.1MB", "0.0001KB"]  # 0.0001KB is 0 bytes as huggingface_hub reads it
SIZE_OPTIONS = {"--max-shard-size": ("100KB", "99.999KB", "5GB"), "--memory-budget": ("64MB", "63.9MB", "512MB")}


@pytest.mark.parametrize("option", sorted(SIZE_OPTIONS))
@pytest.mark.parametrize("value", [*NOT_SIZES, *NOT_POSITIVE, "below the minimum"])
def test_merge_sizes_that_are_not_sizes(option, value, tmp_path, capsys):
    """Each was a ValueError or OverflowError traceback, or taken (0KB: a shard per tensor; -5GB: every tensor
    read alone). Now argparse's exit 2 in one line naming the option and the value, before anything is read."""
    minimum, below, _ = SIZE_OPTIONS[option]
    value = below if value == "below the minimum" else value
    out = tmp_path / "out"
    assert cli("merge_checkpoint", [str(tmp_path / "ckpt"), str(out), f"{option}={value}"]) == 2
    line = one_line(capsys.readouterr().err, f"merge_checkpoint.py: error: argument {option}: {value!r} ")
    if value in NOT_POSITIVE:
        assert "is not positive: give at least" in line, line
    elif value == below:
        assert f"is below {minimum}: give at least {minimum}" in line, line
    else:
        assert "has no unit" in line or "is not a finite size" in line, line
    assert not out.exists()


@pytest.mark.parametrize("option", sorted(SIZE_OPTIONS))
def test_merge_sizes_from_the_minimum_up_are_taken(option, tmp_path, capsys):
    """The minimum, the default and a few spellings pass the parser: the run goes on to the input (missing here)."""
    minimum, _, default = SIZE_OPTIONS[option]
    for value in (minimum, default, default.lower(), f" {default} ", "1.5TB", "1e3GB"):
        assert cli("merge_checkpoint", [str(tmp_path / "missing"), str(tmp_path / "out"), f"{option}={value}"]) == 1
        assert "does not exist" in one_line(capsys.readouterr().err, "merge_checkpoint.py: error: ")
