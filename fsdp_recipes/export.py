"""Turn a sharded (DCP) FSDP model checkpoint into a Hugging Face model folder, one shard at a time.

Memory: tensors are read from the ``.distcp`` files one output shard at a time (``max_shard_size``), so
peak memory follows the shard size, not the model size. No process group is needed (``no_dist=True``).
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from huggingface_hub import split_state_dict_into_shards_factory
from safetensors.torch import save_file
from torch.distributed.checkpoint.metadata import TensorStorageMetadata
from tqdm.auto import tqdm

# accelerate's save_fsdp_model stores {"model": state_dict}; DCP flattens that to "model.<name>".
DCP_MODEL_PREFIX = "model."
WRAPPER_PREFIXES = ("_fsdp_wrapped_module.", "_orig_mod.", "_checkpoint_wrapped_module.")


def clean_name(name: str) -> str:
    for prefix in WRAPPER_PREFIXES:
        name = name.replace(prefix, "")
    return name


def read_tensor_index(dcp_dir: str | os.PathLike) -> dict[str, TensorStorageMetadata]:
    """Map checkpoint keys (as stored) to their size and dtype, without reading any tensor data."""
    metadata = dcp.FileSystemReader(str(dcp_dir)).read_metadata()
    return {k: v for k, v in metadata.state_dict_metadata.items() if isinstance(v, TensorStorageMetadata)}


def tensor_bytes(meta: TensorStorageMetadata) -> int:
    return meta.size.numel() * torch.empty((), dtype=meta.properties.dtype).element_size()


def write_safetensors_shards(
    dcp_dir: str | os.PathLike,
    out_dir: str | os.PathLike,
    names: dict[str, str],
    max_shard_size: str | int = "5GB",
    dtype: torch.dtype | None = None,
) -> list[str]:
    """Stream the tensors ``names`` (output name -> checkpoint key) into safetensors shards in ``out_dir``.

    Writes ``model.safetensors``, or ``model-0000i-of-0000n.safetensors`` plus ``model.safetensors.index.json``
    the way ``save_pretrained`` does. Returns the files written.
    """
    index = read_tensor_index(dcp_dir)
    metas = {out: index[key] for out, key in names.items()}
    out_size = (lambda m: m.size.numel() * torch.empty((), dtype=dtype).element_size()) if dtype else tensor_bytes
    split = split_state_dict_into_shards_factory(
        metas, get_storage_size=out_size, filename_pattern="model{suffix}.safetensors", max_shard_size=max_shard_size
    )
    reader = dcp.FileSystemReader(str(dcp_dir))
    out_dir = Path(out_dir)
    written = []
    with tqdm(total=sum(out_size(m) for m in metas.values()), unit="B", unit_scale=True, desc="Writing weights") as bar:
        for filename, shard_names in split.filename_to_tensors.items():
            buffers = {names[n]: torch.empty(metas[n].size, dtype=metas[n].properties.dtype) for n in shard_names}
            dcp.load(buffers, storage_reader=reader, no_dist=True)
            tensors = {n: buffers[names[n]] if dtype is None else buffers[names[n]].to(dtype) for n in shard_names}
            save_file(tensors, str(out_dir / filename), metadata={"format": "pt"})
            bar.update(sum(out_size(metas[n]) for n in shard_names))
            written.append(filename)
            del buffers, tensors
    if split.is_sharded:
        index_json = {"metadata": {"total_size": sum(out_size(m) for m in metas.values())}, "weight_map": split.tensor_to_filename}
        (out_dir / "model.safetensors.index.json").write_text(json.dumps(index_json, indent=2, sort_keys=True) + "\n")
        written.append("model.safetensors.index.json")
    return written


def model_weight_names(model_cls, config) -> tuple[set[str], set[str]]:
    """(names ``save_pretrained`` writes, tied names it leaves out), from a model built on the meta device."""
    with torch.device("meta"):
        skeleton = model_cls(config)
    tied = set(getattr(skeleton, "all_tied_weights_keys", {}) or {}) if getattr(config, "tie_word_embeddings", False) else set()
    return set(skeleton.state_dict()) - tied, tied


def export_hf_folder(
    dcp_dir: str | os.PathLike,
    out_dir: str | os.PathLike,
    model_cls,
    config,
    generation_config=None,
    tokenizer=None,
    max_shard_size: str | int = "5GB",
) -> list[str]:
    """Write config, generation config, tokenizer and sharded safetensors weights into ``out_dir``.

    Everything is first written into a hidden folder beside the files and moved in at the end, config.json
    last, so a folder that ``from_pretrained`` can open is always complete.
    """
    out_dir = Path(out_dir)
    staging = out_dir / ".export-tmp"
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    stored = {clean_name(k[len(DCP_MODEL_PREFIX):] if k.startswith(DCP_MODEL_PREFIX) else k): k for k in read_tensor_index(dcp_dir)}
    wanted, _ = model_weight_names(model_cls, config)
    missing = sorted(wanted - set(stored))
    if missing:
        raise ValueError(f"checkpoint {dcp_dir} lacks {len(missing)} weight(s) of {model_cls.__name__}, e.g. {missing[:3]}")
    names = {name: stored[name] for name in sorted(wanted)}
    written = write_safetensors_shards(dcp_dir, staging, names, max_shard_size=max_shard_size)
    if tokenizer is not None:
        tokenizer.save_pretrained(staging)
    if generation_config is not None:
        generation_config.save_pretrained(staging)
    config.architectures = [model_cls.__name__]
    config.save_pretrained(staging)
    files = sorted(p.name for p in staging.iterdir())
    for name in sorted(files, key=lambda n: n == "config.json"):
        os.replace(staging / name, out_dir / name)
    staging.rmdir()
    return files


def unwrapped_model_class(model: torch.nn.Module) -> type:
    """The model's own class: FSDP2 swaps in a subclass named FSDP<Model>, which must never reach config.json."""
    from torch.distributed.fsdp import FSDPModule

    return next(c for c in type(model).__mro__ if not issubclass(c, FSDPModule))


def save_final_model(trainer, tokenizer) -> None:
    """Leave a complete Hugging Face model folder in ``trainer.args.output_dir``, whatever the state-dict type.

    Under SHARDED_STATE_DICT the stock ``Trainer.save_model`` writes nothing, so every rank saves its shard
    with DCP and rank 0 streams the shards into safetensors files (memory follows the shard size).
    """
    from accelerate.utils import save_fsdp_model

    accelerator, out = trainer.accelerator, Path(trainer.args.output_dir)
    plugin = getattr(accelerator.state, "fsdp_plugin", None)
    model = accelerator.unwrap_model(trainer.model)
    if plugin is None or "SHARDED_STATE_DICT" not in str(plugin.state_dict_type):
        trainer.save_model(str(out))
        if accelerator.is_main_process:
            # save_pretrained names the class it is called on; under FSDP2 that is the FSDP<Model> subclass.
            model.config.architectures = [unwrapped_model_class(model).__name__]
            model.config.save_pretrained(out)
        accelerator.wait_for_everyone()
        return
    staging = out / ".final-sharded"
    save_fsdp_model(plugin, accelerator, trainer.model, str(staging))
    accelerator.wait_for_everyone()
    if accelerator.is_main_process:
        export_hf_folder(
            staging / "pytorch_model_fsdp_0",
            out,
            unwrapped_model_class(model),
            model.config,
            generation_config=getattr(model, "generation_config", None),
            tokenizer=tokenizer,
        )
        shutil.rmtree(staging)
    accelerator.wait_for_everyone()
