"""Dataset mixtures as recipes give them: the alignment handbook's ``dataset_mixture`` (id, config, split, columns,
weight; seed, test_split_size), its older ``dataset_mixer`` with ``dataset_splits`` and ``dataset_configs``, and TRL's
``datasets:`` list (path, name, data_dir, data_files, split, columns, fraction; streaming, test_split_size). Each is
checked and turned into one plan, DataArguments.dataset_mixture as JSON; fsdp_recipes.train.data_mixture loads it.
Reads no data."""

from __future__ import annotations

import json

from fsdp_recipes.errors import RecipeError

# the columns the handbook's older sft.py kept from a dataset_mixer's datasets (alignment/data.py, get_datasets)
MIXER_COLUMNS = ("messages", "chosen", "rejected", "prompt", "completion", "label")
MIXTURE_KEYS = ("dataset_mixture", "dataset_mixer", "datasets")


def _entries(value, what: str) -> list[dict]:
    if not isinstance(value, list) or not value or not all(isinstance(e, dict) for e in value):
        raise RecipeError(f"{what}: give a list of datasets, each a mapping")
    return value


def _names(value) -> bool:
    return isinstance(value, list) and all(isinstance(v, str) for v in value)


# What each key of a mixture's dataset entry holds, as the formats' own scripts pass it to datasets.load_dataset
def _text(value) -> bool:
    return isinstance(value, str)


def _files(value) -> bool:
    """A file, a list of files, or a mapping of split to either (datasets' data_files)."""
    if isinstance(value, dict):
        return all(_text(v) or _names(v) for v in value.values())
    return _text(value) or _names(value)


ENTRY_TYPES = {
    "id": (_text, "a dataset id or folder"),
    "path": (_text, "a dataset id or folder"),
    "config": (_text, "a config name"),
    "name": (_text, "a config name"),
    "split": (_text, "a split name"),
    "data_dir": (_text, "a folder in the dataset"),
    "columns": (_names, "a list of column names"),
    "data_files": (_files, "a file, a list of files, or a mapping of split to files"),
}


def _check_keys(entry: dict, allowed: tuple, what: str) -> None:
    """Only ``allowed`` keys, each (when set) holding what ENTRY_TYPES says it holds."""
    if other := sorted(set(entry) - set(allowed)):
        raise RecipeError(f"{what}: unknown key(s) {', '.join(other)} (known: {', '.join(allowed)})")
    for key, value in entry.items():
        holds, shape = ENTRY_TYPES.get(key, (lambda v: True, ""))
        if value is not None and not holds(value):
            raise RecipeError(f"{what}.{key}: {value!r:.80} is not {shape}")


def _share(value, what: str, most: float | None) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0 or (most and value > most):
        limit = f"from 0 to {most:g}" if most else "0 or more"
        raise RecipeError(f"{what}: {value!r} is not a number {limit}")
    return float(value)


def normalize_mixture(recipe: dict) -> dict | None:
    """The recipe's dataset mixture (any of the three formats) as one plan: ``format`` (handbook, dataset_mixer or
    trl), ``datasets`` (path, name, split, columns, weight; data_dir and data_files for TRL's), ``seed`` and
    ``test_split_size``. None without a mixture. Reads no data."""
    given = [k for k in MIXTURE_KEYS if recipe.get(k) is not None]
    if len(given) > 1:
        raise RecipeError(f"{' and '.join(given)} are each a dataset mixture: give one")
    extra = [k for k in ("streaming", "test_split_size") if recipe.get(k) not in (None, False)]
    if extra and given != ["datasets"]:
        raise RecipeError(
            f"{', '.join(extra)}: TRL's settings of a `datasets:` mixture, and there is none: remove them"
        )
    older = [k for k in ("dataset_splits", "dataset_configs") if recipe.get(k) is not None]
    if older and given != ["dataset_mixer"]:
        raise RecipeError(
            f"{', '.join(older)}: settings of the handbook's dataset_mixer, and there is none: remove them"
        )
    if not given:
        return None
    if given == ["dataset_mixture"]:
        mixture = recipe["dataset_mixture"]
        if not isinstance(mixture, dict) or "datasets" not in mixture:
            raise RecipeError("dataset_mixture: give a mapping with a datasets list (and seed, test_split_size)")
        _check_keys(mixture, ("datasets", "seed", "test_split_size"), "dataset_mixture")
        datasets = []
        for i, entry in enumerate(_entries(mixture["datasets"], "dataset_mixture.datasets")):
            what = f"dataset_mixture.datasets[{i}]"
            _check_keys(entry, ("id", "config", "split", "columns", "weight"), what)
            if not isinstance(entry.get("id"), str):
                raise RecipeError(f"{what}: give the dataset's id")
            weight = entry.get("weight", 1.0)
            datasets.append(
                {
                    "path": entry["id"],
                    "name": entry.get("config"),
                    "split": entry.get("split", "train"),
                    "columns": entry.get("columns"),
                    "weight": None if weight is None else _share(weight, f"{what}.weight", 1),
                }
            )
        columns = [set(d["columns"]) for d in datasets if d["columns"] is not None]
        if any(c != columns[0] for c in columns):
            raise RecipeError("dataset_mixture: every dataset must select the same columns (the handbook's rule)")
        plan = {"format": "handbook", "datasets": datasets, "seed": mixture.get("seed", 0)}
        plan["test_split_size"] = mixture.get("test_split_size")
    elif given == ["dataset_mixer"]:
        mixer = recipe["dataset_mixer"]
        if not isinstance(mixer, dict) or not mixer:
            raise RecipeError("dataset_mixer: give a mapping of dataset ids to the share of their training rows kept")
        splits = recipe.get("dataset_splits") or ["train", "test"]
        configs = recipe.get("dataset_configs") or [None] * len(mixer)
        if not _names(splits):
            raise RecipeError(f"dataset_splits: {splits!r:.80} is not a list of split names")
        if not isinstance(configs, list) or not all(c is None or isinstance(c, str) for c in configs):
            raise RecipeError(f"dataset_configs: {configs!r:.80} is not a list of config names")
        if len(configs) != len(mixer):
            raise RecipeError(f"dataset_configs: give one per dataset_mixer dataset ({len(mixer)}), not {len(configs)}")
        if bad := [s for s in splits if "train" not in s and "test" not in s]:
            raise RecipeError(f"dataset_splits {', '.join(bad)}: the handbook reads a split as train or test by name")
        datasets = [
            {"path": path, "name": config, "split": split, "weight": _share(frac, f"dataset_mixer.{path}", 1)}
            for (path, frac), config in zip(mixer.items(), configs)
            for split in splits
        ]
        plan = {"format": "dataset_mixer", "datasets": datasets, "seed": 42, "test_split_size": None}
    else:
        if recipe.get("streaming"):
            raise RecipeError(
                "streaming: true (TRL streams the datasets) has no equivalent here: each dataset is loaded whole "
                "(and cached by datasets); remove it"
            )
        datasets = []
        keys = ("path", "name", "data_dir", "data_files", "split", "columns", "fraction")
        for i, entry in enumerate(_entries(recipe["datasets"], "datasets")):
            _check_keys(entry, keys, f"datasets[{i}]")
            if not isinstance(entry.get("path"), str):
                raise RecipeError(f"datasets[{i}]: give the dataset's path")
            fraction = entry.get("fraction")
            datasets.append(
                {
                    **{k: entry.get(k) for k in keys if k != "fraction"},
                    "split": entry.get("split", "train"),
                    "weight": None if fraction is None else _share(fraction, f"datasets[{i}].fraction", None),
                }
            )
        weights = [d["weight"] for d in datasets]
        if None in weights and any(w is not None for w in weights):
            raise RecipeError("datasets: set fraction for every dataset of the mixture or for none (TRL's rule)")
        if None not in weights and not sum(weights):
            raise RecipeError("datasets: the fractions add up to 0")
        plan = {"format": "trl", "datasets": datasets, "seed": None, "test_split_size": recipe.get("test_split_size")}
    size = plan["test_split_size"]
    if size is not None and (isinstance(size, bool) or not isinstance(size, (int, float)) or size <= 0):
        raise RecipeError(f"test_split_size: {size!r} is not a share (0 to 1) or a number of rows")
    if isinstance(size, float) and size >= 1:
        raise RecipeError(f"test_split_size: {size!r}: a share is below 1 (a number of rows is a whole number)")
    if plan["seed"] is not None and (isinstance(plan["seed"], bool) or not isinstance(plan["seed"], int)):
        raise RecipeError(f"dataset_mixture.seed: {plan['seed']!r} is not a whole number")
    return plan


def read_plan(value: str) -> dict:
    """DataArguments.dataset_mixture (our plan as JSON, or a flag's JSON in any of the three formats) as a plan."""
    try:
        plan = json.loads(value)
    except (TypeError, json.JSONDecodeError) as err:
        raise RecipeError(f"dataset_mixture: {value!r:.80} is not JSON ({err})") from None
    if isinstance(plan, dict) and "format" in plan:
        return plan
    if isinstance(plan, dict) and "datasets" in plan and isinstance(plan["datasets"], list):
        trl = all(isinstance(e, dict) and "path" in e for e in plan["datasets"])
        return normalize_mixture(plan if trl else {"dataset_mixture": plan})
    raise RecipeError("dataset_mixture: give a mapping with a datasets list")


def mixture_problem(args) -> None:
    """DataArguments' check of its dataset_mixture: the plan reads, and it is the only source."""
    if args.dataset_name is not None or args.train_file is not None:
        raise RecipeError("dataset_mixture is the training data: drop dataset_name and train_file (or the mixture)")
    from fsdp_recipes.config.model_source import dataset_source_problem

    plan = read_plan(args.dataset_mixture)
    for entry in plan["datasets"]:
        if entry.get("data_files") is None and (problem := dataset_source_problem(entry["path"])):
            raise RecipeError(f"dataset mixture: {entry['path']!r} {problem}")


def mixture_evaluates(value: str | None) -> bool:
    """Whether the mixture holds evaluation data: a test_split_size, or the handbook's test splits."""
    if value is None:
        return False
    plan = read_plan(value)
    if plan["format"] == "dataset_mixer":
        return any("test" in d["split"] and "train" not in d["split"] for d in plan["datasets"])
    return plan["test_split_size"] is not None
