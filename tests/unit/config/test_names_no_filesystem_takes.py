"""A model, dataset or base name the filesystem cannot even look up (a component over 255 bytes, a NUL byte) is not a
local path: every check that asks "is it here?" answers no instead of raising OSError or ValueError."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from fsdp_recipes.config.local_datasets import local_source_problem
from fsdp_recipes.config.model_source import missing_local_path
from fsdp_recipes.train.chat_tokens import revision
from fsdp_recipes.train.upload import as_uploaded

NAMES = ["a" * 300, "org/" + "b" * 300, "c" * 5000, "nul\x00name", "./" + "d" * 300, "~/" + "e" * 300]


@pytest.mark.parametrize("name", NAMES, ids=range(len(NAMES)))
def test_a_name_no_filesystem_takes_is_not_a_local_path(tmp_path, name):
    # decided without raising: a path form with nothing there, or a hub id to check
    missing_local_path(name)
    # not a local folder: a hub id's revision
    assert revision(SimpleNamespace(model_revision="v1"), name) == "v1"
    args = SimpleNamespace(
        train_file=None, dataset_name=name, dataset_config_name=None, dataset_split="train", dataset_test_split=None
    )
    # no local source: the hub's to judge
    assert local_source_problem(args) is None
    adapter = tmp_path / "adapter_config.json"
    adapter.write_text(json.dumps({"base_model_name_or_path": name, "r": 8}))
    # the file, or a copy naming none
    assert isinstance(as_uploaded(adapter, log=lambda line: None), (str, bytes))
