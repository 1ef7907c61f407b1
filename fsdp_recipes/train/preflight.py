"""What train_fsdp.py does between checking its input and loading anything: the preflight section.

Argument parsing (fsdp_recipes.config.arguments) only reads and decides; it never moves a file, patches torch or joins
a process group, so bad input fails on every rank in seconds and changes nothing. Once every check has passed,
``Preflight`` (what parsing decided) is carried out here, in this order:

1. ``start``: make FSDP (or DDP) real where there is no accelerator (fsdp_recipes.compat.cpu_fsdp), build TrainingArguments,
   which starts accelerate's PartialState and joins the process group;
2. ``hold_output_dir``: one run per output_dir at a time; a POSIX lock on ``output_dir/.run.lock`` held by
   global rank 0 while it lives (the kernel drops it when the process dies, so a killed run never holds it);
3. ``apply``: on rank 0, set aside incomplete or superseded checkpoints and delete those --overwrite_output_dir
   named; every rank waits for it;
4. ``save_resolved_arguments``: the arguments in force (model, data, training, and the accelerate config) as
   ``output_dir/run_args.json``.
"""

from __future__ import annotations

import json
import os
import socket
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from fsdp_recipes.compat import cpu_fsdp
from fsdp_recipes.compat.torch_dcp import guard_torch_dcp
from fsdp_recipes.config.launcher import LaunchSettings

LOCK_NAME = ".run.lock"
ARGS_NAME = "run_args.json"
_held: list[int] = []  # the lock's file descriptor, open for the life of the process


@dataclass
class Preflight:
    raw: object  # the parsed flags and recipe values (argparse.Namespace): TrainingArguments is built from them
    trainer_fsdp: bool  # FSDP asked for through TrainingArguments' --fsdp (the torchrun route)
    resume: str | None = None
    set_aside: list[tuple[Path, str, str]] = field(default_factory=list)  # (checkpoint, prefix, why)
    delete: list[Path] = field(default_factory=list)
    launch: LaunchSettings | None = None  # the launcher's accelerate settings (fsdp_recipes.config.launcher)
    run_args: object = None  # fsdp_recipes.config.arguments.RunArguments: this script's own options
    cpu_ddp: bool = False  # DDP over gloo on a machine without an accelerator (cpu_fsdp.enable_ddp)
    requeue_record: dict | None = None  # a requeued SLURM job's progress, written to output_dir (check_requeue)

    def start(self):
        """Patch (CPU only) and build TrainingArguments: this joins the process group."""
        from transformers import TrainingArguments

        from fsdp_recipes.config.arguments import RecipeError, build

        guard_torch_dcp()  # a resume's DCP load unpickles nothing our allow-lists have not vetted
        # both must precede TrainingArguments, which creates accelerate's PartialState
        self.cpu_ddp = cpu_fsdp.enable_ddp(self.trainer_fsdp) if not cpu_fsdp.enable(self.trainer_fsdp) else False
        if getattr(self.raw, "ddp_find_unused_parameters", None) is None:
            # the Trainer's default (True without gradient checkpointing) makes DDP walk the autograd graph every
            # step for parameters a causal LM always uses; torch warns about it on every rank. FSDP ignores it.
            self.raw.ddp_find_unused_parameters = False
        if not cpu_fsdp.accelerator_present():
            self.raw.dataloader_pin_memory = False  # nothing to pin to: torch warns once per DataLoader otherwise
        try:
            training_args = build(TrainingArguments, self.raw)
        except ValueError as err:  # TrainingArguments.__post_init__ checks
            raise RecipeError(str(err).replace("\n", " ")) from None
        training_args.resume_from_checkpoint = self.resume
        return training_args

    def apply(self, training_args, say) -> None:
        """Rank 0 moves and deletes what parsing decided; the others wait for it."""
        if training_args.process_index == 0:
            self.carry_out(say)
        _barrier()

    def carry_out(self, say) -> None:
        """The moves and deletions themselves (one process: the caller decides which)."""
        from fsdp_recipes.ckpt.layout import is_checkpoint_folder
        from fsdp_recipes.ckpt.status import CHECKPOINT_PURPOSE, set_aside
        from fsdp_recipes.removal import remove

        for path, prefix, why in self.set_aside:
            if path.is_dir():
                say(f"{why}: moved {path.name} to {set_aside(path, prefix).name} (nothing deleted)")
        for path in self.delete:  # checked by check_output_dir before anything started; checked again here
            remove(path, CHECKPOINT_PURPOSE, shape=is_checkpoint_folder)
        if self.requeue_record is not None:
            from fsdp_recipes.config.arguments import REQUEUE_RECORD

            out = Path(self.raw.output_dir or "trainer_output")
            (out / REQUEUE_RECORD).write_text(json.dumps(self.requeue_record) + "\n")
        if self.delete:
            say(f"--overwrite_output_dir: deleted {len(self.delete)} checkpoint folder(s) of the earlier run in {self.delete[0].parent}")


def _barrier() -> None:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.barrier()


def _broadcast(value):
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return value
    box = [value]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def hold_output_dir(training_args) -> None:
    """Take output_dir for this run (global rank 0 holds the lock); every rank stops alike when another run has it."""
    from fsdp_recipes.config.arguments import RecipeError

    holder = None
    if training_args.process_index == 0:
        out = Path(training_args.output_dir)
        out.mkdir(parents=True, exist_ok=True)
        fd = os.open(out / LOCK_NAME, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            import fcntl

            fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            holder = os.pread(fd, 300, 0).decode(errors="replace").strip() or "another process"
            os.close(fd)
        else:
            os.ftruncate(fd, 0)
            os.pwrite(fd, f"host {socket.gethostname()}, pid {os.getpid()}, since {time.strftime('%Y-%m-%d %H:%M:%S')}\n".encode(), 0)
            _held.append(fd)
    holder = _broadcast(holder)
    if holder is not None:
        raise RecipeError(
            f"output_dir {training_args.output_dir!r} is in use by another run ({holder}): wait for it to end, or choose "
            "another --output_dir (a run that died holds nothing: its lock went with it)"
        )


def save_resolved_arguments(model_args, data_args, training_args, launch: LaunchSettings | None) -> None:
    """output_dir/run_args.json on rank 0: every argument in force, the accelerate config file's own text, and the
    accelerate settings in force (that file with the launch flags over it, or the FSDP_* variables)."""
    if training_args.process_index != 0:
        return
    config_file = launch.config_file if launch else None
    record = {
        "model": asdict(model_args), "data": asdict(data_args), "training": json.loads(training_args.to_json_string()),
        "accelerate_config_file": str(config_file) if config_file else None,
        "accelerate_config": config_file.read_text() if config_file and config_file.is_file() else None,
        "accelerate_settings": launch.config if launch else None,
        "accelerate_settings_from": launch.describe() if launch else None,
        "world_size": training_args.world_size,
    }
    path = Path(training_args.output_dir) / ARGS_NAME
    path.write_text(json.dumps(record, indent=2, default=str) + "\n")
