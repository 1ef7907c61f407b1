"""What goes beside the weights of a model folder: config.json, generation config, tokenizer; and the checkpoint
manifest (``model_description.json``) that lets a merge check and copy them without transformers.

The model's weight names, shapes and tied names come from the model class built on the meta device from the
config (``model_skeleton``), or from the manifest the training run wrote beside the config, when no described file
changed since. A config is required (from the checkpoint, its parent, or --base-model); a tokenizer is optional.
A merge reads these files once (read_files: a CheckpointFiles) and every later step takes what they said.
"""

from __future__ import annotations

import copy
import hashlib
import json
import shutil
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from fsdp_recipes.bounded import JSON_LIMIT, kind_of, load_json, plain_file_name
from fsdp_recipes.ckpt.layout import BASE_IDENTITY, MANIFEST, SHARD_DIGESTS, TOKENIZER_FILES, step_of_name
from fsdp_recipes.ckpt.namespace import WeightMap, match_namespace, stored_tie_differs
from fsdp_recipes.ckpt.readers import dtype_name, torch_dtype
from fsdp_recipes.ckpt.resolve import ResolvedInput
from fsdp_recipes.compat import internals
from fsdp_recipes.errors import CheckpointError


def model_skeleton(
    config,
) -> tuple[type, dict[str, tuple[int, ...]], dict[str, str], Callable[[set[str]], set[str]]]:
    """(model class, shape of every state-dict name, tied names save_pretrained leaves out -> the name each is tied
    to, which of some stored names from_pretrained ignores without a word), from a meta-device model."""
    import torch
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        skeleton = AutoModelForCausalLM.from_config(config, trust_remote_code=False)
    expected = {k: tuple(v.shape) for k, v in skeleton.state_dict().items()}
    ties = dict(getattr(skeleton, "all_tied_weights_keys", None) or {})
    tied = (
        {name: ties[name] for name in sorted(ties) if name in expected}
        if getattr(config, "tie_word_embeddings", False)
        else {}
    )
    return type(skeleton), expected, tied, lambda names: ignored_on_load(skeleton, names)


# the keys transformers' configs count a stack of layers under (text, encoder-decoder, vision towers); not every key
# ending in "layers" is one (Qwen2's max_window_layers is a threshold)
LAYER_COUNTS = frozenset(
    {
        "num_hidden_layers",
        "num_layers",
        "n_layer",
        "n_layers",
        "encoder_layers",
        "decoder_layers",
        "num_encoder_layers",
        "num_decoder_layers",
        "depth",
    }
)


def implausible_config(config, tensors: dict) -> str | None:
    """Why ``config`` cannot describe a checkpoint holding ``tensors`` (name -> TensorInfo), judged before the model is
    built from it: building takes time and memory in proportion to its layer (and expert) counts, and a config.json
    saying num_hidden_layers 1e9 grew a merge to 15 GB, no signal stopping it. Every count of layers (LAYER_COUNTS) in
    the config and each config nested in it (text, vision, audio) must not exceed how far the weights' names are
    numbered; every count of experts, that or the largest dimension of a weight (fused experts)."""
    numbers = [int(part) for name in tensors for part in name.split(".") if part.isdigit()]
    numbered = max(numbers, default=-1) + 1
    largest = max((max(info.shape, default=0) for info in tensors.values()), default=0)
    for where, settings in _nested_settings(config):
        for key, value in settings.items():
            if type(value) is not int:
                continue
            if key in LAYER_COUNTS and value > max(numbered, 1):
                return (
                    f"config.json says {where}{key} {value}, and the weights' layers are numbered up to {numbered - 1}"
                )
            if key.endswith("experts") and value > max(numbered, largest, 1):
                return f"config.json says {where}{key} {value}, more than any number of experts the weights hold"
    return None


def _nested_settings(config, where: str = "", depth: int = 0):
    """(prefix, settings) of a config and of every config nested in it (text_config, vision_config ...)."""
    settings = config.to_dict() if hasattr(config, "to_dict") else dict(config) if isinstance(config, dict) else {}
    yield where, settings
    if depth < 4:
        for key, value in settings.items():
            if isinstance(value, dict) and ("model_type" in value or key.endswith("_config")):
                yield from _nested_settings(value, f"{where}{key}.", depth + 1)


def ignored_on_load(model, names: set[str]) -> set[str]:
    """Of ``names`` the model does not have, those from_pretrained drops without a warning, by transformers' own rule
    (the class's _keys_to_ignore_on_load_unexpected, old checkpoints' per-layer rotary_emb.inv_freq, position_ids).
    An old Llama folder stores each layer's inv_freq: it loads, so it merges, without them."""
    from types import SimpleNamespace

    info = SimpleNamespace(missing_keys=set(), unexpected_keys=set(names))
    internals.get("transformers.modeling_utils.PreTrainedModel._adjust_missing_and_unexpected_keys")(model, info)
    return set(names) - set(info.unexpected_keys)


def describe_folder(
    out_dir: Path,
    model_cls: type,
    config,
    tokenizer=None,
    generation_config=None,
    dtype=None,
    dequantized: bool = False,
) -> list[str]:
    """config.json (architectures = the model class, never an FSDP wrapper), generation config and tokenizer; returns
    the names of the files written."""
    config.architectures = [model_cls.__name__]
    if dequantized and getattr(config, "quantization_config", None) is not None:
        # a QLoRA run's merge writes the unquantized base's weights: a config still saying they are quantized would
        # have from_pretrained quantize them again, or refuse without bitsandbytes (elsewhere it stays: weights that
        # are quantized load wrong without it)
        del config.quantization_config
    if dtype is not None:
        config.dtype = torch_dtype(dtype_name(dtype))
    config.save_pretrained(out_dir)
    files = ["config.json"]
    if generation_config is not None:
        generation_config.save_pretrained(out_dir)
        files.append("generation_config.json")
    if tokenizer is not None:
        saved = tokenizer.save_pretrained(out_dir)
        files += [Path(f).name for f in saved if Path(f).parent == Path(out_dir) and Path(f).is_file()]
    return sorted(set(files))


def write_manifest(folder: Path, config, files: list[str]) -> None:
    """MANIFEST beside a checkpoint's config.json: what a merge would otherwise import transformers and build the
    model for (its class, the name and shape of every weight, the tied ones), and a hash of each description file,
    so that a merge can copy them as they are, and notices when one was edited since."""
    # from_config edits the config it is given
    model_cls, expected, tied, _ = model_skeleton(copy.deepcopy(config))
    manifest = {
        "format": 1,
        "model_class": model_cls.__name__,
        "tied": list(tied),
        # written last, once every rank is done: a checkpoint without it is incomplete
        "shard_digests": SHARD_DIGESTS,
        "files": {name: _sha256(Path(folder) / name) for name in sorted(files)},
        "weights": {name: list(shape) for name, shape in sorted(expected.items())},
    }
    (Path(folder) / MANIFEST).write_text(json.dumps(manifest, indent=1) + "\n")


def seal_manifest(folder: Path) -> None:
    """At the end of a checkpoint's save (every rank done): MANIFEST's hashes of the files as the run left them. The
    Trainer writes some again after ours (peft's adapter_config.json under FULL_STATE_DICT): from then on, a file
    that differs was changed by someone else (recorded_changes)."""
    path = Path(folder) / MANIFEST
    try:
        manifest = load_json(path, MANIFEST, JSON_LIMIT)
        files = manifest["files"]
    except (ValueError, KeyError, TypeError, OSError):
        return
    manifest["files"] = {name: _sha256(Path(folder) / name) for name in files if (Path(folder) / name).is_file()}
    # the step shard_digests.json will record (a copy from another is named)
    if (step := step_of_name(folder)) is not None:
        manifest["shard_digests_step"] = step
    path.write_text(json.dumps(manifest, indent=1) + "\n")


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(1 << 20):
            digest.update(block)
    return digest.hexdigest()


def recorded_changes(files: CheckpointFiles, skip: tuple = (), missing: list[str] | None = None) -> str | None:
    """The description files the training run wrote into the checkpoint (MANIFEST lists each with its hash) that are
    missing or changed now, as one line with the fix; None when all are as written, or the run recorded none.
    A resume and check_checkpoint count it a problem, the merge refuses it: a truncated chat_template.jinja or a
    deleted config.json was otherwise taken as it was (a merged folder whose template fails; a resume that built the
    model from whatever config it was given). ``skip``: files not read (the merge's --base-model gives config.json
    and generation_config.json; a tokenizer file the checkpoint holds is still read from it). ``missing``: a list that
    takes the names of files gone (a copy without its tokenizer: nothing tampered with) instead of counting them;
    all but config.json, without which the weights are no model the run described."""
    folder = files.checkpoint_dir
    # a FIFO, a folder, cut short: the record itself is not as written
    if files.manifest_error is not None:
        return (
            f"{folder.name}/{MANIFEST} is unreadable ({files.manifest_error}), so the files the run wrote beside the "
            f"shards cannot be checked: copy the checkpoint again; to take the checkpoint as it is now, remove "
            f"{MANIFEST} from it"
        )
    changed = []
    for name, digest in sorted((files.manifest or {"files": {}})["files"].items()):
        if name not in DESCRIPTION_FILES or name in skip:
            continue
        if name not in files.hashes and missing is not None and name != "config.json":
            missing.append(name)
        elif name not in files.hashes:
            changed.append(f"{name} is missing")
        elif files.hashes[name] != digest:
            changed.append(f"{name} is not as the run wrote it")
    if not changed:
        return None
    them = "them" if len(changed) > 1 else "it"
    return (
        f"{'; '.join(changed)} ({folder.name}/{MANIFEST} records the hash of each file the run wrote): copy the "
        f"checkpoint again, or put {them} back as the run wrote {them}; to take the checkpoint as it is now, remove "
        f"{MANIFEST} from it"
    )


@dataclass(frozen=True)
class CheckpointFiles:
    """What the files beside a checkpoint's weights say, read once (read_files): every later step of a merge takes
    this, never the folder. ``config``: config.json of ``config_dir`` (None: there is none, or ``config_error``
    says why it is no JSON object). ``manifest``: the checkpoint's MANIFEST (None: there is none, or
    ``manifest_error`` says why it is unreadable). ``hashes``: the SHA-256 now of each file the manifest records that
    is there (None: not a regular file of a description file's size). ``problems``: description files in ``places``
    that are not regular files, or too large to be one (a merge refuses the first)."""

    checkpoint_dir: Path
    places: tuple[Path, ...]
    config_dir: Path | None
    tok_dir: Path | None
    config: dict | None
    config_error: str | None
    manifest: dict | None
    manifest_error: str | None
    hashes: dict[str, str | None]
    problems: list[str]


def _files_problem(files) -> str | None:
    """What is wrong with MANIFEST's "files" (KeyError: absent), in words naming the key and what it holds."""
    want = "a mapping of file names to SHA-256 digests"
    if files is KeyError or not isinstance(files, dict):
        return f'it has no "files", {want}' if files is KeyError else f'its "files" is {kind_of(files)}, not {want}'
    if (odd := next((n for n in files if not plain_file_name(n)), None)) is not None:
        return f'its "files" names {odd!r}, which is no file of the checkpoint folder, not {want} in it'
    wrong = next(((n, d) for n, d in files.items() if not isinstance(d, str)), None)
    return None if wrong is None else f'its "files" gives {wrong[0]!r} {kind_of(wrong[1])}, not {want}'


def read_files(checkpoint_dir: Path, places=()) -> CheckpointFiles:
    """The one read of a checkpoint's description: its MANIFEST and the files it records (hashed), and the
    config.json and tokenizer found first in ``places`` (beside the weights, the checkpoint, its parent)."""
    import os
    import stat

    places, problems = tuple(places), []
    for path in (place / name for place in places for name in DESCRIPTION_FILES if os.path.lexists(place / name)):
        try:
            st = os.stat(path)
        except OSError as err:
            problems.append(f"{path} cannot be read ({err.strerror}): replace it with the file, or remove it")
            continue
        if not stat.S_ISREG(st.st_mode):
            problems.append(
                f"{path} is not a regular file (a folder, a FIFO or a device): replace it with the file, or remove it"
            )
        elif st.st_size > (DESCRIPTION_LIMIT if path.name in ("tokenizer.json", "tokenizer.model") else JSON_LIMIT):
            problems.append(
                f"{path} is {st.st_size / 1e6:.0f} MB, more than a model's {path.name} ever is: is this the right file?"
            )
    config_dir = next((d for d in places if (d / "config.json").is_file()), None)
    tok_dir = next((d for d in places if any((d / f).is_file() for f in TOKENIZER_FILES)), None)
    config = config_error = manifest = manifest_error = None
    if config_dir is not None:
        try:
            config = load_json(config_dir / "config.json", "config.json", JSON_LIMIT)
        except (ValueError, OSError) as err:
            config_error = str(err)
    hashes = {}
    if os.path.lexists(checkpoint_dir / MANIFEST):
        try:
            manifest = load_json(checkpoint_dir / MANIFEST, MANIFEST, JSON_LIMIT)
            manifest_error = _files_problem(manifest.get("files", KeyError))
        except (ValueError, OSError) as err:
            manifest_error = getattr(err, "reason", None) or str(err)
        manifest = None if manifest_error else manifest
    for name in manifest["files"] if manifest else ():
        path = checkpoint_dir / name
        if plain_file_name(name) and os.path.lexists(path):
            regular = path.is_file() and path.stat().st_size <= DESCRIPTION_LIMIT
            hashes[name] = _sha256(path) if regular else None
    return CheckpointFiles(
        checkpoint_dir, places, config_dir, tok_dir, config, config_error, manifest, manifest_error, hashes, problems
    )


@dataclass
class Description:
    """The weights to write (checked against the model) and how to write config, generation config and tokenizer."""

    weights: WeightMap
    tied: list[str]
    origin: dict[str, str]
    write: Callable[[Path], object]
    notes: list[str] = field(default_factory=list)


# The files a merge reads or copies beside the weights (config, generation config, tokenizer): each must be a
# regular file of a sane size where it exists. A FIFO or /dev/zero under one of these names used to be skipped
# (is_file is false) and the tokenizer loaded without it: a model folder silently missing its special tokens.
DESCRIPTION_FILES = (
    "config.json",
    "generation_config.json",
    *TOKENIZER_FILES,
    "special_tokens_map.json",
    "added_tokens.json",
    "chat_template.jinja",
    "chat_template.json",
    MANIFEST,
    "adapter_config.json",
    BASE_IDENTITY,
)
# tokenizer.json / tokenizer.model of the largest vocabularies: tens of MB
DESCRIPTION_LIMIT = 256 << 20
# the other description files are small JSON (a tokenizer_config.json with a long chat template: ~100 KB)


def config_origin(files: CheckpointFiles, base_model: str | None) -> str:
    """Where config.json comes from; checked before any copy. Raises CheckpointError when there is none."""
    if base_model is None and files.config_dir is None:
        where = " or ".join(str(p) for p in files.places)
        raise CheckpointError(f"no config.json in {where}: pass --base-model <hub id or folder the run started from>")
    if base_model is not None:
        return base_model
    if files.config is None or "model_type" not in files.config:
        raise CheckpointError(
            f"{files.config_dir / 'config.json'} is not a model config ({files.config_error or 'no model_type'}): "
            "fix it or pass --base-model"
        )
    return str(files.config_dir)


def one_line(err: Exception) -> str:
    text = str(err).strip().splitlines()
    return f"{type(err).__name__}: {text[0] if text else ''}".rstrip(": ")


def describe_with_transformers(
    resolved: ResolvedInput, files: CheckpointFiles, base_model: str | None, dtype: str | None
) -> Description:
    """Config, generation config and tokenizer through transformers, the weights matched against the model built
    from the config. Every load error is a one-line CheckpointError."""
    from transformers import AutoConfig, AutoTokenizer, GenerationConfig

    config_from = config_origin(files, base_model)
    config_dir = files.config_dir
    try:
        config = AutoConfig.from_pretrained(config_from, trust_remote_code=False)
    except Exception as err:  # noqa: BLE001 (OSError, ValueError, KeyError ...: transformers raises many)
        raise CheckpointError(
            f"cannot load the config from {config_from} ({one_line(err)}): pass --base-model <a folder or hub "
            "id with a valid config.json>"
        ) from None
    if config_dir is not None and base_model is None and (config_dir / "generation_config.json").is_file():
        try:
            generation_config = GenerationConfig.from_pretrained(config_dir)
        except Exception as err:  # noqa: BLE001
            raise CheckpointError(
                f"cannot load {config_dir / 'generation_config.json'} ({one_line(err)}): fix or delete it"
            ) from None
    else:
        generation_config = GenerationConfig.from_model_config(config)
    notes, tokenizer, tok_from = [], None, None
    if files.tok_dir is not None:
        tok_from = str(files.tok_dir)
    elif base_model is not None and (
        not Path(base_model).is_dir() or any((Path(base_model) / f).is_file() for f in TOKENIZER_FILES)
    ):
        tok_from = base_model
    if tok_from is None:
        notes.append(
            f"no tokenizer in {' or '.join(str(p) for p in files.places)}: the model folder has none (copy "
            "one in, or pass --base-model with one)"
        )
    else:
        try:
            tokenizer = AutoTokenizer.from_pretrained(tok_from, trust_remote_code=False)
        except Exception as err:  # noqa: BLE001
            raise CheckpointError(
                f"cannot load the tokenizer from {tok_from} ({one_line(err)}): fix or remove its files, or "
                "pass --base-model"
            ) from None
    if problem := implausible_config(config, resolved.source.tensors):
        raise CheckpointError(
            f"{config_from}: {problem}: it is not the config of these weights; pass --base-model <the folder or "
            "hub id the run started from>"
        )
    try:
        model_cls, expected, tied, ignorable = model_skeleton(config)
    except Exception as err:  # noqa: BLE001 (a config transformers cannot build a causal LM from)
        raise CheckpointError(
            f"cannot build a causal LM from the config in {config_from} ({one_line(err)}): pass --base-model"
        ) from None
    weights = match_namespace(resolved.source.tensors, expected, tied, model_cls.__name__, ignorable)
    if problem := stored_tie_differs(resolved.source, weights, tied):
        raise CheckpointError(f"{config_from}: {problem}")
    origin = {"config": config_from, "tokenizer": tok_from or "(none)"}
    return Description(
        weights,
        list(tied),
        origin,
        lambda out: describe_folder(out, model_cls, config, tokenizer, generation_config, dtype, resolved.dequantized),
        notes,
    )


def described_by_manifest(files: CheckpointFiles, tensors: dict) -> Description | None:
    """The checkpoint's own description (write_manifest), when no described file changed since and its class and tie
    agree with what config.json states (a manifest can be edited with its hashes: one claiming an untied model's head
    as tied would silently drop it from the merged folder); None sends the merge through transformers."""
    folder, manifest, config = files.config_dir, files.manifest, files.config or {}
    if folder is None or folder != files.checkpoint_dir or manifest is None:
        return None
    try:
        listed, tied = manifest["files"], list(manifest["tied"])
        expected = {name: tuple(shape) for name, shape in manifest["weights"].items()}
        model_name = str(manifest["model_class"])
    except (ValueError, KeyError, TypeError, AttributeError):
        return None
    if (
        manifest.get("format") != 1
        or "config.json" not in listed
        or any("/" in name or name.startswith(".") or files.hashes.get(name) != h for name, h in listed.items())
        or config.get("architectures") != [model_name]
        or config.get("tie_word_embeddings") is not bool(tied)
    ):
        # transformers builds the model from config.json and checks the weights against it
        return None
    weights = match_namespace(tensors, expected, tied, model_name)
    has_tokenizer = any(f in listed for f in TOKENIZER_FILES)
    origin = {"config": str(folder), "tokenizer": str(folder) if has_tokenizer else "(none)"}
    notes = [] if has_tokenizer else [f"no tokenizer in {folder}: the model folder has none"]
    return Description(
        weights, tied, origin, lambda out: [shutil.copyfile(folder / name, out / name) for name in listed], notes
    )
