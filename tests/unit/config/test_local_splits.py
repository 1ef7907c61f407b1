"""A split or configuration named beside a local data source (dataset_split, TRL's dataset_train_split; dataset_config,
TRL's dataset_config_name; dataset_test_split) holds with datasets' meaning or is refused in one line naming the key
and what the source has: never silently ignored. A train_file is what load_dataset("json", data_files=...) makes of
it, one split (train) and no configurations; a folder of data files has its README's configurations and the splits
datasets infers; a folder written by save_to_disk (a DatasetDict, one Dataset, the handbook's older one-folder-per-
split layout) has its saved splits, no configurations. Cases are generated: each key with each kind of local source,
given as a recipe key (TRL's name and ours) and as a flag."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml
from conftest import REPO

from fsdp_recipes.config.parse import parse_args
from fsdp_recipes.errors import RecipeError
from fsdp_recipes.train.data import load_raw

NO_FSDP = ("--allow_no_fsdp", "true")
TINY = REPO / "assets" / "tiny-llama"


def records(tag: str) -> list[dict]:
    return [{"text": f"{tag} row {i}"} for i in range(4)]


def write_file(path: Path, tag: str) -> None:
    from datasets import Dataset

    if path.suffix == ".jsonl":
        path.write_text("".join(json.dumps(r) + "\n" for r in records(tag)))
    elif path.suffix == ".txt":
        path.write_text("".join(r["text"] + "\n" for r in records(tag)))
    elif path.suffix == ".csv":
        Dataset.from_list(records(tag)).to_csv(str(path))
    else:
        Dataset.from_list(records(tag)).to_parquet(str(path))


def make_source(root: Path, kind: str) -> tuple[str, str]:
    """(the key that names it, its path) for a local source of ``kind``."""
    from datasets import Dataset, DatasetDict

    if kind.startswith("train_file"):
        path = root / f"data.{kind.split('_')[-1]}"
        write_file(path, "train")
        return "train_file", str(path)
    folder = root / kind
    folder.mkdir()
    # datasets infers the splits train and test from the names
    if kind == "folder_of_files":
        for split in ("train", "test"):
            write_file(folder / f"{split}.jsonl", split)
    # a README declares two configurations, as the hub's cards do
    elif kind == "folder_with_configs":
        for config in ("en", "nl"):
            (folder / config).mkdir()
            for split in ("train", "test"):
                write_file(folder / config / f"{split}.jsonl", f"{config}-{split}")
        configs = [
            {"config_name": c, "data_files": [{"split": s, "path": f"{c}/{s}.jsonl"} for s in ("train", "test")]}
            for c in ("en", "nl")
        ]
        (folder / "README.md").write_text(f"---\n{yaml.safe_dump({'configs': configs})}---\n")
    elif kind == "saved_dataset_dict":
        DatasetDict({s: Dataset.from_list(records(s)) for s in ("train_sft", "test_sft")}).save_to_disk(folder)
    # the handbook's older mixer: load_from_disk(os.path.join(ds, split))
    elif kind == "saved_split_folders":
        for split in ("train_sft", "test_sft"):
            Dataset.from_list(records(split)).save_to_disk(folder / split)
    elif kind == "saved_dataset":
        Dataset.from_list(records("train")).save_to_disk(folder)
    return "dataset_name", str(folder)


# kind -> its configurations (None: none can be named) and its splits; the first split is the one trained on
SOURCES = {
    "train_file_jsonl": (None, ["train"]),
    "train_file_csv": (None, ["train"]),
    "train_file_parquet": (None, ["train"]),
    "train_file_txt": (None, ["train"]),
    "folder_of_files": (["default"], ["train", "test"]),
    "folder_with_configs": (["en", "nl"], ["train", "test"]),
    "saved_dataset_dict": (None, ["train_sft", "test_sft"]),
    "saved_split_folders": (None, ["train_sft", "test_sft"]),
    "saved_dataset": (None, ["train"]),
}
# how a setting is given: a recipe key under TRL's name or ours, or a flag
SPELLINGS = {
    "split": ("dataset_train_split", "dataset_split"),
    "config": ("dataset_config", "dataset_config_name"),
}


def parsed(root: Path, source: tuple[str, str], settings: dict, as_flags: bool):
    recipe = {"config_name": str(TINY), "block_size": 16, source[0]: source[1]}
    flags: list[str] = []
    if as_flags:
        flags = [part for key, value in settings.items() for part in (f"--{key}", value)]
    else:
        recipe.update(settings)
    (root / "recipe.yaml").write_text(yaml.safe_dump(recipe))
    return parse_args([str(root / "recipe.yaml"), *flags, *NO_FSDP])[1]


def one_line(excinfo) -> str:
    message = str(excinfo.value)
    assert "\n" not in message and len(message) < 400, message
    return message


CASES = [
    (kind, setting, spelling, flag)
    for kind in SOURCES
    for setting in ("split", "config", "test_split")
    for spelling in (SPELLINGS.get(setting) or ("dataset_test_split",))
    for flag in (False, True)
]


def asked(kind: str, setting: str) -> list[tuple[str, str | None]]:
    """(value, the tag of the rows it loads; None: refused) for each value a case asks: one the source has, and
    one it has not."""
    configs, splits = SOURCES[kind]
    # the rows of the configuration asked
    prefix = f"{configs[-1]}-" if configs and len(configs) > 1 else ""
    if setting == "config":
        return [(c, f"{c}-train" if len(configs) > 1 else "train") for c in (configs or [])[-1:]] + [("xx", None)]
    if setting == "test_split" and kind.startswith("train_file"):
        # a train_file's evaluation data is validation_file or a share
        return [("train", None), ("test", None)]
    return [(splits[-1], prefix + splits[-1]), ("validation", None)]


@pytest.mark.parametrize(
    "kind, setting, spelling, flag", CASES, ids=[f"{k}-{s}-{'flag' if f else 'key'}" for k, _, s, f in CASES]
)
def test_a_split_or_configuration_is_taken_from_what_the_source_has_or_refused(
    tmp_path, monkeypatch, kind, setting, spelling, flag
):
    import datasets.config

    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", str(tmp_path / "hf_cache"))
    source = make_source(tmp_path, kind)
    configs, splits = SOURCES[kind]
    for value, tag in asked(kind, setting):
        settings = {spelling: value}
        if setting != "config" and configs and len(configs) > 1:
            settings["dataset_config_name"] = configs[-1]
        if setting != "split" and splits[0] != "train":
            # default train is not one of its splits (that case is refused)
            settings["dataset_split"] = splits[0]
        if tag is None:
            with pytest.raises(RecipeError) as err:
                parsed(tmp_path, source, settings, flag)
            message = one_line(err)
            if kind.startswith("train_file") and setting == "test_split":
                assert "dataset_test_split is a split of dataset_name" in message, message
                continue
            ours = "dataset_test_split" if setting == "test_split" else SPELLINGS[setting][1]
            assert f"{ours}={value!r}" in message, message
            # what it has is named
            named = (configs or ["configurations"]) if setting == "config" else splits
            assert all(name in message for name in named), message
            continue
        train, evaluation = load_raw(parsed(tmp_path, source, settings, flag))
        loaded = evaluation if setting == "test_split" else train
        assert loaded is not None and {t.split(" row ")[0] for t in loaded["text"]} == {tag}, loaded["text"]


def test_a_configuration_of_a_train_file_is_refused_whatever_its_name(tmp_path):
    source = make_source(tmp_path, "train_file_jsonl")
    for name in ("default", "en"):
        with pytest.raises(RecipeError, match=r"dataset_config_name='\w+' \(TRL's dataset_config\) picks"):
            parsed(tmp_path, source, {"dataset_config": name}, as_flags=False)


def test_a_data_file_given_as_dataset_name_is_refused_with_the_fix(tmp_path):
    path = tmp_path / "data.jsonl"
    write_file(path, "train")
    with pytest.raises(RecipeError, match="is a file: give it as train_file"):
        parsed(tmp_path, ("dataset_name", str(path)), {}, as_flags=False)


@pytest.mark.parametrize("key", ["dataset_train_split", "dataset_config"])
def test_a_mixture_refuses_a_split_or_configuration_given_as_a_flag(tmp_path, key):
    folder = make_source(tmp_path, "folder_of_files")[1]
    recipe = {"config_name": str(TINY), "dataset_mixture": {"datasets": [{"id": folder}]}}
    (tmp_path / "recipe.yaml").write_text(yaml.safe_dump(recipe))
    with pytest.raises(RecipeError, match="a mixture gives each of its datasets its own"):
        parse_args([str(tmp_path / "recipe.yaml"), f"--{key}", "test", *NO_FSDP])


def test_the_handbooks_older_mixer_reads_a_folder_saved_per_split(tmp_path, monkeypatch):
    """Its mixer fell back to load_from_disk(os.path.join(dataset, split)): such a folder mixes here too."""
    import datasets.config
    from datasets import Dataset

    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", str(tmp_path / "hf_cache"))
    folder = tmp_path / "saved"
    for split in ("train_sft", "test_sft"):
        turns = [
            [{"role": "user", "content": f"{split} {i}"}, {"role": "assistant", "content": "ok"}] for i in range(4)
        ]
        Dataset.from_dict({"messages": turns}).save_to_disk(folder / split)
    recipe = {
        "config_name": str(TINY),
        "dataset_mixer": {str(folder): 0.5},
        "dataset_splits": ["train_sft", "test_sft"],
    }
    (tmp_path / "recipe.yaml").write_text(yaml.safe_dump(recipe))
    train, evaluation = load_raw(parse_args([str(tmp_path / "recipe.yaml"), *NO_FSDP])[1])
    firsts = [{m[0]["content"].split()[0] for m in d["messages"]} for d in (train, evaluation)]
    assert (len(train), len(evaluation), firsts) == (2, 4, [{"train_sft"}, {"test_sft"}])


@pytest.mark.parametrize(
    "spec, holds",
    [("test[:5]", True), ("test[:10%]", True), ("train+test", True), ("train[:2]+test[-2:]", True)]
    + [("validation[:5]", False), ("train+validation", False)],
)
def test_a_split_is_checked_by_the_names_in_datasets_split_syntax(tmp_path, monkeypatch, spec, holds):
    """datasets' own split syntax (slices, "+" joins) reaches load_dataset as written: each split it names must be one
    the folder has."""
    import datasets.config

    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", str(tmp_path / "hf_cache"))
    source = make_source(tmp_path, "folder_of_files")
    if holds:
        assert parsed(tmp_path, source, {"dataset_split": spec}, False).dataset_split == spec
    else:
        with pytest.raises(RecipeError) as err:
            parsed(tmp_path, source, {"dataset_split": spec}, False)
        assert f"dataset_split={spec!r}" in one_line(err) and "it has train, test" in one_line(err)
