"""Is the model (or tokenizer) a run names loadable, found without loading it: a local folder's files, the hub
cache when offline, the position limit in its config, QLoRA's needs. Answers are one-line problems (None: fine)."""

from __future__ import annotations

from pathlib import Path

def qlora_problem() -> str | None:
    """QLoRA needs bitsandbytes' 4-bit kernels: CUDA and the bitsandbytes package."""
    import importlib.util

    import torch

    if not torch.cuda.is_available():
        return ("load_in_4bit (QLoRA) needs a CUDA GPU: bitsandbytes' 4-bit weights have no CPU path to train with; "
                "on this machine use use_peft without load_in_4bit (LoRA on full-precision weights)")
    if importlib.util.find_spec("bitsandbytes") is None:
        return "load_in_4bit (QLoRA) needs bitsandbytes: pip install bitsandbytes"
    return None


TOKENIZER_SOURCE_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")  # any one loads


WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin", "pytorch_model.bin.index.json")


def model_source_problem(name: str, weights: bool) -> str | None:
    """Why a local folder or hub id cannot be loaded, found without loading it (None when it looks loadable).
    Hub ids are only checked offline (HF_HUB_OFFLINE=1), against the local cache."""
    path = Path(name).expanduser()
    if path.is_dir():
        if (path / "pytorch_model_fsdp_0").is_dir() and weights:
            return (
                f"is a sharded FSDP checkpoint: merge it first (python tools/merge_checkpoint.py {name} MERGED) and "
                "fine-tune from MERGED, or continue its run with --resume_from_checkpoint"
            )
        if weights and (path / "model" / "config.json").is_file() and ((path / "run_args.json").is_file() or any(path.glob("checkpoint-*"))):
            # a run folder, also one an earlier version wrote its model into: a resume since may have left that stale
            return f"is a training run's folder: its final model is {Path(name) / 'model'}; give that"
        if not weights:  # a tokenizer: its own files, with or without a model's config.json
            if not any((path / f).is_file() for f in TOKENIZER_SOURCE_FILES):
                return (f"has no tokenizer files ({', '.join(TOKENIZER_SOURCE_FILES)}): pass --tokenizer_name with a folder or "
                        "hub id that has them (this repository's tiny one: assets/tiny-llama)")
            return None
        if not (path / "config.json").is_file():
            if (path / "model" / "config.json").is_file():  # a run folder: its model has a folder of its own
                return f"is a training run's folder: its final model is {Path(name) / 'model'}; give that"
            return "is a folder without config.json: give a folder written by save_pretrained or tools/merge_checkpoint.py"
        if weights and not any((path / f).is_file() for f in WEIGHT_FILES):
            return f"has no weights ({', '.join(WEIGHT_FILES)}): give a folder written by save_pretrained or tools/merge_checkpoint.py"
        return None
    if path.exists():
        return "is a file: give the folder that holds config.json"
    parts = name.split("/")
    if name.startswith(("/", "./", "../", "~")) or len(parts) > 2 or (len(parts) == 2 and Path(parts[0]).is_dir()):
        return "does not exist (relative paths start where you launch): give a local model folder or a hub id"
    from huggingface_hub import constants, try_to_load_from_cache

    if constants.HF_HUB_OFFLINE and not isinstance(try_to_load_from_cache(name, "config.json"), str):
        return "is neither a local folder nor in the hub cache, and HF_HUB_OFFLINE=1 forbids downloading it"
    return None


def model_positions(source: str | None) -> int | None:
    """The longest sequence the model's config allows, or None when its config is not on this machine (a hub
    model not yet downloaded: nothing is fetched here; the model load explains any problem later)."""
    if source is None:
        return None
    from transformers import AutoConfig

    try:
        config = AutoConfig.from_pretrained(source, local_files_only=True)
    except Exception:  # an unreadable config is model_source_problem's to explain, or the load's
        return None
    config = getattr(config, "text_config", None) or config
    return getattr(config, "max_position_embeddings", None)
