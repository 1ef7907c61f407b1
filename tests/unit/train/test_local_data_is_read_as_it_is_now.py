"""A local dataset folder is trained on as its files are now, not as they were when datasets first cached it. datasets
(5.2) keys the cache of a folder whose README.md declares its configurations, as the hub's cards do, by the folder's
name and the configuration alone: after its files were edited, added or removed, or with another folder of the same
name, a run loaded the first rows again without a word. The folder's data files, as datasets resolves them, now name
the cache (data_mixture.local_files); files that did not change still load from it.

Cases are generated: each change with each way a recipe names such a folder (dataset_name, TRL's ``datasets:``, the
handbook's ``dataset_mixture``). The folders are tests/helpers/trl_recipes.py's, their README matching train*.jsonl.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml
from conftest import REPO
from helpers.trl_recipes import local_dataset

from fsdp_recipes.config.parse import parse_args
from fsdp_recipes.train.data import load_raw

NO_FSDP = ("--allow_no_fsdp", "true")
HUB_ID = "org/chat"


def make(root: Path, count: int = 3) -> Path:
    """A folder standing for a hub chat dataset (configuration default, split train), its README matching every
    train*.jsonl of default/."""
    folder = Path(local_dataset(root, HUB_ID, {("default", "train"): ("messages",)}, count))
    card = {"configs": [{"config_name": "default", "data_files": [{"split": "train", "path": "default/train*.jsonl"}]}]}
    (folder / "README.md").write_text(f"---\n{yaml.safe_dump(card)}---\n")
    return folder


def write(path: Path, texts: list[str]) -> None:
    """Records with the helper's columns (messages, source), the first message ``texts``."""
    records = [{"messages": [{"role": "user", "content": t}], "source": path.name} for t in texts]
    path.write_text("".join(json.dumps(r) + "\n" for r in records))


def texts_now(folder: Path) -> list[str]:
    """The first message of every record of the folder's train files, as they are now."""
    lines = [line for f in sorted((folder / "default").glob("train*.jsonl")) for line in f.read_text().splitlines()]
    return sorted(json.loads(line)["messages"][0]["content"] for line in lines)


def _edited(root: Path, folder: Path) -> Path:
    write(folder / "default" / "train.jsonl", ["edited 1", "edited 2"])
    return folder


def _same_name_elsewhere(root: Path, folder: Path) -> Path:
    other = make(root / "elsewhere", count=5)
    assert other.name == folder.name
    return other


def _added(root: Path, folder: Path) -> Path:
    write(folder / "default" / "train-more.jsonl", ["added 1"])
    return folder


def _removed(root: Path, folder: Path) -> Path:
    (folder / "default" / "train-more.jsonl").unlink()
    return folder


CHANGES = {"edited": _edited, "same name, other folder": _same_name_elsewhere, "added": _added, "removed": _removed}


def recipe(way: str, folder: Path) -> dict:
    if way == "dataset_name":
        return {"dataset_name": str(folder), "dataset_config_name": "default", "dataset_split": "train"}
    if way == "TRL datasets":
        return {"datasets": [{"path": str(folder), "name": "default", "split": "train"}]}
    return {"dataset_mixture": {"datasets": [{"id": str(folder), "config": "default", "split": "train"}]}}


def loaded(root: Path, way: str, folder: Path):
    (root / "recipe.yaml").write_text(
        yaml.safe_dump({"config_name": str(REPO / "assets" / "tiny-llama")} | recipe(way, folder))
    )
    train, _ = load_raw(parse_args([str(root / "recipe.yaml"), *NO_FSDP])[1])
    return train


@pytest.mark.parametrize("change", list(CHANGES))
@pytest.mark.parametrize("way", ["dataset_name", "TRL datasets", "handbook dataset_mixture"])
def test_a_local_folder_is_loaded_as_its_files_are_now(way, change, tmp_path):
    folder = make(tmp_path / "first")
    if change == "removed":
        write(folder / "default" / "train-more.jsonl", ["to be removed"])
    first = loaded(tmp_path, way, folder)
    assert sorted(m[0]["content"] for m in first["messages"]) == texts_now(folder)
    # nothing changed: datasets' cache, not a second copy of the rows
    again = loaded(tmp_path, way, folder)
    assert again.cache_files == first.cache_files
    folder = CHANGES[change](tmp_path, folder)
    now = loaded(tmp_path, way, folder)
    assert sorted(m[0]["content"] for m in now["messages"]) == texts_now(folder), (way, change)
