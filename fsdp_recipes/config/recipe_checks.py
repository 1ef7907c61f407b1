"""An accelerate config against the training recipe beside it and the model it trains: settings the two both set
(activation checkpointing, mixed precision), recipe settings FSDP cannot run (save_only_model, QLoRA storage,
an optimizer FSDP2 cannot step, zero1), and the wrap class and state-dict type against the model's own classes
and size (its config only, read on the meta device).
"""

from __future__ import annotations

from pathlib import Path

from fsdp_recipes.compat import internals
from fsdp_recipes.config.problems import Checker, as_bool, suggest

# Trainer optimizers (--optim) whose step mixes plain tensors into FSDP2's DTensor parameters and fails at the first
# step ("got mixed torch.Tensor and DTensor"): measured with the installed transformers and torch by
# tests/unit/config/test_check_config.py (the names it can build on CPU; the others need packages or devices not here)
FSDP2_UNSTEPPABLE_OPTIMIZERS = {"adafactor": "transformers' Adafactor"}


def unsteppable_optimizer(optim) -> tuple[str, str] | None:
    """(problem, fix) for an --optim FSDP2 cannot step (a flag's string or an OptimizerNames member), else None."""
    name = str(getattr(optim, "value", optim) or "").strip().lower()
    if name not in FSDP2_UNSTEPPABLE_OPTIMIZERS:
        return None
    return (
        f"{name}: {FSDP2_UNSTEPPABLE_OPTIMIZERS[name]} cannot step FSDP2's sharded (DTensor) parameters: the "
        "run would fail "
        "at its first optimizer step, after loading the model",
        "use adamw_torch (or sgd, adagrad, rmsprop), or an FSDP1 config",
    )


# (why, fix) of the refusal of save_only_model, under every config (here, and in launcher.check_launch for every launch)
SAVE_ONLY_MODEL = (
    "is refused: its checkpoints hold the model weights without optimizer state, so they cannot resume a run "
    "(a stopped run could only start over); the final model is written to output_dir/model anyway",
    "drop save_only_model (to keep less on disk, lower save_total_limit)",
)
ZERO1_UNDER_FSDP = (
    "is for DDP launches (accelerate_configs/ddp.yaml); under FSDP it would wrap a sharded "
    "optimizer in a second sharding"
)
# parameters above which FULL_STATE_DICT gathering on rank 0 becomes a problem
LARGE_MODEL = 1_000_000_000


def check_with_recipe(c: Checker, recipe: dict, recipe_file: str, fsdp: dict, version, sd_type, mp, ddp: bool) -> None:
    ac_fsdp = as_bool(fsdp.get("fsdp_activation_checkpointing"))
    for key in ("gradient_checkpointing", "activation_checkpointing"):
        if ac_fsdp and as_bool(recipe.get(key)):
            c.error(
                key,
                "is on together with the accelerate config's fsdp_activation_checkpointing: layers would be "
                "checkpointed twice (transformers refuses it)",
                f"drop {key} from the recipe, or set fsdp_activation_checkpointing: false",
                file=recipe_file,
            )
    # under every config: its checkpoints are models, no run resumes them
    if as_bool(recipe.get("save_only_model")):
        c.error("save_only_model", *SAVE_ONLY_MODEL, file=recipe_file)
    # QLoRA: FSDP shards the packed 4-bit weights as plain tensors (DDP replicates them as they are: any storage works)
    if as_bool(recipe.get("load_in_4bit")) and not ddp:
        storage = recipe.get("bnb_4bit_quant_storage") or "uint8"
        weights = recipe.get("dtype") or "float32"
        if version == 2 and storage == "uint8":
            c.error(
                "bnb_4bit_quant_storage",
                "uint8 storage under FSDP2: fully_shard would shard the packed bytes as "
                "parameters of their own dtype beside the model's others",
                "set bnb_4bit_quant_storage to the model's dtype (bfloat16)",
                file=recipe_file,
            )
        elif storage != weights:
            c.error(
                "bnb_4bit_quant_storage",
                f"{storage} differs from the other parameters' dtype {weights}: FSDP flattens "
                "a unit's parameters into one dtype and refuses (FSDP1) or mis-shards (FSDP2) the mix",
                "set bnb_4bit_quant_storage and dtype to the same dtype, e.g. both bfloat16",
                file=recipe_file,
            )
    # QLoRA: the base is frozen
    if recipe.get("dtype") in ("bfloat16", "float16") and not as_bool(recipe.get("load_in_4bit")):
        c.warn(
            "dtype",
            f"{recipe['dtype']} keeps the master weights and the optimizer state in 16 bits: updates smaller than "
            "their precision are rounded away",
            "keep dtype: float32 and set mixed_precision: bf16 in the accelerate config "
            "(FSDP computes in bf16, keeps fp32 master weights)",
            file=recipe_file,
        )
    if recipe.get("fp16") and mp == "bf16" or recipe.get("bf16") and mp == "fp16":
        c.error(
            "fp16" if recipe.get("fp16") else "bf16",
            f"disagrees with the accelerate config's mixed_precision: {mp}",
            "set mixed precision in one place: the accelerate config",
            file=recipe_file,
        )
    if version == 2 and (problem := unsteppable_optimizer(recipe.get("optim"))):
        c.error("optim", *problem, file=recipe_file)
    if as_bool(recipe.get("cpu_bf16")) and mp != "bf16" and not as_bool(recipe.get("bf16")):
        c.error(
            "cpu_bf16",
            f"keeps bf16 mixed precision on a CPU without native bf16, and mixed_precision is {mp}",
            "drop cpu_bf16, or set mixed_precision: bf16 in the accelerate config",
            file=recipe_file,
        )


def check_model(
    c: Checker, fsdp: dict, wrap, sd_type, model: str, trust_remote_code: bool = False, revision: str | None = None
) -> None:
    """The accelerate config's settings against the model's config (a hub id's at ``revision``, None: main): the
    layer class to wrap, the state dict type for its size."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from fsdp_recipes.config.model_source import (
        config_size_problem,
        custom_code,
        hub_config_problem,
        model_source_problem,
        remote_code_problem,
    )

    source = str(Path(model).parent) if model.endswith(".json") else model
    if (
        source == model
        and Path(model).is_dir()
        and not (Path(model) / "config.json").is_file()
        and (problem := model_source_problem(model, weights=True))
    ):
        why, _, fix = problem.partition(": ")
        c.error("model", f"{model} {why}", fix or "give the folder that holds the model's config.json")
        return
    # the checks need its config; nothing here can fetch it
    if problem := hub_config_problem(source, revision):
        c.warn("model", f"{model} {problem[0]}; model checks skipped", problem[1])
        return
    if problem := remote_code_problem(source, trust_remote_code, revision=revision) or config_size_problem(
        source, revision
    ):
        c.error("model", f"{model} {problem[0]}", problem[1])
        return
    if trust_remote_code and (entries := custom_code(source, revision=revision)[0]):
        c.warn(
            "trust_remote_code",
            f"runs the Python files {model}'s config.json names ({', '.join(entries[:3])}) in every "
            "process, with your permissions",
            "keep it only for code you have read; models transformers has need none",
        )
    try:
        # False: never prompts, never runs code
        config = AutoConfig.from_pretrained(source, trust_remote_code=trust_remote_code, revision=revision)
    except (OSError, ValueError) as err:
        c.warn(
            "model",
            f"could not read the config of {model!r} ({type(err).__name__}); model checks skipped",
            "give a local folder or config.json",
        )
        return
    with torch.device("meta"):
        skeleton = AutoModelForCausalLM.from_config(config, trust_remote_code=trust_remote_code)
    classes = {type(m).__name__ for m in skeleton.modules()}
    layer = next(iter(sorted(internals.attr(skeleton, "transformers.PreTrainedModel._no_split_modules") or [])), None)
    wanted = fsdp.get("fsdp_transformer_layer_cls_to_wrap")
    if wrap == "TRANSFORMER_BASED_WRAP" and wanted:
        for name in [w.strip() for w in str(wanted).split(",") if w.strip()]:
            if name not in classes:
                fix = f"use {layer}, {type(skeleton).__name__}'s decoder layer" if layer else suggest(name, classes)
                c.error(
                    "fsdp_config.fsdp_transformer_layer_cls_to_wrap",
                    f"{name!r} is not a module class of {type(skeleton).__name__}",
                    fix,
                )
    params = sum(p.numel() for p in skeleton.parameters())
    if sd_type == "FULL_STATE_DICT" and params > LARGE_MODEL:
        c.warn(
            "fsdp_config.fsdp_state_dict_type",
            f"FULL_STATE_DICT gathers all {params / 1e9:.1f}B parameters on rank 0 at every save",
            "use SHARDED_STATE_DICT and tools/merge_checkpoint.py",
        )
