"""Saving from a live training run: every checkpoint self-describing, every run ending in a model folder.

Each checkpoint gets its description, report and digests (DescribeCheckpoints). The final export is written by
every rank in parallel (save_final_model, with fsdp_recipes.train.export_parts) with the conversion of
``fsdp_recipes.ckpt.merge``, the code behind tools/merge_checkpoint.py, and published as the one path to a model
folder does (fsdp_recipes.train.model_folder).
"""

from __future__ import annotations

import copy
import json
import logging
import os
import time
from pathlib import Path

import torch
from transformers import TrainerCallback

from fsdp_recipes.bounded import STATE_LIMIT, load_json, short_json
from fsdp_recipes.ckpt import base_identity
from fsdp_recipes.ckpt.description import describe_folder, seal_manifest, write_manifest
from fsdp_recipes.ckpt.layout import (
    ADAPTER_CONFIG,
    ADAPTER_STAGING,
    DCP_MODEL_DIR,
    EXPORT_STAGING,
    FINAL_SHARDS,
    MANIFEST,
    MODEL_STAGING,
    OPTIMIZER_DIR,
    REPORT_NAME,
    step_of_name,
)
from fsdp_recipes.ckpt.lora_input import lora_merge_input
from fsdp_recipes.ckpt.readers import DCPSource
from fsdp_recipes.ckpt.shard_digests import write_shard_digests
from fsdp_recipes.compat.async_dcp import ShardFiles, checkpoint_saves
from fsdp_recipes.errors import RecipeError, UnreadableFile
from fsdp_recipes.removal import make_folder, remove
from fsdp_recipes.train import export_parts
from fsdp_recipes.train.model_folder import (
    publish,
    publish_adapter,
    remove_export_leftovers,
    stage_adapter_folder,
    write_final_folder,
)
from fsdp_recipes.train.run_report import read_run_report
from fsdp_recipes.train.sharding import unwrapped_model_class

logger = logging.getLogger(__name__)


def lora_parts(model) -> tuple[torch.nn.Module, object | None]:
    """(the base model, the LoRA config) of a peft model; (model, None) for any other."""
    try:
        from peft import PeftModel
    except ImportError:
        return model, None
    if isinstance(model, PeftModel):
        return model.get_base_model(), model.peft_config[model.active_adapter]
    return model, None


def save_model_description(model, tokenizer, folder: str | os.PathLike, base_record: dict | None = None) -> list[str]:
    """config.json (with the real class in architectures), generation config and tokenizer: no weights. For a peft
    model, the base model's and adapter_config.json, so the folder merges on its own (fsdp_recipes.ckpt.lora_merge),
    and the base's identity (``base_record``, when known: a resume and a merge check the base they are given)."""
    model, lora = lora_parts(model)
    files = describe_folder(
        Path(folder), unwrapped_model_class(model), model.config, tokenizer, getattr(model, "generation_config", None)
    )
    if lora is not None:
        lora.save_pretrained(str(folder))
        files.append(ADAPTER_CONFIG)
        if base_record is not None:
            base_identity.write(folder, base_record)
    return files


class DescribeCheckpoints(TrainerCallback):
    """Write config and tokenizer into each checkpoint-N, which the Trainer leaves weights-only under
    SHARDED_STATE_DICT, so any checkpoint merges on its own (tools/merge_checkpoint.py), with a manifest
    (model_description.json) that spares the merge importing transformers to check them. FSDPTrainer calls
    ``describe`` before the Trainer writes anything into the folder, so a checkpoint whose trainer_state.json
    (written last) exists has them too. Then, once every rank has finished its files, the run's
    fsdp_report.json with the state-dict type (FSDP version, strategy and world size, which the shards
    themselves do not record: tools/check_checkpoint.py)."""

    def __init__(self, trainer, tokenizer):
        self.trainer, self.tokenizer = trainer, tokenizer
        # a LoRA run's base identity (Run.build sets it)
        self.base_record = None

    def describe(self, folder: Path) -> None:
        model = self.trainer.accelerator.unwrap_model(self.trainer.model)
        files = save_model_description(model, self.tokenizer, folder, self.base_record)
        try:
            write_manifest(folder, lora_parts(model)[0].config, files)
        # only a shortcut for the merge, never worth a failed run
        except Exception as err:
            logger.warning(
                f"no {MANIFEST} in {folder} ({type(err).__name__}: {err}); merging it checks the config with "
                "transformers"
            )

    def on_save(self, args, state, control, **kwargs):
        folder = Path(args.output_dir) / f"checkpoint-{state.global_step}"
        if (
            not state.is_world_process_zero
            or getattr(self.trainer, "async_saves", None)
            and self.trainer.async_saves.is_pending(folder)
        ):
            # FSDPTrainer._save_checkpoint has waited for every rank's files before this (or
            # AsyncCheckpoints will)
            return
        self.finish_checkpoint(folder)

    def finish_checkpoint(self, folder: Path) -> None:
        """The run's report and shard_digests.json, once every rank's files of ``folder`` are written (rank 0)."""
        accelerator = self.trainer.accelerator
        run_report = Path(self.trainer.args.output_dir) / REPORT_NAME
        if run_report.is_file():
            plugin = getattr(accelerator.state, "fsdp_plugin", None)
            if (report := read_run_report(run_report)) is not None:
                report["state_dict_type"] = str(plugin.state_dict_type).split(".")[-1] if plugin else None
                (folder / REPORT_NAME).write_text(json.dumps(report, indent=2) + "\n")
        # the description files as the run left them: a later change is then named
        seal_manifest(folder)
        # a swapped or replaced shard is then named
        write_shard_digests(folder, (DCP_MODEL_DIR, OPTIMIZER_DIR))


def save_final_model(trainer, tokenizer, save_dtype: str = "auto") -> None:
    """Leave a complete Hugging Face model folder in ``output_dir/model/``, whatever the state-dict type, its
    weights in ``export_dtype(model, save_dtype)``: only what from_pretrained and an upload need (the run's records,
    checkpoints and lock stay in output_dir; a LoRA run's adapter goes to ``output_dir/adapter/``).

    Under SHARDED_STATE_DICT the stock ``Trainer.save_model`` writes nothing, so every rank saves its shard with DCP
    (collective, as every checkpoint), then every rank streams its part of the safetensors files from those shards
    (memory bounded by the largest tensor): rank r writes shards r, r+N, ... (safetensors_writer.write_weights). A
    LoRA run's shards hold the base and the adapter: each rank merges the adapter into the base weights of its own
    shards, tensor by tensor, as tools/merge_checkpoint.py does (ckpt.lora_input.lora_merge_input), and rank 0 also
    writes the adapter folder. No rank waits on a collective after that, so no ``ddp_timeout`` bounds the
    conversion: each rank leaves a completion file in the staging folder and is done; rank 0 waits for those files
    (wait_for_parts: no deadline on the writing; a rank that fails says so in a file, one that dies or hangs stops
    its heartbeat file), then writes config and tokenizer and renames the staging folder to ``model/`` (publish).
    A LoRA run under FULL_STATE_DICT has its whole model gathered on rank 0, which merges it alone. A killed export
    leaves only marked staging folders: no ``model/`` that looks complete (remove_export_leftovers clears them next
    time).
    """
    from accelerate.utils import save_fsdp_model

    accelerator, out = trainer.accelerator, Path(trainer.args.output_dir)
    plugin = getattr(accelerator.state, "fsdp_plugin", None)
    model = accelerator.unwrap_model(trainer.model)
    base, lora = lora_parts(model)
    dtype = export_dtype(model, save_dtype)
    cast = None if dtype == parameter_dtype(model) else dtype
    started = time.monotonic()
    shards, staging = out / FINAL_SHARDS, out / MODEL_STAGING
    sharded = plugin is not None and "SHARDED_STATE_DICT" in str(plugin.state_dict_type)
    via_shards = sharded or (plugin is not None and lora is not None)
    # FULL_STATE_DICT LoRA: rank 0 merges pytorch_model_fsdp.bin alone
    gathered_lora = via_shards and not sharded
    if accelerator.is_main_process:
        remove_export_leftovers(out, log=logger.info)
        # write_final_folder merges into a staging folder of its own
        if not gathered_lora:
            make_folder(staging, EXPORT_STAGING)
        if via_shards:
            make_folder(shards, EXPORT_STAGING)
            # the adapter's config (and the base's record) beside the shards, for every rank's merge: written
            # before the barrier below
            if lora is not None:
                save_model_description(model, tokenizer, shards, trainer.describer.base_record)
    # a run without FSDP (--allow_no_fsdp): the whole model is here
    if plugin is None and lora is not None:
        if accelerator.is_main_process:
            adapter_staging = out / ADAPTER_STAGING
            make_folder(adapter_staging, EXPORT_STAGING)
            model.save_pretrained(str(adapter_staging))
            if trainer.describer.base_record is not None:
                base_identity.write(adapter_staging, trainer.describer.base_record)
            model.merge_and_unload().save_pretrained(str(staging))
            publish(staging, out, [*save_model_description(base, tokenizer, staging), *weight_files(staging)])
            # after the model it goes with, as the sharded export
            publish_adapter(adapter_staging, out)
        # no barrier: the other ranks have nothing left to do (see the docstring)
        return
    if not via_shards:
        # the staging folder exists before any rank writes into it
        accelerator.wait_for_everyone()
        # the gather inside is collective; rank 0's write after it is not
        trainer.save_model(str(staging))
        if accelerator.is_main_process:
            # save_pretrained names the FSDP<Model> subclass
            described = save_model_description(model, tokenizer, staging)
            # not the Trainer's training_args.bin (a pickle)
            publish(staging, out, [*described, *weight_files(staging)])
        return
    accelerator.wait_for_everyone()
    # a failed write raises its own error (a full disk)
    with checkpoint_saves(ShardFiles(), direct=False):
        save_fsdp_model(plugin, accelerator, trainer.model, str(shards))
    # every rank's DCP shard is written: the last collective of the run
    accelerator.wait_for_everyone()
    if gathered_lora:
        if accelerator.is_main_process:
            write_final_folder(shards, out, log=logger.info, dtype=cast)
            remove(shards, EXPORT_STAGING)
            seconds = round(time.monotonic() - started, 3)
            export_parts.record_export(out, {"dtype": dtype, "writers": 1, "seconds": seconds})
        return
    rank, world = accelerator.process_index, accelerator.num_processes
    said = logger.info if accelerator.is_main_process else lambda line: None
    # a LoRA run's resolved input: whether its base was dequantized (QLoRA)
    merged = []

    def open_source():
        if lora is None:
            return DCPSource(shards / DCP_MODEL_DIR)
        merged.append(lora_merge_input(shards, log=said))
        return merged[0].source

    model_cls, _, weight_names = export_parts.write_part(open_source, staging, base.config, (rank, world), cast)
    if not accelerator.is_main_process:
        return
    # the adapter folder, as tools/merge_checkpoint.py --adapter-only writes it, published after the model
    adapter = stage_adapter_folder(shards, out, log=logger.info) if lora is not None else None
    # its dtype gets set
    config, dequantized = copy.deepcopy(base.config), bool(merged) and merged[0].dequantized
    generation = getattr(base, "generation_config", None)

    def describe(folder: Path) -> list[str]:
        return describe_folder(folder, model_cls, config, tokenizer, generation, dtype, dequantized)

    export_parts.publish_parts(staging, out, world, weight_names, describe, dtype, started, adapter)
    remove(shards, EXPORT_STAGING)


def weight_files(folder: Path) -> list[str]:
    """The weight files save_pretrained wrote into ``folder``."""
    return sorted(
        p.name
        for p in folder.iterdir()
        if p.name.startswith("model") and p.name.endswith((".safetensors", ".safetensors.index.json"))
    )


def parameter_dtype(model) -> str:
    """The dtype the model's weights are trained in: that of its (base model's) floating parameters."""
    for param in lora_parts(model)[0].parameters():
        if param.is_floating_point():
            return str(param.dtype).removeprefix("torch.")
    return "float32"


def export_dtype(model, save_dtype: str = "auto") -> str:
    """The dtype of the final folder's weights: ``--save_dtype``, or for "auto" the dtype the weights were trained in
    (parameter_dtype: ModelArguments.dtype; under FSDP mixed precision the float32 master weights, not the bf16
    compute copies)."""
    return parameter_dtype(model) if save_dtype in (None, "auto") else save_dtype


def save_dtype_problem(trainer, save_dtype: str) -> str | None:
    """--save_dtype casts only where this module writes the weights itself (SHARDED_STATE_DICT): elsewhere the Trainer's
    save_model writes the parameters as they are. Checked before training, not after it."""
    model = trainer.accelerator.unwrap_model(trainer.model)
    plugin = getattr(trainer.accelerator.state, "fsdp_plugin", None)
    sharded = plugin is not None and (
        "SHARDED_STATE_DICT" in str(plugin.state_dict_type) or lora_parts(model)[1] is not None
    )
    if sharded or export_dtype(model, save_dtype) == parameter_dtype(model):
        return None
    return (
        f"save_dtype={save_dtype}: this run's final folder is written by the Trainer's save_model (no FSDP, or "
        f"fsdp_state_dict_type {str(getattr(plugin, 'state_dict_type', None)).split('.')[-1]}), in the parameters' "
        f"dtype {parameter_dtype(model)}: use an FSDP config with SHARDED_STATE_DICT, or leave save_dtype at auto and "
        f"cast afterwards with tools/merge_checkpoint.py CHECKPOINT OUT --dtype {save_dtype}"
    )


def finished_checkpoint_step(training_args) -> int | None:
    """The step of the checkpoint being resumed when it already reaches max_steps, else None.

    The Trainer resumed at global_step == max_steps still runs one more optimizer step (transformers 5.23),
    so a job killed after its last checkpoint, while writing the final model, would end one step past the
    run that never stopped. Such a resume exports the checkpoint instead of training.
    """
    ckpt = training_args.resume_from_checkpoint
    if not ckpt or training_args.max_steps <= 0:
        return None
    # the resume decision read it already; a file changed since is this one line, not a traceback
    try:
        step = load_json(Path(ckpt) / "trainer_state.json", "trainer_state.json", STATE_LIMIT).get("global_step")
    except UnreadableFile as err:
        raise RecipeError(f"{err} (it changed after the resume was decided)") from None
    named = step_of_name(ckpt)
    if type(step) is not int or step < 0 or (named is not None and step != named):
        raise RecipeError(
            f"{Path(ckpt) / 'trainer_state.json'}: global_step is {short_json(step)}, not the step the resume "
            "was decided on "
            f"(it changed since, or the folder was renamed): run the same command again"
        )
    return step if step >= training_args.max_steps else None
