"""Saving from a live training run: every checkpoint self-describing, every run ending in a model folder.

The conversion itself is ``fsdp_recipes.ckpt.merge``, the code behind ``tools/merge_checkpoint.py``: one path
turns shards into a model.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
from pathlib import Path

import torch
from transformers import TrainerCallback

from fsdp_recipes.ckpt.dcp import write_shard_digests
from fsdp_recipes.ckpt.description import describe_folder, write_manifest
from fsdp_recipes.ckpt.layout import (
    ADAPTER_CONFIG, DCP_MODEL_DIR, MANIFEST, OPTIMIZER_DIR, REPORT_NAME, is_exported_adapter,
)
from fsdp_recipes.ckpt.merge import write_model_files
from fsdp_recipes.ckpt.readers import DCPSource
from fsdp_recipes.errors import CheckpointError
from fsdp_recipes.removal import make_folder, move, remove, replace_file, unmark
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


def save_model_description(model, tokenizer, folder: str | os.PathLike) -> list[str]:
    """config.json (with the real class in architectures), generation config and tokenizer: no weights. For a peft
    model, the base model's and adapter_config.json, so the folder merges on its own (fsdp_recipes.ckpt.lora_merge)."""
    model, lora = lora_parts(model)
    files = describe_folder(Path(folder), unwrapped_model_class(model), model.config, tokenizer, getattr(model, "generation_config", None))
    if lora is not None:
        lora.save_pretrained(str(folder))
        files.append(ADAPTER_CONFIG)
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

    def describe(self, folder: Path) -> None:
        model = self.trainer.accelerator.unwrap_model(self.trainer.model)
        files = save_model_description(model, self.tokenizer, folder)
        try:
            write_manifest(folder, lora_parts(model)[0].config, files)
        except Exception as err:  # only a shortcut for the merge, never worth a failed run
            logger.warning(f"no {MANIFEST} in {folder} ({type(err).__name__}: {err}); merging it checks the config with transformers")

    def on_save(self, args, state, control, **kwargs):
        accelerator = self.trainer.accelerator
        folder = Path(args.output_dir) / f"checkpoint-{state.global_step}"
        if not state.is_world_process_zero:
            return  # FSDPTrainer._save_checkpoint has waited for every rank's files before this
        run_report = Path(args.output_dir) / REPORT_NAME
        if run_report.is_file():
            plugin = getattr(accelerator.state, "fsdp_plugin", None)
            report = json.loads(run_report.read_text())
            report["state_dict_type"] = str(plugin.state_dict_type).split(".")[-1] if plugin else None
            (folder / REPORT_NAME).write_text(json.dumps(report, indent=2) + "\n")
        write_shard_digests(folder, (DCP_MODEL_DIR, OPTIMIZER_DIR))  # a swapped or replaced shard is then named


def save_final_model(trainer, tokenizer) -> None:
    """Leave a complete Hugging Face model folder in ``trainer.args.output_dir``, whatever the state-dict type.

    Under SHARDED_STATE_DICT the stock ``Trainer.save_model`` writes nothing, so every rank saves its shard
    with DCP and rank 0 streams the shards into safetensors files (memory bounded by the largest tensor).
    Files are staged in a hidden folder and moved in at the end, config.json last.
    """
    from accelerate.utils import save_fsdp_model

    accelerator, out = trainer.accelerator, Path(trainer.args.output_dir)
    plugin = getattr(accelerator.state, "fsdp_plugin", None)
    model = accelerator.unwrap_model(trainer.model)
    base, lora = lora_parts(model)
    if plugin is None and lora is not None:  # a run without FSDP (--allow_no_fsdp): the whole model is here
        if accelerator.is_main_process:
            model.save_pretrained(str(out / ADAPTER_DIR))
            model.merge_and_unload().save_pretrained(str(out))
            save_model_description(base, tokenizer, out)
        accelerator.wait_for_everyone()
        return
    if plugin is None or ("SHARDED_STATE_DICT" not in str(plugin.state_dict_type) and lora is None):
        trainer.save_model(str(out))
        if accelerator.is_main_process:
            save_model_description(model, tokenizer, out)  # save_pretrained names the FSDP<Model> subclass
        accelerator.wait_for_everyone()
        return
    shards = out / ".final-sharded"
    if accelerator.is_main_process:
        remove_export_leftovers(out, log=logger.info)
        make_folder(shards, EXPORT_STAGING)
    accelerator.wait_for_everyone()
    save_fsdp_model(plugin, accelerator, trainer.model, str(shards))
    accelerator.wait_for_everyone()
    if accelerator.is_main_process and lora is not None:  # the merged model, and the adapter beside it
        save_model_description(model, tokenizer, shards)
        write_final_folder(shards, out, log=logger.info)
        remove(shards, EXPORT_STAGING)
    elif accelerator.is_main_process:
        staging = make_folder(out / ".export-tmp", EXPORT_STAGING)
        files = write_model_files(
            DCPSource(shards / DCP_MODEL_DIR), staging, model.config, tokenizer, getattr(model, "generation_config", None)
        )
        publish(staging, out, files)
        remove(shards, EXPORT_STAGING)
    accelerator.wait_for_everyone()


EXPORT_LEFTOVERS = (".final-sharded", ".export-tmp", ".adapter-tmp")  # this module's own staging folders in output_dir
EXPORT_STAGING = "export staging"  # their marker's purpose (fsdp_recipes.removal)
ADAPTER_DIR = "adapter"  # a LoRA run's adapter, beside the merged model: PeftModel.from_pretrained loads it




def remove_export_leftovers(out: Path, log=print) -> None:
    """The staging folders a final export killed midway left in ``out``: only ours (marked when made); a folder of
    another kind under one of these names is refused, in one line."""
    for name in EXPORT_LEFTOVERS:
        path = Path(out) / name
        if path.exists() or path.is_symlink():
            remove(path, EXPORT_STAGING)
            log(f"removed {path}, left by an export that did not finish")


def publish(staging: Path, out: Path, files: list[str]) -> None:
    """Move finished files into ``out``, config.json last: until it is there, the folder does not load."""
    for name in sorted(files, key=lambda n: n == "config.json"):
        replace_file(staging / name, out / name, EXPORT_STAGING)
    remove(staging, EXPORT_STAGING)


def finished_checkpoint_step(training_args) -> int | None:
    """The step of the checkpoint being resumed when it already reaches max_steps, else None.

    The Trainer resumed at global_step == max_steps still runs one more optimizer step (transformers 5.23),
    so a job killed after its last checkpoint, while writing the final model, would end one step past the
    run that never stopped. Such a resume exports the checkpoint instead of training.
    """
    ckpt = training_args.resume_from_checkpoint
    if not ckpt or training_args.max_steps <= 0:
        return None
    step = json.loads((Path(ckpt) / "trainer_state.json").read_text())["global_step"]
    return step if step >= training_args.max_steps else None


def export_checkpoint(ckpt: str | os.PathLike, out: str | os.PathLike, base_model: str | None = None, log=print) -> None:
    """The final model folder of a run, written from one of its checkpoints (tools/merge_checkpoint.py's code).
    ``base_model``: the run's own model source, for a checkpoint whose config.json is missing."""
    remove_export_leftovers(Path(out), log=log)
    write_final_folder(Path(ckpt), Path(out), base_model, log)


def write_final_folder(ckpt: Path, out: Path, base_model: str | None = None, log=print) -> None:
    """``out`` becomes the model folder of checkpoint ``ckpt``; a LoRA checkpoint gives the merged model and the
    adapter in ``out/adapter``."""
    from fsdp_recipes.ckpt.description import description_dirs
    from fsdp_recipes.ckpt.merge import merge_checkpoint
    from fsdp_recipes.ckpt.resolve import resolve_input

    staging = out / ".export-tmp"
    lora, adapter = (ckpt / ADAPTER_CONFIG).is_file(), out / ADAPTER_DIR
    if lora and (adapter.exists() or adapter.is_symlink()) and not is_exported_adapter(adapter):
        raise CheckpointError(f"{adapter} exists and is not an adapter folder an export wrote (only adapter files in a real "
                              "folder): move it out of output_dir, then run the same command again")
    if description_dirs(resolve_input(ckpt))[0] is not None:
        base_model = None  # the checkpoint describes itself
    result = merge_checkpoint(ckpt, staging, overwrite=True, base_model=base_model, log=log, output_purpose=EXPORT_STAGING)
    if lora:  # a LoRA run: the adapter too, in a folder of its own
        adapter_staging = out / ".adapter-tmp"
        merge_checkpoint(ckpt, adapter_staging, overwrite=True, adapter_only=True, log=log, output_purpose=EXPORT_STAGING)
        if adapter.exists():
            remove(adapter, "adapter folder", shape=is_exported_adapter)  # an earlier export's (checked above)
        unmark(adapter_staging, EXPORT_STAGING)
        move(adapter_staging, adapter)
    publish(staging, out, result.files)
    if (ckpt / "trainer_state.json").is_file():
        shutil.copy2(ckpt / "trainer_state.json", out / "trainer_state.json")
