"""Does a checkpoint belong to this run's model: what a resume checks before anything loads.

Its weights' names and full shapes (layers, sizes, LoRA targets and rank), read from the DCP metadata or safetensors
headers, and what it records beside them that shapes do not show: config.json, adapter_config.json and the
tokenizer (fsdp_recipes.train.trainer.FSDPTrainer.resume_mismatch calls both).
"""

from __future__ import annotations

import os
from pathlib import Path

from fsdp_recipes.bounded import JSON_LIMIT, load_json, read_text, short_json
from fsdp_recipes.ckpt.layout import DCP_MODEL_DIR, FULL_MODEL_FILE
from fsdp_recipes.errors import UnreadableFile


def stored_weights(ckpt: Path) -> dict[str, tuple[int, ...]] | None:
    """Name -> full shape of the model weights a checkpoint holds, read from its DCP metadata, safetensors headers or
    FULL_STATE_DICT .bin (the merge's weights-only, memory-mapped reader: shapes without reading the tensors' bytes);
    None for a checkpoint holding none of them."""
    stored = stored_tensors(ckpt)
    return None if stored is None else {name: shape for name, (shape, _) in stored.items()}


def stored_tensors(ckpt: Path) -> dict[str, tuple[tuple[int, ...], str]] | None:
    """Name -> (full shape, torch dtype name) of the model weights a checkpoint holds; see stored_weights."""
    from fsdp_recipes.ckpt.dcp_pickles import read_layout
    from fsdp_recipes.ckpt.namespace import clean_name
    from fsdp_recipes.ckpt.readers import SafetensorsSource, TorchBinSource

    if (ckpt / DCP_MODEL_DIR).is_dir():
        stored = {
            clean_name(k): (tuple(t.shape), t.dtype) for k, t in read_layout(ckpt / DCP_MODEL_DIR).tensors.items()
        }
        # accelerate saves {"model": state_dict}
        if stored and all(k.startswith("model.") for k in stored):
            stored = {k.removeprefix("model."): v for k, v in stored.items()}
        return stored
    if (
        ckpt / FULL_MODEL_FILE
        # before model.safetensors, which a FULL_STATE_DICT checkpoint also holds: the .bin is what a resume loads
    ).is_file():
        return {
            name: (tuple(info.shape), info.dtype)
            for name, info in TorchBinSource(ckpt / FULL_MODEL_FILE).tensors.items()
        }
    if (ckpt / "model.safetensors").is_file() or (ckpt / "model.safetensors.index.json").is_file():
        return {name: (tuple(info.shape), info.dtype) for name, info in SafetensorsSource(ckpt).tensors.items()}
    return None


def config_mismatch(
    folder: Path, shapes: dict[str, tuple[int, ...]], dtypes: dict[str, str] | None = None
) -> str | None:
    """Why weights named and shaped ``shapes`` (their safetensors headers') are not those of the model ``folder``'s
    config.json describes, as from_pretrained builds it (every weight there with its shape, none it does not have;
    tied ones may be left out; with ``dtypes``, their safetensors dtypes, each a float unless the config is of a
    quantized model), in words; None when they are, or when transformers builds no causal LM from the config
    (another kind of model: nothing to compare here). The config is read bounded and judged plausible for these
    weights before any model is built from it."""
    from fsdp_recipes.ckpt.description import implausible_config, model_skeleton, one_line
    from fsdp_recipes.ckpt.namespace import match_namespace
    from fsdp_recipes.ckpt.readers import SAFETENSORS_DTYPES, TensorInfo
    from fsdp_recipes.errors import CheckpointError

    try:
        settings = load_json(folder / "config.json", "config.json", JSON_LIMIT)
    except UnreadableFile as err:
        return f"unreadable config.json ({err.reason})"
    tensors = {name: TensorInfo(tuple(shape), "") for name, shape in shapes.items()}
    from transformers import AutoConfig

    try:
        config = AutoConfig.from_pretrained(folder, trust_remote_code=False)
    except Exception as err:  # noqa: BLE001 (OSError, ValueError, KeyError ...: transformers raises many)
        return f"config.json is not a config transformers reads ({one_line(err)})"
    if problem := implausible_config(settings, tensors) or implausible_config(config, tensors):
        return problem
    try:
        model_cls, expected, tied, ignorable = model_skeleton(config)
    except Exception:  # noqa: BLE001 (not a causal LM's config: from_pretrained of another class judges it)
        return None
    try:
        found = match_namespace(tensors, expected, tied, model_cls.__name__, ignorable)
    except CheckpointError as err:
        return f"config.json describes another model: {str(err).split(': pass the right --base-model')[0]}"
    # an unquantized model's weights are floats: integer bytes in a weight's place load as huge values, no NaN
    # (buffers such as GPT-2's attn.bias masks or position_ids may be integers or booleans: only .weight is judged)
    floats = {code for name, code in SAFETENSORS_DTYPES.items() if "float" in name}
    if dtypes and "quantization_config" not in settings:
        for stored in found.names.values():
            if stored.endswith(".weight") and dtypes.get(stored, "F32") not in floats:
                return (
                    f"{stored} is stored as {dtypes[stored]}, where the model config.json describes has a float weight"
                )
    return None


def omittable_names(model) -> set[str]:
    """Names of ``model``'s state dict a checkpoint of it may leave out: every frozen parameter, under each name it
    has (a LoRA run's base, a tied base's head among them, under whatever prefix peft adds: an adapter-only
    checkpoint does not store it). A trained weight is loaded under every name it has (DCP's load raises for a
    missing one), so none of its names may be missing."""
    return {name for name, param in model.named_parameters(remove_duplicate=False) if not param.requires_grad}


def model_mismatch(
    ckpt: str | os.PathLike, expected: dict[str, tuple[int, ...]], omittable: set[str] = frozenset()
) -> str | None:
    """Why the checkpoint's weights are not the weights of the model this run built (names and full shapes: layers,
    sizes, LoRA targets and rank), in one line; None when they match. ``omittable``: names a checkpoint may leave
    out (omittable_names)."""
    from fsdp_recipes.ckpt.namespace import clean_name

    stored = stored_weights(Path(ckpt))
    if stored is None:
        return None
    expected = {clean_name(k): tuple(v) for k, v in expected.items()}
    missing = sorted(set(expected) - set(stored) - {clean_name(k) for k in omittable})
    extra = sorted(set(stored) - set(expected))
    other = sorted(n for n in set(stored) & set(expected) if stored[n] != expected[n])
    if not (missing or extra or other):
        return None
    parts = []
    if missing:
        parts.append(f"{len(missing)} weight(s) of this run's model are not in it (e.g. {missing[0]})")
    if extra:
        parts.append(f"it holds {len(extra)} weight(s) this model does not have (e.g. {extra[0]})")
    if other:
        n = other[0]
        parts.append(
            f"{len(other)} weight(s) differ in shape (e.g. {n}: {stored[n]} saved, {expected[n]} in this model)"
        )
    return (
        f"{ckpt} was saved from another model: {'; '.join(parts)}; resume with the model, config and LoRA settings "
        "(use_peft, lora_r, lora_target_modules) it was saved with, or start without --resume_from_checkpoint"
    )


# config.json keys a resume may change: where the model came from, library bookkeeping, and what the Trainer and
# the export set per run (use_cache, the saved dtype, attention kernels); every other key defines the model
FREE_CONFIG_KEYS = frozenset(
    {
        "_name_or_path",
        "transformers_version",
        "use_cache",
        "architectures",
        "dtype",
        "torch_dtype",
        "attn_implementation",
        "_attn_implementation",
        "_attn_implementation_autoset",
    }
)
# adapter_config.json keys that define what a LoRA adapter computes (r and the targets show in the shapes too)
LORA_KEYS = (
    "r",
    "lora_alpha",
    "lora_dropout",
    "target_modules",
    "use_rslora",
    "use_dora",
    "bias",
    "modules_to_save",
    "layers_to_transform",
    "rank_pattern",
    "alpha_pattern",
    "fan_in_fan_out",
)


def _plain(value):
    """A value as JSON holds it (sets as sorted lists, tuples as lists), so the saved and the live compare."""
    if isinstance(value, (set, frozenset)):
        return sorted(_plain(v) for v in value)
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    return value


def _unordered(value):
    """A LoRA module list as a set: peft saves target_modules in any order. Nowhere else: a BPE merge list's order
    is the tokenizer."""
    value = _plain(value)
    return sorted(value) if isinstance(value, list) and all(isinstance(v, str) for v in value) else value


def _differing(saved: dict, now: dict, keys, plain=_plain) -> list[str]:
    return [k for k in sorted(keys) if plain(saved.get(k)) != plain(now.get(k))]


# tokenizer.json's runtime settings, which the library sets as it encodes (not what the tokenizer is)
TOKENIZER_RUNTIME_KEYS = frozenset({"truncation", "padding"})
SPECIAL_TOKENS = ("bos_token", "eos_token", "unk_token", "pad_token")


def tokenizer_record(tokenizer) -> dict | None:
    """What of a transformers tokenizer a resume compares with the checkpoint's saved one: its whole tokenizer.json
    (vocabulary, merges, normalizer, pre-tokenizer, post-processor, decoder, added tokens) but the runtime settings,
    its special tokens (transformers writes the eos token's id into the next checkpoint's config) and chat template."""
    import json

    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        return None
    whole = {k: v for k, v in json.loads(backend.to_str()).items() if k not in TOKENIZER_RUNTIME_KEYS}
    special = {name: _token_text(getattr(tokenizer, name, None)) for name in SPECIAL_TOKENS}
    return {
        "tokenizer.json": whole,
        "special_tokens": special,
        "chat_template": getattr(tokenizer, "chat_template", None),
    }


def _token_text(token):
    """A special token as tokenizer_config.json or a tokenizer holds it (a string, an AddedToken or its dict): its
    text."""
    if isinstance(token, dict):
        return token.get("content")
    return None if token is None else str(getattr(token, "content", token))


def description_mismatch(
    ckpt: str | os.PathLike, config: dict, lora: dict | None = None, tokenizer: dict | None = None
) -> str | None:
    """Why the checkpoint was saved from another model than this run's, by what it records beside its weights:
    config.json (every key but FREE_CONFIG_KEYS: heads, rope, activation, norms change no shape), adapter_config.json
    (LORA_KEYS: lora_alpha scales the update) and the tokenizer (token ids, which a shuffled vocabulary of the same
    size changes silently, how text is normalized and split, its special tokens and chat template). A file the
    checkpoint lacks (another tool's) is not compared. ``config``: the run's ``config.to_diff_dict()``, as
    save_pretrained writes it; ``lora``: its adapter config; ``tokenizer``: ``tokenizer_record`` of its tokenizer."""
    try:
        return _description_mismatch(Path(ckpt), config, lora, tokenizer)
    except UnreadableFile as err:
        return (
            f"{ckpt}: unreadable {Path(err.path).name} ({err.reason}): restore it from a copy, or resume "
            "from another checkpoint"
        )


def _description_mismatch(ckpt: Path, config: dict, lora: dict | None, tokenizer: dict | None) -> str | None:
    fix = (
        "resume with the model, config, tokenizer and LoRA settings it was saved with, or start without "
        "--resume_from_checkpoint (another --output_dir)"
    )
    # present in any form: compared, or named as unreadable
    if os.path.lexists(path := ckpt / "config.json"):
        saved = load_json(path, "config.json", JSON_LIMIT)
        if differ := _differing(saved, config, (saved.keys() | config.keys()) - FREE_CONFIG_KEYS):
            k = differ[0]
            return (
                f"{ckpt} was saved from another model: its config.json differs in {len(differ)} setting(s) "
                f"({', '.join(differ[:4])}{', ...' if len(differ) > 4 else ''}; {k}: "
                f"{short_json(_plain(saved.get(k)))} saved, "
                f"{short_json(_plain(config.get(k)))} now); {fix}"
            )
    if lora is not None and os.path.lexists(path := ckpt / "adapter_config.json"):
        saved = load_json(path, "adapter_config.json", JSON_LIMIT)
        if differ := _differing(saved, lora, LORA_KEYS, _unordered):
            k = differ[0]
            return (
                f"{ckpt} was saved with other LoRA settings: {', '.join(differ)} ({k}: "
                f"{short_json(_plain(saved.get(k)))} saved, "
                f"{short_json(_plain(lora.get(k)))} now); {fix}"
            )
    if tokenizer is not None and (differ := _tokenizer_differences(ckpt, tokenizer)):
        return f"{ckpt} was saved with another tokenizer: {'; '.join(differ)} (token ids would mean other text); {fix}"
    return None


def _tokenizer_differences(ckpt: Path, now: dict) -> list[str]:
    from fsdp_recipes.ckpt.description import DESCRIPTION_LIMIT

    differ = []
    if os.path.lexists(path := ckpt / "tokenizer.json"):
        saved = load_json(path, "tokenizer.json", DESCRIPTION_LIMIT)
        if isinstance(saved, dict):
            live = now["tokenizer.json"]
            keys = [
                k
                for k in sorted((saved.keys() | live.keys()) - TOKENIZER_RUNTIME_KEYS)
                if _plain(saved.get(k)) != _plain(live.get(k))
            ]
            if keys:
                named = ["vocabulary" if k == "model" else k.replace("_", "-") for k in keys]
                differ.append(
                    f"its tokenizer.json's {', '.join(named)} differ{'s' if len(keys) == 1 else ''} from this run's"
                )
    if os.path.lexists(path := ckpt / "tokenizer_config.json"):
        saved = load_json(path, "tokenizer_config.json", JSON_LIMIT)
        if isinstance(saved, dict):
            for name in SPECIAL_TOKENS:
                if name in saved and _token_text(saved[name]) != now["special_tokens"].get(name):
                    differ.append(
                        f"{name} {short_json(_token_text(saved[name]))} saved, "
                        f"{short_json(now['special_tokens'].get(name))} now"
                    )
            template = saved.get("chat_template")
            # a FIFO or device there is named, not skipped
            if os.path.lexists(jinja := ckpt / "chat_template.jinja"):
                # unreadable: description_mismatch names it
                template = read_text(jinja, "chat_template.jinja", JSON_LIMIT)
            if template is not None and template != now["chat_template"]:
                differ.append("its chat template differs from this run's")
    return differ
