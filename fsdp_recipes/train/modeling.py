"""Model and tokenizer: fine-tune weights from the hub or a folder, or build from a config for pre-training."""

from __future__ import annotations

import os

import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, PreTrainedModel, PreTrainedTokenizerBase

import torch.distributed as dist

from fsdp_recipes.compat import cpu_fsdp, rank0_loading
from fsdp_recipes.config.strategy import as_flag
from fsdp_recipes.config.arguments import ModelArguments
from fsdp_recipes.console import say
from fsdp_recipes.errors import RecipeError
from fsdp_recipes.train.sharding import expected_fsdp_version


def load_tokenizer(args: ModelArguments) -> PreTrainedTokenizerBase:
    tokenizer = AutoTokenizer.from_pretrained(args.tokenizer_name, trust_remote_code=args.trust_remote_code)
    if tokenizer.pad_token is None:
        # Packed blocks need no padding; chat batches pad, and the padded labels are ignored anyway.
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def load_model(args: ModelArguments, tokenizer: PreTrainedTokenizerBase) -> PreTrainedModel:
    dtype = "auto" if args.dtype == "auto" else getattr(torch, args.dtype)
    common = dict(trust_remote_code=args.trust_remote_code, attn_implementation=args.attn_implementation)
    if args.load_in_4bit:  # QLoRA (CUDA only: arguments.qlora_problem refused anything else before we got here)
        from transformers import BitsAndBytesConfig

        common["quantization_config"] = BitsAndBytesConfig(
            load_in_4bit=True, bnb_4bit_quant_type=args.bnb_4bit_quant_type, bnb_4bit_use_double_quant=args.use_bnb_nested_quant,
            bnb_4bit_compute_dtype=getattr(torch, args.bnb_4bit_compute_dtype), bnb_4bit_quant_storage=getattr(torch, args.bnb_4bit_quant_storage),
        )
    rank0_only = args.model_name_or_path is not None and not args.load_in_4bit and cpu_fsdp.fsdp_requested() \
        and as_flag(os.environ.get("FSDP_CPU_RAM_EFFICIENT_LOADING", "false"))
    fsdp1 = expected_fsdp_version() == 1
    if rank0_only and not fsdp1:
        rank0_loading.install()  # every rank: after wrapping, rank 0 scatters each rank its rows of every parameter
    if rank0_only and fsdp1 and not cpu_fsdp.accelerator_present():
        rank0_loading.install_fsdp1()  # the sync of module states never writes into the file's pages
    if args.model_name_or_path is not None:
        if rank0_only and dist.is_initialized() and dist.get_rank() != 0:
            common["device_map"] = "meta"  # rank 0 sends the weights; FSDP shards them as they arrive
        model = AutoModelForCausalLM.from_pretrained(args.model_name_or_path, dtype=dtype, **common)
    else:
        config = AutoConfig.from_pretrained(args.config_name, trust_remote_code=args.trust_remote_code)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32 if dtype == "auto" else dtype, **common)
    vocab = model.get_input_embeddings().weight.shape[0]
    if len(tokenizer) > vocab:
        raise RecipeError(
            f"tokenizer {args.tokenizer_name!r} has {len(tokenizer)} tokens but the model's embedding has {vocab} rows; "
            "use the model's own tokenizer"
        )
    if args.use_peft:
        model = add_lora(model, args)
    if rank0_only and dist.is_initialized():
        if dist.get_rank() != 0:
            model = rank0_loading.hollow_weights(model)
        model = rank0_loading.receive_buffers(model)
        say("rank-0-only loading: ranks other than 0 build the model on the meta device, not from the files, and "
            + ("FSDP1 fills each unit from rank 0 as it wraps it" if fsdp1 else "rank 0 scatters each rank its rows"))
    return model


def add_lora(model: PreTrainedModel, args: ModelArguments):
    """The model wrapped by peft with a LoRA adapter: only the adapter trains. The Trainer gives FSDP a wrap
    policy that keeps LoRA layers in units of their own (transformers' update_fsdp_plugin_peft)."""
    from peft import LoraConfig

    from fsdp_recipes.compat.peft_lora import get_peft_model  # without peft's deprecated-alias warning

    targets = args.lora_target_modules or "all-linear"
    try:
        config = LoraConfig(r=args.lora_r, lora_alpha=args.lora_alpha, lora_dropout=args.lora_dropout,
                            target_modules=targets, task_type="CAUSAL_LM")
        return get_peft_model(model, config)
    except ValueError as err:  # e.g. a target module name the model does not have
        raise RecipeError(f"LoRA: {err}") from None
