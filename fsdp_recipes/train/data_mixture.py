"""A dataset mixture (DataArguments.dataset_mixture, the plan fsdp_recipes.config.trl_recipe reads from a recipe)
loaded as the script that wrote its format loads it, with datasets' own loading, column selection, shuffling and
splitting (:func:`load_split` also reads a folder written by save_to_disk, as the handbook's older mixer did):

- ``handbook`` (alignment-handbook's ``dataset_mixture``, src/alignment/data.py): each dataset's split loaded, its
  columns selected, shuffled with the mixture's seed and cut to ``weight`` of its rows; all concatenated and
  shuffled with the seed; ``test_split_size`` held out with the seed.
- ``dataset_mixer`` (the handbook's older format): for each dataset, every split of dataset_splits; a split named
  train contributes its first ``weight`` of rows to training, one named test all its rows to evaluation; the
  handbook's columns kept; both concatenated and shuffled with seed 42.
- ``trl`` (TRL's ``datasets:``, trl/scripts/utils.py): each dataset loaded (path, name, data_dir, data_files,
  split), its columns selected; fractions, normalised, give each dataset's share of the largest mixture that
  repeats no row (its first rows); concatenated; ``test_split_size`` held out. TRL splits without a seed; here the
  run's seed, so that every rank holds the same split.
"""

from __future__ import annotations

import math
from pathlib import Path

from datasets import Dataset, DatasetDict, concatenate_datasets, load_dataset, load_from_disk
from datasets.exceptions import DatasetsError
from pyarrow.lib import ArrowException

from fsdp_recipes.config.arguments import DataArguments
from fsdp_recipes.config.local_datasets import saved_splits
from fsdp_recipes.config.mixture import MIXER_COLUMNS, read_plan
from fsdp_recipes.errors import RecipeError, one_line


def load_split(path: str, name: str | None, split: str, **kwargs) -> Dataset:
    """One split of a dataset as datasets.load_dataset gives it (a hub id, a folder of data files), or of a folder
    written by save_to_disk, which load_dataset refuses: through load_from_disk, as the handbook's older mixer reads
    one (a DatasetDict, a saved Dataset per split folder, or one saved Dataset: its one split)."""
    folder = Path(path).expanduser()
    if not folder.is_dir():
        return load_dataset(path, name, split=split, **kwargs)
    if (splits := saved_splits(folder)) is None:
        if kwargs.get("data_files") is None:
            kwargs["data_files"] = local_files(path, name, **kwargs)
        return load_dataset(path, name, split=split, **kwargs)
    if name is not None or kwargs:
        raise RecipeError(f"{path!r} was written by save_to_disk, which keeps no configurations or data files")
    if not splits:
        return load_from_disk(str(folder))
    if split not in splits:
        raise RecipeError(f"{path!r} has no split {split!r} (it has {', '.join(splits)}): give one of them")
    saved = load_from_disk(str(folder if (folder / "dataset_dict.json").is_file() else folder / split))
    return saved[split] if isinstance(saved, DatasetDict) else saved


def local_files(path: str, name: str | None, **kwargs):
    """The data files of configuration ``name`` of the local folder ``path``, as datasets resolves them (its
    README.md's configurations, or the splits it infers from the file names). Given back to load_dataset, they
    name its cache by each file's path and modification time: datasets 5.2 keys a folder whose README.md declares
    configurations by the folder's name and the configuration alone, so edited, added or removed files, or another
    folder of the same name, loaded the rows cached the first time, without a word."""
    from datasets import load_dataset_builder

    return load_dataset_builder(path, name, **kwargs).config.data_files


def _load(entry: dict) -> Dataset:
    kwargs = {k: entry[k] for k in ("data_dir", "data_files") if entry.get(k) is not None}
    try:
        return load_split(entry["path"], entry.get("name"), entry["split"], **kwargs)
    except RecipeError:
        raise
    # what datasets raises on data it cannot load
    except (DatasetsError, ArrowException, ValueError, OSError) as err:
        where = f"{entry['path']!r} (configuration {entry.get('name')!r}, split {entry['split']!r})"
        said = one_line((str(err).strip().splitlines() or [""])[0])[:200]
        raise RecipeError(
            f"dataset mixture: {where} cannot be loaded ({type(err).__name__}: {said}): check its id, config and split"
        ) from err


def _select(dataset: Dataset, columns, where: str) -> Dataset:
    if columns is None:
        return dataset
    if missing := [c for c in columns if c not in dataset.column_names]:
        raise RecipeError(
            f"dataset mixture: {where} has no column {', '.join(missing)} (columns: {', '.join(dataset.column_names)})"
        )
    return dataset.select_columns(columns)


def _split(dataset: Dataset, size, seed: int | None) -> tuple[Dataset, Dataset | None]:
    if size is None:
        return dataset, None
    if isinstance(size, int) and size >= len(dataset):
        raise RecipeError(f"test_split_size {size} is not below the mixture's {len(dataset)} rows")
    # datasets' train_test_split takes ceil(share x rows) for the test split and refuses an empty side
    test_rows = size if isinstance(size, int) else math.ceil(size * len(dataset))
    if len(dataset) - test_rows < 1:
        raise RecipeError(
            f"test_split_size {size} leaves no training rows of the mixture's {len(dataset)}: give a smaller share"
        )
    split = dataset.train_test_split(test_size=size, seed=seed)
    return split["train"], split["test"]


def load_mixture(args: DataArguments, seed: int) -> tuple[Dataset, Dataset | None]:
    """The mixture's training rows and its evaluation rows (None without any), before tokenizing."""
    plan = read_plan(args.dataset_mixture)
    entries = plan["datasets"]
    if plan["format"] == "handbook":
        parts = []
        for entry in entries:
            dataset = _select(_load(entry), entry["columns"], entry["path"])
            if entry["weight"] is not None:
                rows = int(len(dataset) * entry["weight"])
                dataset = dataset.shuffle(seed=plan["seed"]).select(range(rows))
            parts.append(dataset)
        return _split(concatenate_datasets(parts).shuffle(seed=plan["seed"]), plan["test_split_size"], plan["seed"])
    if plan["format"] == "dataset_mixer":
        train, test = [], []
        for entry in entries:
            dataset = _load(entry)
            dataset = dataset.remove_columns([c for c in dataset.column_names if c not in MIXER_COLUMNS])
            if "train" in entry["split"]:
                train.append(dataset.select(range(int(entry["weight"] * len(dataset)))))
            else:
                test.append(dataset)
        if not train:
            raise RecipeError("dataset_splits has no train split: the handbook trains on the splits named train")
        evaluation = concatenate_datasets(test).shuffle(seed=42) if test else None
        return concatenate_datasets(train).shuffle(seed=42), evaluation
    parts = [_select(_load(entry), entry.get("columns"), entry["path"]) for entry in entries]
    weights = [entry["weight"] for entry in entries]
    if None not in weights:
        shares = [w / sum(weights) for w in weights]
        total = min(len(d) / s for d, s in zip(parts, shares) if s > 0)
        parts = [d.select(range(round(s * total))) for d, s in zip(parts, shares)]
    return _split(concatenate_datasets(parts), plan["test_split_size"], seed)
