"""The run's fsdp_report.json after the sharding proof wrote it (fsdp_recipes.train.sharding): what later parts of
the run add to it (memory peaks, measured bytes, how checkpoints were written, the final export), read and written by
rank 0 alone, and never the end of a run when it has become unreadable.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

from fsdp_recipes.bounded import REPORT_LIMIT, load_json
from fsdp_recipes.ckpt.layout import REPORT_NAME
from fsdp_recipes.errors import UnreadableFile

logger = logging.getLogger("train_fsdp")


def read_run_report(path: Path) -> dict | None:
    """The run's fsdp_report.json at ``path``; one that is no longer readable (edited, replaced, cut short by a full
    disk) is a warning and None, never the end of a run that trains or exports."""
    try:
        return load_json(path, REPORT_NAME, REPORT_LIMIT)
    except UnreadableFile as err:
        logger.warning(f"{err}: the run goes on without updating it or copying it into its checkpoints")
        return None


def update_run_report(path: Path, update) -> None:
    """Apply ``update`` to the run's fsdp_report.json at ``path`` (read_run_report)."""
    if (report := read_run_report(path)) is not None:
        update(report)
        path.write_text(json.dumps(report, indent=2) + "\n")


def _update_report(output_dir: str, accelerator, update) -> None:
    """Apply ``update`` to fsdp_report.json, on the main process (the one that wrote it)."""
    if accelerator.is_main_process:
        update_run_report(Path(output_dir) / REPORT_NAME, update)


def add_peak_memory(output_dir: str, accelerator, peaks: list[dict]) -> None:
    def update(report):
        for rank, peak in zip(report["ranks"], peaks):
            rank["peak_memory"] = peak

    _update_report(output_dir, accelerator, update)


def add_checkpoint_writes(output_dir: str, accelerator, writes: dict) -> None:
    """How the run's checkpoints were written (fsdp_recipes.train.async_checkpoints.AsyncCheckpoints.report)."""
    _update_report(output_dir, accelerator, lambda report: report.update(checkpoint_writes=writes))


def add_measured_bytes(
    output_dir: str, accelerator, grads: list[int], states: list[dict], optimizer_dtype: str | None = None
) -> None:
    """Record each rank's measured bytes of model states (after the first optimizer step) in the report, and the
    dtype of the optimizer state."""

    def update(report):
        report.setdefault("precision", {})["optimizer_state"] = optimizer_dtype
        for rank, grad, state in zip(report["ranks"], grads, states):
            rank["bytes"] = {**state, "grads": grad}

    _update_report(output_dir, accelerator, update)
