"""Model and tokenizer: fine-tune weights from the hub or a folder, or build from a config for pre-training."""

from __future__ import annotations

import os
from pathlib import Path

import torch
import torch.distributed as dist
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, PreTrainedModel, PreTrainedTokenizerBase

from fsdp_recipes.ckpt import base_identity
from fsdp_recipes.ckpt.layout import BASE_STAGING, LORA_BASE_DIR
from fsdp_recipes.compat import cpu_fsdp, rank0_loading
from fsdp_recipes.config.model_arguments import ModelArguments
from fsdp_recipes.config.strategy import as_flag
from fsdp_recipes.console import say
from fsdp_recipes.errors import CheckpointError, RecipeError
from fsdp_recipes.removal import is_ours, make_folder, move, remove, unmark
from fsdp_recipes.train.chat_tokens import (
    align_generation_eos,
    apply_recipe_tokens,
    fit_embeddings,
    lora_growth_problem,
    revision,
)
from fsdp_recipes.train.sharding import expected_fsdp_version


def load_tokenizer(args: ModelArguments) -> PreTrainedTokenizerBase:
    tokenizer = AutoTokenizer.from_pretrained(
        args.tokenizer_name, trust_remote_code=args.trust_remote_code, revision=revision(args, args.tokenizer_name)
    )
    # the recipe's chat_template and eos_token (TRL's)
    apply_recipe_tokens(tokenizer, args)
    if problem := lora_growth_problem(tokenizer, args):
        raise RecipeError(problem)
    if tokenizer.pad_token is None:
        # Packed blocks need no padding; chat batches pad, and the padded labels are ignored anyway.
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def load_model(args: ModelArguments, tokenizer: PreTrainedTokenizerBase) -> PreTrainedModel:
    dtype = "auto" if args.dtype == "auto" else getattr(torch, args.dtype)
    common = {"trust_remote_code": args.trust_remote_code, "attn_implementation": args.attn_implementation}
    # QLoRA (CUDA only: arguments.qlora_problem refused anything else before we got here)
    if args.load_in_4bit:
        from transformers import BitsAndBytesConfig

        common["quantization_config"] = BitsAndBytesConfig(
            load_in_4bit=True,
            bnb_4bit_quant_type=args.bnb_4bit_quant_type,
            bnb_4bit_use_double_quant=args.use_bnb_nested_quant,
            bnb_4bit_compute_dtype=getattr(torch, args.bnb_4bit_compute_dtype),
            bnb_4bit_quant_storage=getattr(torch, args.bnb_4bit_quant_storage),
        )
    efficient_loading = cpu_fsdp.fsdp_requested() and as_flag(os.environ.get("FSDP_CPU_RAM_EFFICIENT_LOADING", "false"))
    rank0_only = args.model_name_or_path is not None and not args.load_in_4bit and efficient_loading
    fsdp1 = expected_fsdp_version() == 1
    if rank0_only and not fsdp1:
        # every rank: after wrapping, rank 0 scatters each rank its rows of every parameter
        rank0_loading.install()
    if rank0_only and fsdp1 and not cpu_fsdp.accelerator_present():
        # the sync of module states never writes into the file's pages
        rank0_loading.install_fsdp1()
    # rank 0 sends, every other rank receives what it holds
    receives = rank0_only and dist.is_initialized()
    other_rank = receives and dist.get_rank() != 0
    if args.model_name_or_path is not None:
        if other_rank:
            # rank 0 sends the weights; FSDP shards them as they arrive
            common["device_map"] = "meta"
        # safetensors only: a hub model's .bin would be unpickled here (a local or cached one is refused
        # before the launch)
        model = AutoModelForCausalLM.from_pretrained(
            args.model_name_or_path,
            dtype=dtype,
            use_safetensors=True,
            revision=revision(args, args.model_name_or_path),
            **common,
        )
        # None where the weights are on meta
        problem = non_finite_weight(model, args.model_name_or_path, args.dtype)
        # only rank 0 read the files: its verdict stops every rank alike, not rank 0 alone
        if receives:
            box = [problem]
            dist.broadcast_object_list(box, src=0)
            problem = box[0]
        if problem:
            raise RecipeError(problem)
    else:
        config = AutoConfig.from_pretrained(args.config_name, trust_remote_code=args.trust_remote_code)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32 if dtype == "auto" else dtype, **common)
    # the ChatML set-up's new tokens get rows
    fit_embeddings(model, tokenizer, args)
    # generate() of the saved model stops where a turn ends
    align_generation_eos(model, tokenizer, args)
    vocab = model.get_input_embeddings().weight.shape[0]
    if len(tokenizer) > vocab:
        raise RecipeError(
            f"tokenizer {args.tokenizer_name!r} has {len(tokenizer)} tokens but the model's embedding has "
            f"{vocab} rows; "
            "use the model's own tokenizer"
        )
    if args.use_peft:
        model = add_lora(model, args)
        if not fsdp1 and efficient_loading and lora_on_tied_head(model):
            raise RecipeError(
                "LoRA on the LM head of a model with tied embeddings (lora_target_modules names it) fails in "
                "accelerate "
                "1.15's FSDP2 preparation with fsdp_cpu_ram_efficient_loading (tie_weights: \"attribute "
                "'weight' already "
                'exists"): leave the head out of lora_target_modules, or set fsdp_cpu_ram_efficient_loading: false in '
                "your copy of the config"
            )
    if receives:
        if other_rank:
            model = rank0_loading.hollow_weights(model)
        model = rank0_loading.receive_buffers(model)
        say(
            "rank-0-only loading: ranks other than 0 build the model on the meta device, not from the files, and "
            + ("FSDP1 fills each unit from rank 0 as it wraps it" if fsdp1 else "rank 0 scatters each rank its rows")
        )
    return model


def non_finite_weight(model: PreTrainedModel, source: str, dtype: str) -> str | None:
    """Why the weights loaded from ``source`` cannot be trained, in one line: the first parameter holding NaN or Inf
    (a damaged file, or a value past float16's range), which would make every loss NaN and be saved as a model of
    NaNs without a word; None when every value is finite. Weights on the meta device (not read by this rank) and
    integer storage (4-bit) are not checked. Read in chunks of 1M elements: the check holds at most a 1 MB mask, never
    a copy of a weight (a larger mask, kept by malloc for reuse, would show in rank 0's loading peak)."""
    for name, param in model.named_parameters():
        if param.is_meta or not param.is_floating_point():
            continue
        flat = param.detach().reshape(-1)
        if all(torch.isfinite(chunk).all() for chunk in flat.split(1 << 20)):
            continue
        count = sum(int((~torch.isfinite(chunk)).sum()) for chunk in flat.split(1 << 20))
        overflow = (
            " (--dtype float16 turns values past 65504 into Inf: load it as bfloat16 or float32)"
            if dtype == "float16"
            else ""
        )
        loaded = str(param.dtype).removeprefix("torch.")
        return (
            f"the model {source} has {count} non-finite value(s) (NaN or Inf) in {name} as loaded ({loaded})"
            f"{overflow}: every loss would be NaN and the saved model NaN too; use a model whose weights are finite "
            "(download or export it again)"
        )
    return None


def add_lora(model: PreTrainedModel, args: ModelArguments):
    """The model wrapped by peft with a LoRA adapter: only the adapter trains. The Trainer gives FSDP a wrap
    policy that keeps LoRA layers in units of their own (transformers' update_fsdp_plugin_peft)."""
    from peft import LoraConfig

    # without peft's deprecated-alias warning
    from fsdp_recipes.compat.peft_lora import get_peft_model

    targets = args.lora_target_modules or "all-linear"
    try:
        config = LoraConfig(
            r=args.lora_r,
            lora_alpha=args.lora_alpha,
            lora_dropout=args.lora_dropout,
            target_modules=targets,
            task_type="CAUSAL_LM",
        )
        return get_peft_model(model, config)
    # e.g. a target module name the model does not have
    except ValueError as err:
        raise RecipeError(f"LoRA: {err}") from None


def lora_on_tied_head(model) -> bool:
    """The LM head is a LoRA layer and shares its weight with the input embedding."""
    from peft.tuners.lora import LoraLayer

    head, embedding = model.get_output_embeddings(), model.get_input_embeddings()
    if not isinstance(head, LoraLayer):
        return False
    return head.get_base_layer().weight is getattr(embedding, "weight", None)


# config.json keys that say nothing of the weights' shapes: they may differ between the saved base and the recipe's
# config
_CONFIG_BOOKKEEPING = base_identity.CONFIG_BOOKKEEPING


def lora_base(args: ModelArguments, output_dir: str) -> str | None:
    """Where a LoRA run built from ``config_name`` keeps its base: ``output_dir/base_model`` (None for any other run).
    Its frozen base is random, so no other copy of it exists: saved once, the adapter's adapter_config.json names a
    base that loads, checkpoints need not hold it, and a resume starts from the very same weights."""
    if not args.use_peft or args.model_name_or_path is not None:
        return None
    return str(Path(output_dir) / LORA_BASE_DIR)


def use_lora_base(args: ModelArguments, output_dir: str, log=print) -> None:
    """A LoRA run built from a config trains on its saved base (``lora_base``): global rank 0 saves it (or checks the
    one
    saved before), then every rank loads it as the model to fine-tune. Every rank stops alike on a problem."""
    import torch.distributed as dist

    if (base := lora_base(args, output_dir)) is None:
        return
    problem = None
    if not dist.is_initialized() or dist.get_rank() == 0:
        try:
            save_lora_base(args, base, log)
        except RecipeError as err:
            problem = str(err)
    if dist.is_initialized():
        box = [problem]
        # also the barrier: no rank loads the base before it is there
        dist.broadcast_object_list(box, src=0)
        problem = box[0]
    if problem:
        raise RecipeError(problem)
    args.model_name_or_path, args.config_name = base, None


def save_lora_base(args: ModelArguments, base: str, log=print) -> None:
    """Build the model of ``args.config_name`` (from the current RNG state, left as it was: every rank goes on alike)
    and save it with its tokenizer as the folder ``base``, whole or not at all. A base an earlier run of this
    output_dir saved is kept when its config matches (a resume trains on the weights its checkpoints were made on);
    another model's is refused. Global rank 0 alone calls it, before any rank loads the model."""
    out = Path(base)
    config = AutoConfig.from_pretrained(args.config_name, trust_remote_code=args.trust_remote_code)
    if out.is_symlink() or ((out.exists() or out.is_symlink()) and not (out / "config.json").is_file()):
        # a link leads to weights this run did not save; a folder without config.json is not a base at all: either is
        # someone else's, neither used nor replaced, and refused before a base is built beside it
        raise RecipeError(
            f"{base} is {'a link' if out.is_symlink() else 'not a saved LoRA base (no config.json)'}: a LoRA run "
            "built from config_name keeps its base there; choose another --output_dir, or move it away"
        )
    if (out / "config.json").is_file():
        saved = AutoConfig.from_pretrained(base, trust_remote_code=args.trust_remote_code).to_dict()
        wanted = config.to_dict()
        if differ := sorted(
            k for k in (set(saved) | set(wanted)) - _CONFIG_BOOKKEEPING if saved.get(k) != wanted.get(k)
        ):
            raise RecipeError(
                f"{base} holds another model's base than config_name {args.config_name!r} describes "
                f"({', '.join(differ[:3])} "
                "differ(s)): it is an earlier run's LoRA base; choose another --output_dir, or move that folder away"
            )
        log(f"LoRA base: {base}, saved by an earlier run of this output_dir (built from {args.config_name})")
        return
    staging = out.parent / ".base-tmp"
    # a run killed while saving its base
    if is_ours(staging, BASE_STAGING):
        remove(staging, BASE_STAGING)
    make_folder(staging, BASE_STAGING)
    try:
        dtype = torch.float32 if args.dtype == "auto" else getattr(torch, args.dtype)
        # the ranks that do not build it keep the same RNG state as this one
        with torch.random.fork_rng(devices=[]):
            model = AutoModelForCausalLM.from_config(config, dtype=dtype, trust_remote_code=args.trust_remote_code)
        model.save_pretrained(str(staging))
        AutoTokenizer.from_pretrained(args.tokenizer_name, trust_remote_code=args.trust_remote_code).save_pretrained(
            str(staging)
        )
        # a later run notices a changed base
        base_identity.write(staging, base_identity.identity(staging, name=base))
        move(staging, out)
    except BaseException:
        # nothing half-saved is left to block the next run
        if is_ours(staging, BASE_STAGING):
            remove(staging, BASE_STAGING)
        raise
    unmark(out, BASE_STAGING)
    log(
        f"LoRA base: built from {args.config_name} (random weights, frozen) and saved once to {base}; the "
        "adapter names it "
        "(adapter_config.json: base_model_name_or_path) and the run loads it from there"
    )


def lora_base_identity(args: ModelArguments, resume_from_checkpoint: str | None, log=print) -> dict | None:
    """The identity of a LoRA run's base model (fsdp_recipes.ckpt.base_identity), computed by global rank 0 once
    the model is loaded (a hub base is in the local cache by then), and checked against the record of the checkpoint
    being resumed and of a base this run saved (output_dir/base_model): a base replaced, zeroed or truncated since
    is refused, on every rank alike, before training. Returns the record on rank 0 (written into every checkpoint
    and the adapter folder), None elsewhere and for runs without LoRA."""
    if not args.use_peft:
        return None
    record = problem = None
    if not dist.is_initialized() or dist.get_rank() == 0:
        try:
            # the snapshot the model was loaded from
            at = revision(args, args.model_name_or_path)
            record, problem = _base_identity(args.model_name_or_path, resume_from_checkpoint, log, at)
        except (CheckpointError, OSError) as err:
            problem = f"the base model {args.model_name_or_path} cannot be checked: {err}"
    if dist.is_initialized():
        box = [problem]
        dist.broadcast_object_list(box, src=0)
        problem = box[0]
    if problem:
        raise RecipeError(problem)
    return record


def _base_identity(name: str, ckpt: str | None, log, at: str | None = None) -> tuple[dict | None, str | None]:
    folder = base_identity.local_folder(name, at)
    if folder is None or not any(folder.glob("*.safetensors")):
        # the checkpoint names its base: this one cannot be compared
        if ckpt is not None and base_identity.read(ckpt) is not None:
            return None, (
                f"{ckpt} records the base it was trained on, and the base model {name} has no local safetensors "
                "weights "
                "to compare (a .bin-only folder?): resume with that base (--model_name_or_path), or start "
                "without --resume_from_checkpoint"
            )
        log(
            f"LoRA base {name}: no local safetensors weights to record (checkpoints will not be able to check "
            "the base they resume on)"
        )
        return None, None
    record = base_identity.identity(folder, name=name)
    if (saved := base_identity.read(folder)) and (diff := base_identity.difference(saved, record)):
        return None, (
            f"the LoRA base {folder} changed since a run saved it ({diff}): restore it, or move it away to build "
            "a new one (the adapters and checkpoints trained on it then no longer apply)"
        )
    if ckpt is None:
        return record, None
    if (saved := base_identity.read(ckpt)) is None:
        log(
            f"{ckpt} records no base model ({base_identity.BASE_IDENTITY}: a checkpoint of an older run or of "
            "another tool): "
            f"the base {name} is not checked against it"
        )
    elif diff := base_identity.difference(saved, record):
        return None, (
            f"the base model {name} is not the one {ckpt} was trained on ({saved.get('base_model')}, recorded in its "
            f"{base_identity.BASE_IDENTITY}): {diff}; resume with that base (--model_name_or_path), or start without "
            "--resume_from_checkpoint"
        )
    return record, None
