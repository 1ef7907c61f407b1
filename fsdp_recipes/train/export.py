"""Saving from a live training run: every checkpoint self-describing, every run ending in a model folder.

Each checkpoint gets its description, report and digests (DescribeCheckpoints). The final export is written by
every rank in parallel (save_final_model: write_part, wait_for_parts) with the conversion of
``fsdp_recipes.ckpt.merge``, the code behind tools/merge_checkpoint.py, and published as the one path to a model
folder does (fsdp_recipes.train.model_folder).
"""

from __future__ import annotations

import copy
import json
import logging
import os
import threading
import time
from pathlib import Path

import torch
from transformers import TrainerCallback

from fsdp_recipes.bounded import JSON_LIMIT, STATE_LIMIT, load_json, read_text, short_json
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
from fsdp_recipes.ckpt.merge import lora_merge_input, write_weight_part
from fsdp_recipes.ckpt.readers import DCPSource, dtype_name
from fsdp_recipes.ckpt.shard_digests import write_shard_digests
from fsdp_recipes.compat.async_dcp import ShardFiles, checkpoint_saves
from fsdp_recipes.errors import CheckpointError, RecipeError, UnreadableFile
from fsdp_recipes.removal import make_folder, remove, replace_file
from fsdp_recipes.train.model_folder import (
    publish,
    publish_adapter,
    remove_export_leftovers,
    stage_adapter_folder,
    write_final_folder,
)
from fsdp_recipes.train.sharding import read_run_report, unwrapped_model_class, update_run_report

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
        self.base_record = None  # a LoRA run's base identity (Run.build sets it)

    def describe(self, folder: Path) -> None:
        model = self.trainer.accelerator.unwrap_model(self.trainer.model)
        files = save_model_description(model, self.tokenizer, folder, self.base_record)
        try:
            write_manifest(folder, lora_parts(model)[0].config, files)
        except Exception as err:  # only a shortcut for the merge, never worth a failed run
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
        seal_manifest(folder)  # the description files as the run left them: a later change is then named
        write_shard_digests(folder, (DCP_MODEL_DIR, OPTIMIZER_DIR))  # a swapped or replaced shard is then named


def save_final_model(trainer, tokenizer, save_dtype: str = "auto") -> None:
    """Leave a complete Hugging Face model folder in ``output_dir/model/``, whatever the state-dict type, its
    weights in ``export_dtype(model, save_dtype)``: only what from_pretrained and an upload need (the run's records,
    checkpoints and lock stay in output_dir; a LoRA run's adapter goes to ``output_dir/adapter/``).

    Under SHARDED_STATE_DICT the stock ``Trainer.save_model`` writes nothing, so every rank saves its shard with DCP
    (collective, as every checkpoint), then every rank streams its part of the safetensors files from those shards
    (memory bounded by the largest tensor): rank r writes shards r, r+N, ... (safetensors_writer.write_weights). A
    LoRA run's shards hold the base and the adapter: each rank merges the adapter into the base weights of its own
    shards, tensor by tensor, as tools/merge_checkpoint.py does (ckpt.merge.lora_merge_input), and rank 0 also
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
    gathered_lora = via_shards and not sharded  # FULL_STATE_DICT LoRA: rank 0 merges pytorch_model_fsdp.bin alone
    if accelerator.is_main_process:
        remove_export_leftovers(out, log=logger.info)
        if not gathered_lora:  # write_final_folder merges into a staging folder of its own
            make_folder(staging, EXPORT_STAGING)
        if via_shards:
            make_folder(shards, EXPORT_STAGING)
            if lora is not None:  # the adapter's config (and the base's record) beside the shards, for every rank's
                # merge: written before the barrier below
                save_model_description(model, tokenizer, shards, trainer.describer.base_record)
    if plugin is None and lora is not None:  # a run without FSDP (--allow_no_fsdp): the whole model is here
        if accelerator.is_main_process:
            adapter_staging = out / ADAPTER_STAGING
            make_folder(adapter_staging, EXPORT_STAGING)
            model.save_pretrained(str(adapter_staging))
            if trainer.describer.base_record is not None:
                base_identity.write(adapter_staging, trainer.describer.base_record)
            model.merge_and_unload().save_pretrained(str(staging))
            publish(staging, out, [*save_model_description(base, tokenizer, staging), *weight_files(staging)])
            publish_adapter(adapter_staging, out)  # after the model it goes with, as the sharded export
        return  # no barrier: the other ranks have nothing left to do (see the docstring)
    if not via_shards:
        accelerator.wait_for_everyone()  # the staging folder exists before any rank writes into it
        trainer.save_model(str(staging))  # the gather inside is collective; rank 0's write after it is not
        if accelerator.is_main_process:
            described = save_model_description(
                model, tokenizer, staging
            )  # save_pretrained names the FSDP<Model> subclass
            publish(
                staging, out, [*described, *weight_files(staging)]
            )  # not the Trainer's training_args.bin (a pickle)
        return
    accelerator.wait_for_everyone()
    with checkpoint_saves(ShardFiles(), direct=False):  # a failed write raises its own error (a full disk)
        save_fsdp_model(plugin, accelerator, trainer.model, str(shards))
    accelerator.wait_for_everyone()  # every rank's DCP shard is written: the last collective of the run
    if gathered_lora:
        if accelerator.is_main_process:
            write_final_folder(shards, out, log=logger.info, dtype=cast)
            remove(shards, EXPORT_STAGING)
            record_export(out, {"dtype": dtype, "writers": 1, "seconds": round(time.monotonic() - started, 3)})
        return
    rank, world = accelerator.process_index, accelerator.num_processes
    said = logger.info if accelerator.is_main_process else lambda line: None
    merged = []  # a LoRA run's resolved input: whether its base was dequantized (QLoRA)

    def open_source():
        if lora is None:
            return DCPSource(shards / DCP_MODEL_DIR)
        merged.append(lora_merge_input(shards, log=said))
        return merged[0].source

    model_cls, _, weight_names = write_part(open_source, staging, base.config, (rank, world), cast)
    if not accelerator.is_main_process:
        return
    # the adapter folder, as tools/merge_checkpoint.py --adapter-only writes it, published after the model
    adapter = stage_adapter_folder(shards, out, log=logger.info) if lora is not None else None
    config, dequantized = copy.deepcopy(base.config), bool(merged) and merged[0].dequantized  # its dtype gets set
    generation = getattr(base, "generation_config", None)

    def describe(folder: Path) -> list[str]:
        return describe_folder(folder, model_cls, config, tokenizer, generation, dtype, dequantized)

    publish_parts(staging, out, world, weight_names, describe, dtype, started, adapter)
    remove(shards, EXPORT_STAGING)


def publish_parts(staging: Path, out: Path, world: int, weight_names: list, describe, dtype, started, adapter=None):
    """Rank 0's end of a parallel export: every rank's part written (wait_for_parts) and every weight file there, the
    description written (``describe(staging)``: the names of its files), ``out/model/`` published, then a LoRA run's
    staged ``adapter`` folder (nothing of this export is published when a part is missing), and the export recorded
    in the run's fsdp_report.json (writers: the ranks that wrote a file). Returns that record."""
    parts = wait_for_parts(staging, world, log=logger.info)
    if missing := [n for n in weight_names if not (staging / n).is_file()]:
        raise CheckpointError(
            f"the final export finished without {', '.join(missing[:3])} in {staging}: nothing was published; "
            "run the same command with --resume_from_checkpoint true to export the last checkpoint again"
        )
    described = describe(staging)
    size = sum((staging / n).stat().st_size for n in weight_names if n.endswith(".safetensors"))
    publish(staging, out, sorted(set(weight_names) | set(described)))
    if adapter is not None:
        publish_adapter(adapter, out)
    seconds = round(time.monotonic() - started, 3)
    writers = sum(1 for p in parts.values() if p["files"])
    record = {
        "dtype": dtype,
        "writers": writers,
        "shards": sum(n.endswith(".safetensors") for n in weight_names),
        "bytes": size,
        "seconds": seconds,
        "ranks": {str(r): p for r, p in sorted(parts.items())},
    }
    record_export(out, record)
    logger.info(
        f"final model: {size / 1e6:,.1f} MB in {dtype}, written by {writers} of {world} rank(s) in parallel in "
        f"{seconds:.1f} s (fsdp_report.json: export)"
    )
    return record


def weight_files(folder: Path) -> list[str]:
    """The weight files save_pretrained wrote into ``folder``."""
    return sorted(
        p.name
        for p in folder.iterdir()
        if p.name.startswith("model") and p.name.endswith((".safetensors", ".safetensors.index.json"))
    )


# Every shard of the final export is at most 5 GB (save_pretrained's default) and, above this size, about 1/N of the
# model, so that N ranks each write a share; a smaller model is written in fewer, larger shards.
PART_MIN_BYTES = 64 << 20
PART_MAX_BYTES = 5 * 10**9
PART_POLL_SECONDS = 1.0  # how often rank 0 looks for the other ranks' completion files
PART_NOTE_LIMIT = 64 << 10  # a part's .failed message or .alive heartbeat: one line
PART_LOG_SECONDS = 60.0  # how often it says whom it is waiting for
# A writing rank rewrites .part-K.alive (a counter) from a thread every PART_BEAT_SECONDS, however slow its writes;
# rank 0 gives up on a rank whose counter has not changed for PART_STALE_SECONDS by its own clock (no clock is
# compared across machines): a rank on another node that died or hangs, where no launcher stops rank 0 for it.
PART_BEAT_SECONDS = 10.0
PART_STALE_SECONDS = 300.0


def part_shard_size(total: int, world: int) -> int:
    """The largest shard of an export of ``total`` bytes by ``world`` ranks: every rank gets a shard when it can."""
    return min(PART_MAX_BYTES, max(PART_MIN_BYTES, -(-total // max(world, 1))))


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


def write_part(source, staging: Path, config, part: tuple[int, int], dtype, max_shard_size: int | None = None):
    """This rank's shards of the final folder into ``staging``, then its completion file: ``.part-K.done`` (the files
    and the seconds it took), or ``.part-K.failed`` (the error) before the error goes on up. ``source``: a checkpoint
    source, or a function that opens one (its errors are this rank's failure too). ``max_shard_size``: by default
    part_shard_size of the source's bytes (in ``dtype``) and the part's rank count. Returns what write_weight_part
    returns."""
    rank, started, stop = part[0], time.monotonic(), threading.Event()

    def beat():
        count = 0
        while True:
            count += 1
            (staging / f".part-{rank}.alive").write_text(f"{count}\n")
            if stop.wait(PART_BEAT_SECONDS):
                return

    beating = threading.Thread(target=beat, name="export-heartbeat", daemon=True)
    beating.start()
    try:
        if callable(source):
            source = source()
        if max_shard_size is None:
            size = sum(info.nbytes(dtype_name(dtype)) for info in source.tensors.values())
            max_shard_size = part_shard_size(size, part[1])
        result = write_weight_part(source, staging, config, part, dtype, max_shard_size)
    except BaseException as err:
        (staging / f".part-{rank}.failing").write_text(f"{type(err).__name__}: {err}"[:2000] + "\n")
        replace_file(
            staging / f".part-{rank}.failing", staging / f".part-{rank}.failed", EXPORT_STAGING
        )  # whole: rank 0 reads it
        raise
    finally:
        stop.set()
        beating.join()
    record = {"files": result[1], "seconds": round(time.monotonic() - started, 3)}
    (staging / f".part-{rank}.tmp").write_text(json.dumps(record) + "\n")
    replace_file(staging / f".part-{rank}.tmp", staging / f".part-{rank}.done", EXPORT_STAGING)  # whole, or absent
    return result


def wait_for_parts(staging: Path, world: int, log=print) -> dict[int, dict]:
    """Rank 0's wait for every rank's completion file, without a collective and so without a deadline on the writing:
    one that fails leaves ``.part-K.failed``, raised here; one that dies ends the launch on its machine (torch
    elastic stops the others), and one whose heartbeat (``.part-K.alive``) stops changing for PART_STALE_SECONDS
    is given up on, on any machine."""
    parts: dict[int, dict] = {}
    last_said = time.monotonic()
    beats: dict[int, tuple[str | None, float]] = dict.fromkeys(range(world), (None, last_said))  # last seen, when
    again = (
        "nothing was published; run the same command with --resume_from_checkpoint true to export the last checkpoint"
    )
    while len(parts) < world:
        for rank in sorted(set(range(world)) - set(parts)):
            failed, done = staging / f".part-{rank}.failed", staging / f".part-{rank}.done"
            if os.path.lexists(failed):  # in any form (a FIFO put there is named, not waited on)
                try:
                    why = read_text(failed, failed.name, PART_NOTE_LIMIT).strip()
                except UnreadableFile as err:
                    why = str(err)
                raise CheckpointError(f"rank {rank} failed writing its part of the final model ({why}): {again}")
            if os.path.lexists(done):
                try:
                    parts[rank] = load_json(done, done.name, JSON_LIMIT)
                except UnreadableFile as err:
                    raise CheckpointError(
                        f"rank {rank}'s record of its part of the final model: {err}; {again}"
                    ) from None
                files = parts[rank].get("files")
                if not (isinstance(files, list) and all(isinstance(f, str) for f in files)):
                    raise CheckpointError(
                        f"rank {rank}'s record of its part of the final model ({done}) names no list of files: {again}"
                    )
                continue
            try:
                beat = read_text(staging / f".part-{rank}.alive", f".part-{rank}.alive", PART_NOTE_LIMIT)
            except (OSError, UnreadableFile):
                beat = None
            if beat != beats[rank][0]:
                beats[rank] = (beat, time.monotonic())
            elif time.monotonic() - beats[rank][1] > PART_STALE_SECONDS:
                raise CheckpointError(
                    f"rank {rank} has shown no sign of life for {PART_STALE_SECONDS:.0f} s while writing its part "
                    f"of the final model ({staging / f'.part-{rank}.alive'} stopped changing): it died or "
                    f"hangs; {again}"
                )
        if len(parts) < world:
            if time.monotonic() - last_said >= PART_LOG_SECONDS:
                log(
                    "final model: waiting for rank(s) "
                    f"{', '.join(str(r) for r in sorted(set(range(world)) - set(parts)))} "
                    "to finish their shards (no timeout applies)"
                )
                last_said = time.monotonic()
            time.sleep(PART_POLL_SECONDS)
    return parts


def record_export(out: Path, export: dict) -> None:
    """The export's dtype, writers and time in the run's fsdp_report.json (rank 0; the report is the run's, when it
    exists)."""
    path = Path(out) / REPORT_NAME
    if path.is_file():
        update_run_report(path, lambda report: report.update(export=export))


def finished_checkpoint_step(training_args) -> int | None:
    """The step of the checkpoint being resumed when it already reaches max_steps, else None.

    The Trainer resumed at global_step == max_steps still runs one more optimizer step (transformers 5.23),
    so a job killed after its last checkpoint, while writing the final model, would end one step past the
    run that never stopped. Such a resume exports the checkpoint instead of training.
    """
    ckpt = training_args.resume_from_checkpoint
    if not ckpt or training_args.max_steps <= 0:
        return None
    try:  # the resume decision read it already; a file changed since is this one line, not a traceback
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
