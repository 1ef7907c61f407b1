"""The splits and configurations of a local data source, found without loading it, so that dataset_split and
dataset_config_name (TRL's dataset_train_split and dataset_config) and dataset_test_split hold with datasets'
meaning, or are refused by name, before anything starts; never silently ignored.

- a train_file (json, jsonl, csv, parquet, txt) is what datasets' load_dataset("json", data_files=...) makes of it:
  one split, train, and no configurations;
- a dataset_name that is a folder of data files has the configurations of its README.md and the splits datasets
  infers from its file names (get_dataset_config_names, get_dataset_split_names);
- a folder written by save_to_disk (a DatasetDict's dataset_dict.json, or the handbook's older layout of one saved
  Dataset per split folder) has the splits it was saved with and no configurations; one saved Dataset is one
  split, read as train. datasets' load_dataset refuses these folders: fsdp_recipes.train.data_mixture loads them
  with load_from_disk.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

from fsdp_recipes.bounded import JSON_LIMIT, load_json
from fsdp_recipes.errors import UnreadableFile

# save_to_disk of a DatasetDict
SAVED_DICT = "dataset_dict.json"
# save_to_disk of one Dataset
SAVED_ONE = "state.json"
# the one split datasets gives a data file
ONE_FILE = "train"


def saved_splits(folder: Path) -> list[str] | None:
    """The splits of a folder written by save_to_disk: a DatasetDict's, the split folders each holding one saved
    Dataset (the handbook's older layout), or [] for one saved Dataset; None for any other folder."""
    if (folder / SAVED_DICT).is_file():
        try:
            record = load_json(folder / SAVED_DICT, SAVED_DICT, JSON_LIMIT)
        except UnreadableFile:
            record = None
        splits = record.get("splits") if isinstance(record, dict) else None
        if isinstance(splits, list) and all(isinstance(s, str) for s in splits):
            return splits
    if (folder / SAVED_ONE).is_file():
        return []
    split_folders = sorted(p.name for p in folder.iterdir() if (p / SAVED_ONE).is_file()) if folder.is_dir() else []
    return split_folders or None


def _said(err: Exception) -> str:
    return f"{type(err).__name__}: {(str(err).strip().splitlines() or [''])[0][:160]}"


def _configs_and_splits(folder: Path, config: str | None) -> tuple[list[str], list[str] | None, str | None]:
    """(its configurations, the splits of ``config`` (None: config is not one of them), how it was saved)."""
    saved = saved_splits(folder)
    if saved is not None:
        return [], (saved or [ONE_FILE]) if config is None else None, "written by save_to_disk"
    from datasets import get_dataset_config_names, get_dataset_split_names

    configs = get_dataset_config_names(str(folder))
    if config is not None and config not in configs:
        return configs, None, None
    return configs, get_dataset_split_names(str(folder), config), None


def local_source_problem(args) -> str | None:
    """Why DataArguments' dataset_split, dataset_test_split or dataset_config_name cannot apply to its local source
    (a train_file, or a dataset_name that is a local path), as one line; None when they hold or the source is a hub
    id. A hub id's configurations and splits are datasets' to check as it loads them."""
    config, split, test = args.dataset_config_name, args.dataset_split, getattr(args, "dataset_test_split", None)
    config_key = f"dataset_config_name={config!r} (TRL's dataset_config)"
    split_key = f"dataset_split={split!r} (TRL's dataset_train_split)"
    if args.train_file is not None:
        where = f"train_file={args.train_file!r} is one file, which datasets reads as one split, {ONE_FILE}"
        if config is not None:
            return f"{config_key} picks a configuration of a dataset: {where}, without configurations: drop it"
        if split != ONE_FILE:
            return (
                f"{split_key} picks a split of a dataset: {where}: drop it, or give the folder that holds the "
                "splits as dataset_name"
            )
        return None
    if args.dataset_name is None or not os.path.exists(os.path.expanduser(args.dataset_name)):
        return None
    name = f"dataset_name={args.dataset_name!r}"
    folder = Path(args.dataset_name).expanduser()
    if not folder.is_dir():
        return f"{name} is a file: give it as train_file (one file is one split, {ONE_FILE})"
    try:
        configs, splits, saved = _configs_and_splits(folder, config)
    # what datasets raises on a folder it cannot read (no data files, a bad README)
    except Exception as err:
        return f"{name} cannot be read as a dataset folder ({_said(err)}): give a folder of data files"
    if splits is None:
        if saved:
            return f"{config_key}: {name} was {saved}, which keeps no configurations: drop it"
        return f"{config_key}: {name} has no such configuration (it has {', '.join(configs)}): give one of them"
    for key, wanted in ((split_key, split), (f"dataset_test_split={test!r}", test)):
        # datasets' split syntax: "train[:10%]", "train+test": each named split must be one the folder has
        named = {re.sub(r"\[.*\]$", "", part.strip()) for part in (wanted or "").split("+")} - {""}
        if wanted is not None and not named <= set(splits):
            return f"{key}: {name} has no such split (it has {', '.join(splits)}): give one of them"
    return None
