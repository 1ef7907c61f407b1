"""What the checks decided: the one object that passes from argument parsing (fsdp_recipes.config.parse) to the
training script's preflight (fsdp_recipes.train.preflight), which carries it out. Data only: building a Plan
moves no file, patches nothing and joins no process group, so bad input fails on every rank in seconds and
leaves nothing behind."""

from __future__ import annotations

from argparse import Namespace
from dataclasses import dataclass, field
from pathlib import Path

from fsdp_recipes.ckpt.resume import SetAside
from fsdp_recipes.config.hub_push import HubPush
from fsdp_recipes.config.launcher import LaunchSettings
from fsdp_recipes.config.run_arguments import RunArguments


@dataclass
class Plan:
    # the parsed flags and recipe values: TrainingArguments is built from them
    raw: Namespace | None = None
    # FSDP asked for through TrainingArguments' --fsdp (the torchrun route)
    trainer_fsdp: bool = False
    # resume, set_aside and requeue_record: decided once per launch after the group starts (preflight.decide_resume)
    # the checkpoint to resume from
    resume: str | None = None
    # checkpoints to move out of the way first (renamed)
    set_aside: list[SetAside] = field(default_factory=list)
    # an earlier run's checkpoints --overwrite_output_dir deletes
    delete: list[Path] = field(default_factory=list)
    # the launcher's accelerate settings (fsdp_recipes.config.launcher)
    launch: LaunchSettings | None = None
    # per_device_train_batch_size: auto, chosen by preflight.start (config.batch_size)
    auto_batch: bool = False
    # that choice's line (rank 0), said once the training set is built (Run.build)
    auto_line: str | None = None
    # this script's own options
    run_args: RunArguments | None = None
    # what the resume decision said, printed once output_dir is held
    notes: list[str] = field(default_factory=list)
    # where --push_to_hub uploads the final model
    push: HubPush | None = None
    # a requeued SLURM job's progress, written to output_dir (ckpt.resume.check_requeue)
    requeue_record: dict | None = None
