"""A PEFT LoRA checkpoint as the input of a merge (fsdp_recipes.ckpt.merge): its source made the merged weights, as
merge_and_unload computes them, or, for --adapter-only, the adapter folder described; an adapter-only checkpoint's
frozen base read from the base model, checked against the one the run recorded it trained on.
"""

from __future__ import annotations

import shutil
from pathlib import Path

from fsdp_recipes.ckpt import base_identity
from fsdp_recipes.ckpt.description import CheckpointFiles, Description, read_files
from fsdp_recipes.ckpt.layout import ADAPTER_CONFIG, BASE_IDENTITY
from fsdp_recipes.ckpt.lora_merge import (
    LORA_WEIGHT,
    AdapterOfQuantized,
    AdapterOnBaseSource,
    MergedLoraSource,
    adapter_tensors,
    base_weights,
    find_adapter_config,
    frozen_weight_differs,
    holds_adapter_only,
    is_lora,
    quantized_base,
    read_adapter_config,
)
from fsdp_recipes.ckpt.namespace import WeightMap
from fsdp_recipes.ckpt.resolve import ResolvedInput, resolve_input
from fsdp_recipes.errors import CheckpointError


def lora_input(
    resolved: ResolvedInput, files: CheckpointFiles, base_model: str | None, adapter_only: bool, log
) -> tuple[Description | None, str | None]:
    """A PEFT LoRA checkpoint: its source becomes the merged weights (or, ``adapter_only``, the description of the
    adapter folder is returned). Without a config anywhere, the base model the adapter config names is used when
    it is a local folder. Returns (description or None, base model)."""
    if not is_lora(resolved.source.tensors):
        if adapter_only:
            raise CheckpointError("--adapter-only: this checkpoint holds no LoRA adapter (no lora_A/lora_B weights)")
        return None, base_model
    config_path = find_adapter_config(resolved.places)
    adapter_config = read_adapter_config(config_path)
    # the base the run trained on, when it recorded one
    recorded = base_identity.read(config_path.parent)
    # an adapter-only checkpoint: the base's weights are the base model's
    alone = holds_adapter_only(resolved.source.tensors)
    if not alone and (quantized := quantized_base(resolved.source.tensors)):
        resolved.source, alone, resolved.dequantized = AdapterOfQuantized(resolved.source), True, True
        log(f"{quantized}: the adapter is merged into the unquantized base model's weights")
    if alone and not adapter_only:
        base, base_dir = base_weights(base_model, adapter_config, config_path)
        if recorded is None:
            log(
                f"no {BASE_IDENTITY} beside {config_path.name} (a checkpoint of an older run or of another "
                "tool): the base "
                f"model {base_dir} is not checked against the one the adapter was trained on"
            )
        elif problem := base_identity.base_problem(
            recorded,
            base_dir,
            str(config_path.parent),
            (
                "pass --base-model <the base it was trained on> (to merge into another base on purpose, move "
                f"{BASE_IDENTITY} away)"
            ),
        ):
            raise CheckpointError(problem)
        resolved.source = AdapterOnBaseSource(resolved.source, base, base_dir)
        if isinstance(resolved.source.adapter, AdapterOfQuantized) and (
            differs := frozen_weight_differs(resolved.source.adapter.source, resolved.source)
        ):
            raise CheckpointError(
                f"{differs} in the checkpoint differs from the base model {base_dir}'s: it is another model than the "
                "one the adapter was trained on (or the run trained that weight); give its base with --base-model"
            )
        log(f"adapter-only LoRA checkpoint: the frozen base's weights from {base_dir}")
    merged = None if alone and adapter_only else MergedLoraSource(resolved.source, adapter_config)
    if adapter_only:
        names = adapter_tensors(resolved.source)
        adapter = merged.adapter if merged else LORA_WEIGHT.match(next(iter(names.values())))["adapter"]
        origin = {"config": str(config_path), "tokenizer": "(none: an adapter folder)"}
        log(
            f"PEFT LoRA checkpoint: writing adapter {adapter!r} ({len(names)} tensors) as "
            "PeftModel.from_pretrained loads it"
        )

        def write(out: Path) -> None:
            shutil.copyfile(config_path, out / ADAPTER_CONFIG)
            # checked as a record above; the adapter folder keeps naming its base
            if recorded is not None:
                base_identity.write(out, recorded)

        return Description(
            WeightMap(names, "", len(resolved.source.tensors) - len(names)), [], origin, write
        ), base_model
    resolved.source = merged
    log(
        f"PEFT LoRA checkpoint: merging adapter {merged.adapter!r} ({len(merged.pairs)} modules, lora_alpha "
        f"{merged.alpha:g}{', rsLoRA' if merged.rslora else ''}) into the base weights, as merge_and_unload does"
    )
    named = adapter_config.get("base_model_name_or_path")
    if base_model is None and files.config_dir is None and named and (Path(named) / "config.json").is_file():
        log(f"config from the base model {ADAPTER_CONFIG} names: {named}")
        return None, named
    return None, base_model


def lora_merge_input(ckpt: Path, log=print) -> ResolvedInput:
    """The LoRA checkpoint ``ckpt`` resolved as merge_checkpoint resolves it (its checks included), its source the
    merged weights, read tensor by tensor (MergedLoraSource): for a caller that writes them itself, as the final
    export does, each rank its part (ckpt.merge.write_weight_part)."""
    resolved = resolve_input(ckpt)
    files = read_files(resolved.checkpoint_dir, resolved.places)
    if files.problems:
        raise CheckpointError(files.problems[0])
    lora_input(resolved, files, None, False, log)
    return resolved


def refuse_merged_tied(source, tied: list[str]) -> None:
    if isinstance(source, MergedLoraSource) and (merged := source.merged_into_tied(tied)):
        raise CheckpointError(
            f"{merged} has a LoRA adapter and is tied to the input embeddings: peft's merge changes both "
            "tensors, this merge writes the tied weight once; merge with peft's merge_and_unload instead"
        )
