"""Is the model (or tokenizer) a run names loadable, found without loading it: a local folder's files, the hub
cache when offline, the position limit in its config, QLoRA's needs. Answers are one-line problems (None: fine)."""

from __future__ import annotations

from pathlib import Path

from fsdp_recipes.bounded import JSON_LIMIT, load_json
from fsdp_recipes.ckpt.hub_source import hub_problem, is_local, missing_local_path, not_a_hub_id, one_line  # noqa: F401
from fsdp_recipes.errors import UnreadableFile


def qlora_problem() -> str | None:
    """QLoRA needs bitsandbytes' 4-bit kernels: CUDA and the bitsandbytes package."""
    import importlib.util

    import torch

    if not torch.cuda.is_available():
        return (
            "load_in_4bit (QLoRA) needs a CUDA GPU: bitsandbytes' 4-bit weights have no CPU path to train with; "
            "on this machine use use_peft without load_in_4bit (LoRA on full-precision weights)"
        )
    if importlib.util.find_spec("bitsandbytes") is None:
        return "load_in_4bit (QLoRA) needs bitsandbytes: pip install bitsandbytes"
    return None


# any one loads
TOKENIZER_SOURCE_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


WEIGHT_FILES = (
    "model.safetensors",
    "model.safetensors.index.json",
    "pytorch_model.bin",
    "pytorch_model.bin.index.json",
)


def model_source_problem(name: str, weights: bool, revision: str | None = None) -> str | None:
    """Why a local folder or hub id cannot be loaded, found without loading it (None when it looks loadable). A hub
    id is looked for at ``revision`` (None: main) in the local cache, then asked of the hub unless HF_HUB_OFFLINE."""
    # Path("") is the folder you launch from
    if not name.strip():
        return "is empty: give a local model folder or a hub id"
    path = Path(name).expanduser()
    if path.is_dir():
        if (path / "pytorch_model_fsdp_0").is_dir() and weights:
            return (
                f"is a sharded FSDP checkpoint: merge it first (python tools/merge_checkpoint.py {name} MERGED) and "
                "fine-tune from MERGED, or continue its run with --resume_from_checkpoint"
            )
        if (
            weights
            and (path / "model" / "config.json").is_file()
            and ((path / "run_args.json").is_file() or any(path.glob("checkpoint-*")))
        ):
            # a run folder, also one an earlier version wrote its model into: a resume since may have left that stale
            return f"is a training run's folder: its final model is {Path(name) / 'model'}; give that"
        # a tokenizer: its own files, with or without a model's config.json
        if not weights:
            if not any((path / f).is_file() for f in TOKENIZER_SOURCE_FILES):
                return (
                    f"has no tokenizer files ({', '.join(TOKENIZER_SOURCE_FILES)}): pass --tokenizer_name with "
                    "a folder or "
                    "hub id that has them (this repository's tiny one: assets/tiny-llama)"
                )
            return None
        if not (path / "config.json").is_file():
            # a run folder: its model has a folder of its own
            if (path / "model" / "config.json").is_file():
                return f"is a training run's folder: its final model is {Path(name) / 'model'}; give that"
            return (
                "is a folder without config.json: give a folder written by save_pretrained or tools/merge_checkpoint.py"
            )
        if weights and not any((path / f).is_file() for f in WEIGHT_FILES):
            return (
                f"has no weights ({', '.join(WEIGHT_FILES)}): give a folder written by save_pretrained or "
                "tools/merge_checkpoint.py"
            )
        return weights_problem(path, name) if weights else None
    if path.exists():
        return "is a file: give the folder that holds config.json"
    if missing_local_path(name):
        return "does not exist (relative paths start where you launch): give a local model folder or a hub id"
    from huggingface_hub import constants, try_to_load_from_cache

    # 'my model', '-bad': every rank's from_pretrained would raise it
    if problem := not_a_hub_id(name, "model folder", "local folder"):
        return one_line(problem)
    cached = try_to_load_from_cache(name, "config.json", revision=revision)
    # the cache is all there is
    if constants.HF_HUB_OFFLINE:
        if not isinstance(cached, str):
            return "is neither a local folder nor in the hub cache, and HF_HUB_OFFLINE=1 forbids downloading it"
        return weights_problem(Path(cached).parent, name) if weights else None
    if not isinstance(cached, str):
        # a tokenizer's may lack it
        return hub_problem(name, "config.json" if weights else None, revision=revision)
    return None


def hub_config_problem(name: str, revision: str | None = None) -> tuple[str, str] | None:
    """(why, fix) when a name that is no local path is a hub id whose config.json at ``revision`` (None: main) is
    neither cached nor downloadable (the tools need only the config: from_pretrained retried for half a minute before
    its error)."""
    from huggingface_hub import constants, try_to_load_from_cache

    path = Path(name).expanduser()
    if path.exists() or name.startswith(("/", "./", "../", "~")):
        # a local path: its own checks
        return None
    # 'seven billion'
    if problem := not_a_hub_id(name, "folder, its config.json"):
        return problem
    if isinstance(try_to_load_from_cache(name, "config.json", revision=revision), str):
        return None
    if constants.HF_HUB_OFFLINE:
        return (
            "is neither a local folder nor in the hub cache",
            "give a local folder, or unset HF_HUB_OFFLINE to download it",
        )
    if problem := hub_problem(name, "config.json", revision=revision):
        why, _, fix = problem.rpartition(": ")
        return why, fix
    return None


def dataset_source_problem(name: str) -> str | None:
    """Why a hub dataset id cannot be loaded, asked before anything starts when datasets has no copy of it here (a
    copy in its cache loads after datasets' own retries, so it is left to datasets)."""
    from datasets import config
    from huggingface_hub import constants

    if constants.HF_HUB_OFFLINE or config.HF_DATASETS_OFFLINE or is_local(name):
        # offline: datasets says what it lacks at once; a local folder or file: its own loader's
        return None
    if (Path(config.HF_DATASETS_CACHE) / name.replace("/", "___")).is_dir():
        return None
    return hub_problem(name, None, "dataset")


# More layers than any model trained (the deepest published LLMs have a few hundred): a config past it is a typo or
# hostile, and building it on the meta device to count its parameters would take minutes and gigabytes per layer count
MAX_LAYERS = 4096
LAYER_KEYS = (
    "num_hidden_layers",
    "n_layer",
    "num_layers",
    "n_layers",
    "num_decoder_layers",
    "num_encoder_layers",
    "decoder_layers",
    "encoder_layers",
)

# The sizes of a model (transformers' names and GPT-2's) that are at least 1 in every model: a layer count may be 0
WIDTH_KEYS = tuple(
    "hidden_size n_embd d_model intermediate_size n_inner vocab_size "
    "num_attention_heads n_head num_key_value_heads head_dim".split()
)


def _local_folder(name: str, revision: str | None = None) -> Path | None:
    """The folder a model name reads from on this machine: a local folder (or a config.json's), or the hub cache's
    snapshot of a hub id at ``revision`` (None: main); None when it is neither (nothing is fetched here)."""
    path = Path(name).expanduser()
    if path.is_file() and path.name == "config.json":
        return path.parent
    if path.is_dir():
        return path
    if path.exists() or name.startswith(("/", "./", "../", "~")) or name.count("/") > 1:
        return None
    from huggingface_hub import try_to_load_from_cache

    try:
        cached = try_to_load_from_cache(name, "config.json", revision=revision)
    # not a hub id either ('a b', '..'): model_source_problem names it
    except ValueError:
        return None
    return Path(cached).parent if isinstance(cached, str) else None


def _code_entries(auto_map) -> list[str]:
    """auto_map's entries as "AutoX -> module.Class" (a value may be a list, or name another repo:
    "repo--module.Class")."""
    if not isinstance(auto_map, dict):
        return [f"auto_map {type(auto_map).__name__}"] if auto_map else []
    shown = []
    for key, value in auto_map.items():
        for ref in value if isinstance(value, (list, tuple)) else [value]:
            if ref:
                shown.append(f"{key} -> {ref}")
    return shown


def custom_code(name: str, tokenizer: bool = False, revision: str | None = None) -> tuple[list[str], str | None]:
    """What code of its own a model (or tokenizer) folder names, and why transformers could not load it without
    that code (None: transformers has the class, so trust_remote_code=False loads it and runs nothing). Read from
    config.json (or tokenizer_config.json) on this machine only; ([], None) when it is not here."""
    import transformers
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES

    folder = _local_folder(name, revision)
    file = "tokenizer_config.json" if tokenizer else "config.json"
    if folder is None or not (folder / file).is_file():
        return [], None
    record = load_json(folder / file, file, JSON_LIMIT)
    if not isinstance(record, dict):
        return [], None
    # peft and the hub repeat slow and fast
    entries = list(dict.fromkeys(_code_entries(record.get("auto_map"))))
    # a class transformers lacks loads as its generic tokenizers backend, unless auto_map names code for it
    if tokenizer:
        cls = record.get("tokenizer_class")
        known = (
            not entries
            or not isinstance(cls, str)
            or hasattr(transformers, cls)
            or hasattr(transformers, cls.removesuffix("Fast"))
        )
        return (
            entries,
            None if known else f"tokenizer_class {cls!r}, which transformers {transformers.__version__} does not have",
        )
    model_type = record.get("model_type")
    known = model_type in CONFIG_MAPPING_NAMES
    return (
        entries,
        None if known else f"model_type {model_type!r}, which transformers {transformers.__version__} does not know",
    )


def remote_code_problem(
    name: str, trust_remote_code: bool, tokenizer: bool = False, revision: str | None = None
) -> tuple[str, str] | None:
    """(why, fix) when a model (or tokenizer) cannot be loaded without running Python files of its own; None when
    it can, or when trust_remote_code allows that code (custom_code says what it runs, for the warning)."""
    try:
        entries, unknown = custom_code(name, tokenizer, revision)
    except UnreadableFile as err:
        return f"has an unreadable {Path(err.path).name} ({err.reason})", "restore it, or give another model folder"
    if unknown is None:
        return None
    # no code to trust: transformers cannot load it whatever the flag says
    if not entries:
        return f"names {unknown}", "give a model transformers supports (a newer transformers may know this one)"
    if trust_remote_code:
        return None
    file = "tokenizer_config.json" if tokenizer else "config.json"
    code = f" ({file}'s auto_map: {', '.join(entries[:3])}: Python files transformers would import and run)"
    return (
        f"names {unknown}{code}, and this repository runs no code from a model folder",
        "give a model transformers supports, or, only for code you have read, set trust_remote_code: true",
    )


def config_size_problem(name: str, revision: str | None = None) -> tuple[str, str] | None:
    """(why, fix) for a config.json whose layer count no model has (1,000,000 layers: building it to count its
    parameters hangs), or whose width, head count or vocabulary is not a whole number of at least 1 (a zero-width
    model builds, has no parameters, and its memory estimate is 0); a hub id's at ``revision``."""
    folder = _local_folder(name, revision)
    if folder is None or not (folder / "config.json").is_file():
        return None
    try:
        record = load_json(folder / "config.json", "config.json", JSON_LIMIT)
    except UnreadableFile as err:
        return f"has an unreadable config.json ({err.reason})", "restore it, or give another model folder"
    if not isinstance(record, dict):
        return "has a config.json that is not a JSON object", "give a folder written by save_pretrained"
    configs = [record]
    # the config and every config inside it (text_config, vision_config, decoder ...)
    while configs:
        config = configs.pop()
        configs.extend(v for v in config.values() if isinstance(v, dict))
        for key in LAYER_KEYS:
            if (value := config.get(key)) is None:
                continue
            # "1000000", 1e6, -3: a traceback later
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                return (
                    f"has {key}: {value!r} in its config.json, which is not a number of layers",
                    "give a whole number",
                )
            if value > MAX_LAYERS:
                return (
                    f"has {key}: {value} in its config.json, more than any model has (at most {MAX_LAYERS} here)",
                    "fix that number",
                )
        for key in WIDTH_KEYS:
            value = config.get(key)
            if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
                return (
                    f"has {key}: {value!r} in its config.json: a model's widths, heads and vocabulary are whole "
                    "numbers of at least 1 (a width of 0 is a model of no parameters)",
                    "fix that number, or give another model folder",
                )
    return None


def weights_problem(folder: Path, name: str) -> str | None:
    """Why the weights from_pretrained would read from ``folder`` are not safetensors files of its own: a .bin is a
    pickle (transformers unpickles it on every rank; only ckpt/dcp_pickles.py's allow-listed reader unpickles here), and
    an
    index naming "../x" or "/etc/passwd" makes from_pretrained read a file outside the folder without a word."""
    from fsdp_recipes.ckpt.readers import is_shard_name

    # what from_pretrained reads when the folder holds it
    if (folder / "model.safetensors").is_file():
        return _not_safetensors(folder / "model.safetensors")
    index = folder / "model.safetensors.index.json"
    if not index.is_file():
        if not any((folder / f).is_file() for f in WEIGHT_FILES):
            return (
                f"has no weights ({', '.join(WEIGHT_FILES)}): give a folder written by save_pretrained or "
                "tools/merge_checkpoint.py"
            )
        return (
            f"holds its weights only as a pickle (pytorch_model.bin), which transformers would unpickle on every "
            f"rank: this repository loads safetensors weights only; convert a file you trust once "
            '(python -c "from transformers import AutoModelForCausalLM as M; '
            f"M.from_pretrained('{name}').save_pretrained('CONVERTED')\") "
            "and give CONVERTED"
        )
    try:
        weight_map = load_json(index, index.name, JSON_LIMIT).get("weight_map")
    except UnreadableFile as err:
        return f"has an unreadable {index.name} ({err.reason}): restore it from the model's source"
    if not isinstance(weight_map, dict) or not weight_map:
        return (
            f"has a {index.name} without a weight_map of tensor names to shard files: restore it from the "
            "model's source"
        )
    for shard in sorted({str(v) for v in weight_map.values()}):
        if not is_shard_name(shard):
            return (
                f"has a {index.name} that names {shard!r} as a shard, which is not a .safetensors file inside the "
                "folder (from_pretrained would read it from wherever it points): give a folder whose index "
                "names only its own shards"
            )
        if not (folder / shard).is_file():
            return f"lacks {shard}, which its {index.name} names: copy the model folder again"
        if problem := _not_safetensors(folder / shard):
            return problem
    return None


def _not_safetensors(path: Path) -> str | None:
    """Why ``path`` is no safetensors file, from its header alone (a git-lfs pointer of a clone without LFS, a link to
    /etc/passwd, a copy cut short): from_pretrained would fail on every rank with safetensors' "header too large"."""
    from fsdp_recipes.ckpt.readers import safetensors_header

    try:
        length, entries, size = safetensors_header(path)
    except OSError as err:
        return f"has an unreadable {path.name} ({err.strerror}): copy the model folder again"
    except ValueError:
        with open(path, "rb") as f:
            lfs = " (a git-lfs pointer: run git lfs pull in the clone)" if f.read(8).startswith(b"version ") else ""
        return f"has a {path.name} that is not a safetensors file{lfs}: copy the model folder again"
    ends = [entry["data_offsets"][-1] for entry in entries.values()]
    if any(not isinstance(e, int) for e in ends) or 8 + length + max(ends, default=0) > size:
        return (
            f"has a {path.name} that is truncated (its header describes more bytes than it holds): copy the "
            "model folder again"
        )
    return None


def model_positions(source: str | None, revision: str | None = None) -> int | None:
    """The longest sequence the model's config allows (a hub id's at ``revision``, None: main), or None when its
    config is not on this machine (a hub model not yet downloaded: nothing is fetched here; the model load explains
    any problem later)."""
    if source is None:
        return None
    from transformers import AutoConfig

    try:
        # never prompts
        config = AutoConfig.from_pretrained(source, local_files_only=True, trust_remote_code=False, revision=revision)
    # an unreadable config is model_source_problem's to explain, or the load's
    except Exception:
        return None
    config = getattr(config, "text_config", None) or config
    return getattr(config, "max_position_embeddings", None)
