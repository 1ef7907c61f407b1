"""A YAML file with a key given twice in one mapping is refused in one line naming the key and both lines (pyyaml
keeps the last without a word): every shipped recipe and accelerate config with one of its own keys repeated, a
recipe through load_recipe and an accelerate config through check_config.py. Equal keys in different mappings are
fine."""

from __future__ import annotations

import re

import pytest
from conftest import REPO, cli

from fsdp_recipes.bounded import load_yaml
from fsdp_recipes.config.parse import load_recipe
from fsdp_recipes.errors import RecipeError, UnreadableFile

SHIPPED_YAML = sorted(
    p
    for folder in ("accelerate_configs", "recipes")
    for p in (REPO / folder).rglob("*")
    if p.suffix in (".yaml", ".yml")
)


def test_every_shipped_yaml_loads():
    assert len(SHIPPED_YAML) >= 10 and any("recipes" in p.parts for p in SHIPPED_YAML)
    for path in SHIPPED_YAML:
        assert isinstance(load_yaml(path, "shipped file"), dict), path


def _key_lines(text: str, indent: bool) -> list[tuple[int, str]]:
    """(index, line) of each `key: value` line with a scalar value, at the top level or indented."""
    pattern = r"\s+[A-Za-z_][\w.-]*:\s*\S.*" if indent else r"[A-Za-z_][\w.-]*:\s*\S.*"
    return [
        (i, line)
        for i, line in enumerate(text.splitlines())
        if re.fullmatch(pattern, line) and not line.strip().startswith("#")
    ]


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
        cases.append(([*lines[: i + 1], line, *lines[i + 1 :]], line.split(":")[0].strip(), i + 1, i + 2))
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
    # the shipped config's own count, then 8
    assert "num_processes:" in text
    assert cli("check_config", [str(config)]) == 1
    assert "has the key 'num_processes' twice" in capsys.readouterr().err
    config.write_text(text)
    assert cli("check_config", [str(config)]) == 0


def test_equal_keys_in_different_mappings_are_fine(tmp_path):
    path = tmp_path / "ok.yaml"
    path.write_text("a:\n  x: 1\nb:\n  x: 2\nc: [{x: 1}, {x: 2}]\n")
    assert load_yaml(path, "file") == {"a": {"x": 1}, "b": {"x": 2}, "c": [{"x": 1}, {"x": 2}]}
    # a quoted key is the same key
    path.write_text("c: [{x: 1, 'x': 2}]\n")
    with pytest.raises(UnreadableFile, match="has the key 'x' twice"):
        load_yaml(path, "file")
