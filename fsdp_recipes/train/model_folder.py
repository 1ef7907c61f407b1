"""A checkpoint to a model folder: the one path by which a run's model reaches ``output_dir/model/``.

A finished checkpoint (a resume of a run already at max_steps) and a LoRA run's gathered final weights
(FULL_STATE_DICT) are converted by ``fsdp_recipes.ckpt.merge``, the code behind tools/merge_checkpoint.py
(``write_final_folder``; a LoRA adapter's folder: ``stage_adapter_folder``, then ``publish_adapter``); the end of a
sharded run converts its own final shards with the same merge, each rank a part (fsdp_recipes.train.export). Every
way ends in ``publish``: a staging folder renamed into place whole, so there is never a half-written model folder.
``final_line`` and ``stale_model_note`` are what the run says about the folder afterwards.
"""

from __future__ import annotations

import logging
import os
import shutil
from pathlib import Path

from fsdp_recipes.ckpt.layout import (
    ADAPTER_CONFIG,
    ADAPTER_DIR,
    ADAPTER_STAGING,
    EXPORT_FOLDERS,
    EXPORT_STAGING,
    FINAL_MODEL_DIR,
    MODEL_STAGING,
    is_adapter_file,
    is_exported_adapter,
    is_model_folder,
    is_published,
    record_published,
)
from fsdp_recipes.direct_writes import sync_entries, sync_folder
from fsdp_recipes.removal import MARKER, entries, make_room, move, remove, remove_inside, unmark

# the export's lines, wherever its step lives
logger = logging.getLogger("fsdp_recipes.train.export")


def remove_export_leftovers(out: Path, log=print) -> None:
    """The staging folders a final export killed midway left in ``out``: only ours (marked when made); a folder of
    another kind under one of these names is refused, in one line."""
    for name in EXPORT_FOLDERS:
        path = Path(out) / name
        if path.exists() or path.is_symlink():
            remove(path, EXPORT_STAGING)
            log(f"removed {path}, left by an export that did not finish")


def publish(staging: Path, out: Path, files: list[str]) -> Path:
    """The finished staging folder becomes ``out/model/``, holding ``files`` and nothing else, in one rename: until
    then there is no new model folder, and never a half-written one. An earlier export's model folder is replaced
    (only one that holds nothing but model files); one holding anything else is moved aside, never deleted
    (make_room)."""
    for entry in staging.iterdir():
        if entry.name not in files and entry.name != MARKER:
            # completion files, the Trainer's training_args.bin
            remove_inside(staging, entry.name, EXPORT_STAGING)
    sync_folder(staging)
    final = make_room(
        out / FINAL_MODEL_DIR, "an earlier run's final model", is_model_folder, logger.warning, is_published
    )
    # before the rename: what is there after it and was not, is someone's
    written = entries(staging)
    move(staging, final)
    sync_entries(out)
    # the folder keeps its inode through the rename: still ours
    unmark(final, EXPORT_STAGING)
    record_published(out, final, written)
    return final


def publish_adapter(staging: Path, out: Path) -> Path:
    """The finished adapter staging folder becomes ``out/adapter/`` in one rename, holding only the adapter's files
    (not peft's README.md model card); an earlier export's adapter folder is replaced, anything else there refused."""
    for entry in staging.iterdir():
        if entry.name != MARKER and not is_adapter_file(entry.name):
            remove_inside(staging, entry.name, EXPORT_STAGING)
    adapter = make_room(
        out / ADAPTER_DIR, "an earlier run's adapter folder", is_exported_adapter, logger.warning, is_published
    )
    written = entries(staging)
    move(staging, adapter)
    unmark(adapter, EXPORT_STAGING)
    record_published(out, adapter, written)
    return adapter


def export_checkpoint(
    ckpt: str | os.PathLike, out: str | os.PathLike, base_model: str | None = None, log=print, dtype: str | None = None
) -> None:
    """The final model folder of a run (``out/model/``), written from one of its checkpoints
    (tools/merge_checkpoint.py's code).
    ``base_model``: the run's own model source, for a checkpoint whose config.json is missing. ``dtype``: cast the
    weights (--save_dtype; None or "auto" keeps the saved dtype)."""
    remove_export_leftovers(Path(out), log=log)
    write_final_folder(Path(ckpt), Path(out), base_model, log, dtype=None if dtype == "auto" else dtype)


def write_final_folder(
    ckpt: Path, out: Path, base_model: str | None = None, log=print, dtype: str | None = None
) -> None:
    """``out/model/`` becomes the model folder of checkpoint ``ckpt``; a LoRA checkpoint gives the merged model (cast to
    ``dtype`` when given) and the adapter in ``out/adapter``."""
    from fsdp_recipes.ckpt.merge import merge_checkpoint

    staging = out / MODEL_STAGING
    lora = (ckpt / ADAPTER_CONFIG).is_file()
    # a checkpoint with a config.json describes itself: base_model only stands in for one
    result = merge_checkpoint(
        ckpt, staging, overwrite=True, config_fallback=base_model, dtype=dtype, log=log, output_purpose=EXPORT_STAGING
    )
    # a LoRA run: the adapter too, in its own folder
    adapter = stage_adapter_folder(ckpt, out, log) if lora else None
    publish(staging, out, result.files)
    if adapter is not None:
        publish_adapter(adapter, out)
    if (ckpt / "trainer_state.json").is_file():
        shutil.copy2(ckpt / "trainer_state.json", out / "trainer_state.json")


def stage_adapter_folder(ckpt: Path, out: Path, log=print) -> Path:
    """The adapter of the LoRA checkpoint ``ckpt`` as PeftModel.from_pretrained loads it (tools/merge_checkpoint.py
    --adapter-only), written into the marked staging folder ``out/.adapter-tmp``: publish_adapter makes it
    ``out/adapter/`` only once the model it goes with is published, so model/ and adapter/ are always a pair."""
    from fsdp_recipes.ckpt.merge import merge_checkpoint

    adapter_staging = out / ADAPTER_STAGING
    merge_checkpoint(ckpt, adapter_staging, overwrite=True, adapter_only=True, log=log, output_purpose=EXPORT_STAGING)
    return adapter_staging


def stale_model_note(output_dir: str) -> str | None:
    """A run folder an earlier version wrote its model into (config.json and weights at its top level), resumed since:
    that model is an earlier step's, and stays where it is (ours to read, not to delete)."""
    out = Path(output_dir)
    if (out / "config.json").is_file() and any(
        (out / n).is_file() for n in ("model.safetensors", "model.safetensors.index.json")
    ):
        return (
            f"{out} still holds the model an earlier version of this repository wrote at its top level "
            "(config.json and "
            f"weights): it is an earlier step's; this run's final model is {out / FINAL_MODEL_DIR}. Delete the "
            "old files "
            "by hand if you no longer need them"
        )
    return None


def final_line(output_dir: str) -> str:
    """The run's last line: where the model is, alone in its folder (what from_pretrained and an upload take)."""
    out = Path(output_dir)
    adapter = (
        f"; its LoRA adapter: {out / ADAPTER_DIR}" if (out / ADAPTER_DIR / "adapter_config.json").is_file() else ""
    )
    return (
        f"model saved to {out / FINAL_MODEL_DIR} (only the model: loads with "
        "AutoModelForCausalLM.from_pretrained, uploads "
        f"with `hf upload`){adapter}; checkpoints and run records stay in {out}"
    )
