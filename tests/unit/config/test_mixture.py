"""Dataset mixtures (config/mixture.py reads them, train/data_mixture.py loads them): TRL's fractions share the
largest mixture that repeats no row; what the formats' own scripts refuse, or what cannot hold here, is one line."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import pytest
import yaml
from conftest import REPO
from helpers.trl_recipes import local_dataset

from fsdp_recipes.config.parse import parse_args
from fsdp_recipes.errors import RecipeError
from fsdp_recipes.train.data import load_raw

NO_FSDP = ("--allow_no_fsdp", "true")
TINY = {"config_name": str(REPO / "assets" / "tiny-llama"), "output_dir": "out"}


def parse(tmp_path: Path, **recipe):
    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump({**TINY, **recipe}))
    return parse_args([str(path), *NO_FSDP])


@pytest.fixture
def two(tmp_path, monkeypatch) -> tuple[str, str]:
    monkeypatch.chdir(tmp_path)
    a = local_dataset(tmp_path, "org/a", {("default", "train"): ("messages",)}, count=12)
    b = local_dataset(tmp_path, "org/b", {("default", "train"): ("messages",)}, count=6)
    return a, b


@pytest.mark.parametrize("fractions, rows", [((0.5, 0.5), (6, 6)), ((3, 1), (12, 4)), ((1, 0), (12, 0))])
def test_trl_fractions_share_the_largest_mixture_without_repeats(tmp_path, two, fractions, rows):
    datasets = [{"path": p, "fraction": f} for p, f in zip(two, fractions)]
    _, data_args, plan = parse(tmp_path, datasets=datasets, test_split_size=0.25)
    train, evaluation = load_raw(data_args, plan.raw.seed)
    sources = Counter(r["source"].split("/hub/")[-1].split("/")[1] for r in [*train, *evaluation])
    assert (sources["a"], sources["b"]) == rows and len(evaluation) == -(-sum(rows) // 4)


@pytest.mark.parametrize(
    "recipe, words",
    [
        ({"datasets": [{"path": "A", "fraction": 1}, {"path": "B"}]}, "set fraction for every dataset"),
        ({"datasets": [{"path": "A"}], "streaming": True}, "streaming: true"),
        ({"test_split_size": 0.1}, "there is none"),
        ({"dataset_mixture": {"datasets": [{"id": "A", "weight": 2}]}}, "is not a number from 0 to 1"),
        (
            {
                "dataset_mixture": {
                    "datasets": [{"id": "A", "columns": ["x"]}, {"id": "B"}, {"id": "C", "columns": ["y"]}]
                }
            },
            "same columns",
        ),
        ({"dataset_mixture": {"datasets": [{"id": "A", "revision": "v1"}]}}, "unknown key(s) revision"),
        ({"dataset_mixer": {"A": 1}, "dataset_splits": ["validation"]}, "dataset_splits validation"),
        ({"dataset_mixer": {"A": 1}, "datasets": [{"path": "B"}]}, "each a dataset mixture: give one"),
        ({"dataset_mixer": {"A": 1}, "dataset_train_split": "train_sft"}, "a mixture's splits are train"),
        # every key of a dataset entry holds what datasets.load_dataset takes there, or is one line at parse time
        ({"dataset_mixture": {"datasets": [{"id": "A", "columns": 5}]}}, "columns: 5 is not a list of column names"),
        ({"dataset_mixture": {"datasets": [{"id": "A", "columns": [1]}]}}, "is not a list of column names"),
        ({"dataset_mixture": {"datasets": [{"id": "A", "split": 5}]}}, "split: 5 is not a split name"),
        ({"dataset_mixture": {"datasets": [{"id": "A", "config": ["a"]}]}}, "config: ['a'] is not a config name"),
        ({"datasets": [{"path": "A", "data_files": 5}]}, "data_files: 5 is not a file, a list of files"),
        ({"datasets": [{"path": "A", "data_files": {"train": 5}}]}, "is not a file, a list of files"),
        ({"datasets": [{"path": "A", "name": 3}]}, "datasets[0].name: 3 is not a config name"),
        ({"datasets": [{"path": "A", "data_dir": ["d"]}]}, "data_dir: ['d'] is not a folder"),
        ({"dataset_mixer": {"A": 1}, "dataset_splits": "train_sft"}, "dataset_splits: 'train_sft' is not a list"),
        ({"dataset_mixer": {"A": 1}, "dataset_configs": "abc"}, "dataset_configs: 'abc' is not a list"),
    ],
)
def test_a_mixture_that_cannot_hold_is_one_line(tmp_path, monkeypatch, recipe, words):
    monkeypatch.chdir(tmp_path)
    for name in "ABC":
        local_dataset(tmp_path, name, {("default", "train"): ("messages",)})
    recipe = yaml.safe_load(yaml.safe_dump(recipe).replace(": A", f": {tmp_path}/hub/A"))
    with pytest.raises(RecipeError) as err:
        parse(tmp_path, train_file=str(REPO / "assets" / "data" / "tiny_chat.jsonl"), **recipe)
    assert "\n" not in str(err.value) and words in str(err.value), str(err.value)


def test_a_mixture_beside_a_train_file_is_refused_and_a_dataset_name_is_said(tmp_path, two, capsys):
    with pytest.raises(RecipeError, match="dataset_mixture is the training data: drop dataset_name and train_file"):
        parse(tmp_path, datasets=[{"path": two[0]}], train_file=str(REPO / "assets" / "data" / "tiny_chat.jsonl"))
    _, data_args, _ = parse(tmp_path, datasets=[{"path": two[0]}], dataset_name="org/a")
    assert data_args.dataset_name is None and "dataset_name 'org/a' is not read" in capsys.readouterr().err


def test_a_test_split_share_that_leaves_no_training_rows_is_one_line(tmp_path, two):
    _, data_args, plan = parse(tmp_path, datasets=[{"path": two[1]}], test_split_size=0.99)
    with pytest.raises(RecipeError, match=r"^test_split_size 0.99 leaves no training rows of the mixture's 6"):
        load_raw(data_args, plan.raw.seed)


@pytest.mark.parametrize("kind", ["folder without a tokenizer", "fifo"])
def test_a_chat_template_path_that_is_no_template_or_tokenizer_is_one_line(tmp_path, kind):
    path = tmp_path / "template"
    if kind == "fifo":
        import os

        os.mkfifo(path)
    else:
        path.mkdir()
        (path / "notes.txt").write_text("x")
    with pytest.raises(RecipeError) as err:
        parse(tmp_path, chat_template_path=str(path), train_file=str(REPO / "assets" / "data" / "tiny_chat.jsonl"))
    said = str(err.value)
    assert said.startswith(f"chat_template_path '{path}' ") and "\n" not in said, said
    assert ("has no tokenizer files" if kind != "fifo" else "is a FIFO") in said, said
