"""Read-only looks at a merge's two ends: ``inspect_checkpoint`` (what a checkpoint holds, without writing anything
or importing transformers) and ``verify_folder`` (every tensor of a merged folder equals the checkpoint's, and
from_pretrained loads it).
"""

from __future__ import annotations

import os
from pathlib import Path

from fsdp_recipes.bounded import JSON_LIMIT, STATE_LIMIT, load_json
from fsdp_recipes.ckpt.description import described_by_manifest, read_files
from fsdp_recipes.ckpt.layout import MANIFEST
from fsdp_recipes.ckpt.lora_merge import holds_adapter_only, quantized_base
from fsdp_recipes.ckpt.namespace import WeightMap, guess_namespace
from fsdp_recipes.ckpt.readers import dtype_name, torch_dtype
from fsdp_recipes.ckpt.resolve import resolve_input
from fsdp_recipes.ckpt.safetensors_writer import groups
from fsdp_recipes.ckpt.torch_names import DTYPE_SIZES
from fsdp_recipes.errors import CheckpointError


def verify_folder(folder: Path, source, names: dict[str, str], dtype: str | None = None, stem: str = "model") -> None:
    """Every tensor re-read from the output equals the checkpoint's (exact), and from_pretrained loads the folder
    (a model; an adapter folder is checked tensor by tensor only)."""
    import torch
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM

    dtype = dtype_name(dtype)
    index = folder / f"{stem}.safetensors.index.json"
    where = (
        (load_json(index, index.name, JSON_LIMIT).get("weight_map") or {})
        if index.is_file()
        else dict.fromkeys(names, f"{stem}.safetensors")
    )
    if sorted(where) != sorted(names):
        raise CheckpointError(f"verify: {folder} holds {len(where)} tensors, expected {len(names)}")
    by_source = {src: out for out, src in names.items()}
    for group in groups(sorted(by_source), source.tensors, 512 << 20):
        expected = source.read(group)
        for src in group:
            n = by_source[src]
            with safe_open(str(folder / where[n]), framework="pt") as f:
                got = f.get_tensor(n)
            want = expected[src] if dtype is None else expected[src].to(torch_dtype(dtype))
            if got.dtype != want.dtype or not torch.equal(got, want):
                raise CheckpointError(f"verify: {n} in {folder} differs from the checkpoint")
    if stem == "model":
        AutoModelForCausalLM.from_pretrained(folder, device_map="meta", trust_remote_code=False, use_safetensors=True)


def inspect_checkpoint(input_path: str | os.PathLike) -> dict:
    """What a checkpoint holds, without writing anything or importing transformers: the weights are those the
    checkpoint's manifest names, else the stored tensors outside optimizer namespaces."""
    resolved = resolve_input(input_path)
    src, ckpt = resolved.source, resolved.checkpoint_dir
    state = ckpt / "trainer_state.json"
    # a LoRA run's checkpoint without the frozen base: nothing to match to the config
    alone = holds_adapter_only(src.tensors)
    files = read_files(ckpt, resolved.places)
    own = None if alone else described_by_manifest(files, src.tensors)
    weights = (
        WeightMap({n: n for n in src.tensors}, "", 0)
        if alone
        else own.weights
        if own is not None
        else guess_namespace(src.tensors)
    )
    infos = [src.tensors[n] for n in (weights.names.values() if weights else [])]
    dtypes: dict[str, int] = {}
    for info in infos:
        dtypes[info.dtype] = dtypes.get(info.dtype, 0) + 1
    quantized = None if alone else quantized_base(src.tensors)
    try:
        step = load_json(state, "trainer_state.json", STATE_LIMIT).get("global_step") if state.is_file() else None
    except (ValueError, AttributeError):
        step = None
    return {
        "input": str(Path(input_path)),
        "checkpoint": str(ckpt),
        "notes": resolved.notes,
        "format": src.kind,
        "layout": (
            f"layout: {len(infos)} LoRA adapter tensors (lora_A, lora_B) and no frozen base weight: a merge "
            "adds the base "
            "(--base-model, or the one adapter_config.json names)"
        )
        if alone
        else (
            f"layout: a LoRA adapter on a quantized base ({quantized}): a merge writes the unquantized base "
            "model's weights "
            "with the adapter merged (--base-model, or the one adapter_config.json names)"
        )
        if quantized
        else (weights.describe() + ("" if own else " (guessed; a merge checks it against the config)"))
        if weights
        else "no weights found",
        "ranks": src.ranks,
        "step": step,
        "tensors": len(infos),
        "parameters": sum(i.numel for i in infos),
        "bytes": sum(i.nbytes() for i in infos)
        if all(i.dtype in DTYPE_SIZES for i in infos)
        # None: a dtype it does not convert
        else None,
        "dtypes": dtypes,
        "config": str(files.config_dir / "config.json") if files.config_dir else None,
        "tokenizer": str(files.tok_dir) if files.tok_dir else None,
        "manifest": str(ckpt / MANIFEST) if files.config_dir == ckpt and (ckpt / MANIFEST).is_file() else None,
        "optimizer_state": (ckpt / "optimizer_0").is_dir()
        or (ckpt / "optimizer.bin").is_file()
        or bool(weights and weights.ignored),
    }
