"""Asynchronous checkpoints: training goes on while a checkpoint's shards are written.

Where it applies (FSDP2 with SHARDED_STATE_DICT, every shipped FSDP2 config; not with load_best_model_at_end, which
loads a checkpoint inside the Trainer's own loop), each checkpoint-N is saved as before, except that the model's and
the optimizer's DCP shards go through DCP's ``async_save`` (fsdp_recipes.compat.async_dcp) and a thread writes them
while the next steps train. What it writes from (``--async_checkpoint_staging``):

- auto, where the rank's shards of the weights and of Adam's state live in host memory (CPU runs, CPU offload): the
  live tensors themselves. Forward and backward never change them; the optimizer step does, so the first optimizer
  step after the checkpoint waits until the write is done (a step pre-hook; its wait is in fsdp_report.json). No
  memory is added, and the training thread copies nothing.
- auto elsewhere (GPU), or copy: a host copy (the staging, as large as those shards: made after the first
  optimizer step on a thread of its own, filled at each checkpoint and reused by every one, so held for the run;
  stated at the start of the run); no step waits.

The small files (scheduler, RNG states, config, tokenizer) are written at once.

A checkpoint is complete only once every rank has finished: until then it has no trainer_state.json and no
shard_digests.json, so a run killed meanwhile (kill -9 included) resumes from the checkpoint before it
(``--resume_from_checkpoint true`` passes over an incomplete one and sets it aside). At the end of each optimizer
step the ranks agree, with one all-reduce of one number while a save is in flight, whether every write has
finished; the step that sees it writes shard_digests.json, then trainer_state.json (the Trainer's, as it was at the
checkpoint's step), then rotates the old checkpoints away. At most one save is in flight: the next checkpoint, the
end of training (a preemption's stop included, and the Trainer's end-of-training cleanup) and the final export wait
for it first. An exception abandons it: the writing threads finish their shard files, but nothing makes the
checkpoint complete.

``--async_checkpoints false`` writes every checkpoint before training goes on, as the stock Trainer does.

Either way (and under FSDP1), the DCP shard files are written past the page cache where the filesystem takes O_DIRECT
(fsdp_recipes.direct_writes: a fraction of the CPU a write through the cache costs, which a background write takes
from training); ``--direct_io_checkpoints false`` writes them through the page cache.
"""

from __future__ import annotations

import concurrent.futures
import copy
import dataclasses
import logging
import time
from contextlib import contextmanager
from pathlib import Path

from transformers import TrainerCallback

from fsdp_recipes.compat.async_dcp import Background, ShardFiles, checkpoint_saves
from fsdp_recipes.compat.host_copy import HostBuffers, ReusedHostCopy

logger = logging.getLogger(__name__)


@dataclasses.dataclass
class Pending:
    folder: Path
    step: int
    futures: list
    started: float
    # per save (model, optimizer): this rank's host copy
    staged_bytes: list = dataclasses.field(default_factory=list)
    # per save: written from the live tensors (no host copy)
    in_place: list = dataclasses.field(default_factory=list)
    # seconds the next optimizer step waited for an in-place write
    optimizer_wait: float = 0.0
    # rank 0: where trainer_state.json goes, and the state at the step
    trainer_state: tuple[Path, object] | None = None


class AsyncCheckpoints(TrainerCallback):
    def __init__(self, trainer, enabled: bool, direct: bool = True, staging: str = "auto"):
        self.trainer, self.enabled, self.direct, self.staging = trainer, enabled, direct, staging
        # the optimizer step pre-hook while an in-place write is in flight
        self.step_hook = None
        # how this rank's shard files were written (direct or through the page cache)
        self.shard_files = ShardFiles()
        # a gloo group for each save of a checkpoint (compat.async_dcp), made on first use
        self.groups: list = []
        # and its host copy (compat.host_copy.ReusedHostCopy), reused by every checkpoint
        self.stagers: list = []
        # by stagers already let go (release)
        self.host_copies_made = 0
        # the first host copy's buffers, made after the first optimizer step
        self.ahead: HostBuffers | None = None
        # what making them ahead cost, and how much of the first copy they were
        self.ahead_report: dict | None = None
        # at the end of the first step this process runs
        self.ahead_considered = False
        self.pending: Pending | None = None
        # per checkpoint: step, seconds, the step training had reached (the report)
        self.completed: list[dict] = []

    def why_not(self) -> str | None:
        """Why checkpoints of this run cannot be asynchronous (None: they are)."""
        plugin = getattr(self.trainer.accelerator.state, "fsdp_plugin", None)
        if plugin is None or plugin.fsdp_version != 2:
            return (
                "background saves are built for FSDP2's sharded checkpoints, and this run is "
                f"{'FSDP1' if plugin else 'not FSDP'}"
            )
        if "SHARDED" not in str(plugin.state_dict_type):
            return "FULL_STATE_DICT checkpoints are gathered whole, not written by DCP"
        if self.trainer.args.load_best_model_at_end:
            return "load_best_model_at_end loads a checkpoint inside the Trainer's loop"
        return None

    def describe(self) -> str:
        """One line for the start of the run: how its checkpoints are written."""
        if not self.enabled:
            return "checkpoints are written before training goes on (--async_checkpoints false)"
        if (reason := self.why_not()) is not None:
            return f"checkpoints are written before training goes on ({reason}; --async_checkpoints has no effect here)"
        if self.expects_in_place():
            return (
                "checkpoints are written in the background while training goes on (--async_checkpoints false "
                "to wait for "
                "each): straight from this rank's weight and optimizer shards, which live in host memory (no copy; the "
                "optimizer step after a checkpoint waits for its write), one checkpoint at a time"
            )
        return (
            "checkpoints are written in the background while training goes on (--async_checkpoints false to wait for "
            "each): a host copy of this rank's weight and optimizer shards, made after the first optimizer "
            "step and reused "
            "by every checkpoint (held for the run), one checkpoint at a time"
        )

    def expects_in_place(self) -> bool:
        """Whether saves will be written from the live tensors: staging auto, the shards in host memory (no accelerator,
        or FSDP's CPU offload) and nothing but optimizer steps changing them. Each save decides from its tensors
        (ReusedHostCopy.stage); this is the start's line."""
        plugin = getattr(self.trainer.accelerator.state, "fsdp_plugin", None)
        offload = getattr(getattr(plugin, "cpu_offload", None), "offload_params", False)
        return self.in_place_allowed() and (self.trainer.accelerator.device.type == "cpu" or bool(offload))

    def in_place_allowed(self) -> bool:
        """Staging auto, and an optimizer that changes the weights only in its step: a schedule-free optimizer's
        train()/eval(), which the Trainer calls around steps and evaluation, rewrite them in place (a save in flight
        would be torn), so such runs keep the host copy."""
        # accelerate's wrapper has train() itself
        inner = getattr(self.trainer.optimizer, "optimizer", self.trainer.optimizer)
        moves_weights = "schedule_free" in str(self.trainer.args.optim) or callable(getattr(inner, "train", None))
        return self.staging == "auto" and not moves_weights

    @property
    def active(self) -> bool:
        return self.enabled and self.why_not() is None

    @contextmanager
    def saving(self, folder: Path, step: int):
        """Around the Trainer's _save_checkpoint: its DCP saves start in the background; trainer_state.json is held
        back."""
        import torch.distributed as dist

        if self.pending is not None:
            # at most one in flight
            self.finish()

        # every rank makes the same saves in the same order, so the i-th group matches
        def group(i: int):
            while len(self.groups) <= i:
                self.groups.append(dist.new_group(backend="gloo"))
            return self.groups[i]

        def stager(i: int):
            while len(self.stagers) <= i:
                self.stagers.append(ReusedHostCopy(in_place=self.in_place_allowed(), ahead=self.ahead))
            return self.stagers[i]

        pending = Pending(folder, step, [], time.monotonic())
        state = self.trainer.state

        # the state as it is now, written by its own save_to_json once every rank is done
        def hold(path):
            held = copy.deepcopy(state)
            # the copy's own method again (deepcopy took this hold along)
            del held.save_to_json
            pending.trainer_state = (Path(path), held)

        # this instance only, for this save
        state.save_to_json = hold
        # accelerate asks for sharded state dicts with cpu_offload (its ShardedStateDictConfig(offload_to_cpu=True)): on
        # a GPU, a copy of every shard into new pageable memory on the training thread at every save, whose tensors
        # then look host-resident, so the save went "in place" from them and the next optimizer step waited for the
        # write (an H200, bench/results/h200/gpu-check-1: 7.6 s). Without it the state dict holds the shards where
        # they live: GPU shards are copied once into the reused pinned host copy, host shards (CPU, offload) are the
        # same tensors either way.
        sd_config = getattr(getattr(self.trainer.accelerator.state, "fsdp_plugin", None), "state_dict_config", None)
        offload_to_cpu = getattr(sd_config, "offload_to_cpu", False)
        try:
            if offload_to_cpu:
                sd_config.offload_to_cpu = False
            with checkpoint_saves(
                self.shard_files,
                direct=self.direct,
                background=Background(group, stager, pending.futures, pending.staged_bytes, pending.in_place),
            ):
                yield
        finally:
            if offload_to_cpu:
                sd_config.offload_to_cpu = True
            del state.save_to_json
            # the first checkpoint's copies are made: what they did not take goes
            if self.ahead is not None:
                self.ahead_report, self.ahead = self.ahead.close(), None
        self.pending = pending
        if any(pending.in_place):
            from torch.optim.optimizer import register_optimizer_step_pre_hook

            self.step_hook = register_optimizer_step_pre_hook(self._before_optimizer_step)

    def _before_optimizer_step(self, optimizer, args, kwargs) -> None:
        """Every optimizer step while an in-place write is in flight: wait for it (the step changes what it writes).
        Removed once the checkpoint completes (removing it here would change the hooks torch is iterating over)."""
        # registered only while an in-place save is pending
        pending = self.pending
        if pending is not None and not all(f.done() for f in pending.futures):
            began = time.monotonic()
            # a failed write raises where the checkpoint completes
            concurrent.futures.wait(pending.futures)
            pending.optimizer_wait += time.monotonic() - began

    def _unhook(self) -> None:
        if self.step_hook is not None:
            self.step_hook.remove()
            self.step_hook = None

    def writing(self):
        """Around the Trainer's _save_checkpoint when it saves in the foreground: the shard files written direct."""
        return checkpoint_saves(self.shard_files, direct=self.direct)

    def is_pending(self, folder: Path) -> bool:
        return self.pending is not None and self.pending.folder == Path(folder)

    def on_step_end(self, args, state, control, **kwargs):
        if not self.ahead_considered:
            self.ahead_considered = True
            # no checkpoint yet
            if not self.stagers:
                self._make_host_copy_ahead(kwargs.get("model"), state)
        if self.pending is None:
            return
        import torch

        done = all(f.done() for f in self.pending.futures)
        agreed = self.trainer.accelerator.reduce(
            torch.tensor(int(done), device=self.trainer.accelerator.device), reduction="sum"
        )
        if int(agreed.item()) == self.trainer.accelerator.num_processes:
            self._complete(state.global_step)

    def _make_host_copy_ahead(self, model, state) -> None:
        """After the first optimizer step (Adam's state exists from then on), where checkpoints will be staged into a
        host copy: its buffers made now on a thread of their own (compat.host_copy.HostBuffers), not on the training
        thread at the first checkpoint. Full fine-tuning saves every weight; a run with frozen weights (LoRA) saves
        few of them, so only its optimizer state's buffers are made ahead (the rest, small, at the save)."""
        import torch

        if not self.active or self.expects_in_place() or model is None or self.trainer.args.save_strategy == "no":
            return
        save_steps = getattr(state, "save_steps", 0) or 0
        if str(self.trainer.args.save_strategy).endswith("steps") and state.max_steps and save_steps > state.max_steps:
            # no checkpoint before the end: nothing to make ahead
            return
        params = list(model.parameters())
        tensors = params if all(p.requires_grad for p in params) else []
        optimizer = getattr(self.trainer.optimizer, "optimizer", self.trainer.optimizer)
        tensors += [
            v
            for per_param in optimizer.state.values()
            for v in per_param.values()
            if isinstance(v, torch.Tensor) and v.dim() > 0
        ]
        shapes = HostBuffers.shapes_of(tensors)
        if shapes:
            self.ahead = HostBuffers(shapes, pin="register" if torch.cuda.is_available() else None)

    def finish(self) -> None:
        """Wait for the save in flight on this rank, then for every rank, then complete it."""
        if self.pending is None:
            return
        for future in self.pending.futures:
            future.result()
        self.trainer.accelerator.wait_for_everyone()
        self._complete(self.trainer.state.global_step)
        # no rank goes on (to say "saved", or exit) before it is complete
        self.trainer.accelerator.wait_for_everyone()

    def release(self) -> None:
        """After the last save: the host copies are let go (the final export and what follows gain nothing from
        them)."""
        self.host_copies_made += sum(s.made for s in self.stagers)
        self.stagers.clear()
        # made for a checkpoint that never came
        if self.ahead is not None:
            self.ahead_report, self.ahead = self.ahead.close(), None

    def abandon(self) -> None:
        """After an exception: the checkpoint stays incomplete (no shard_digests.json, no trainer_state.json, no
        rotation).
        The writing threads finish the shard files they began (a thread cannot be stopped), so a process whose peer
        died ends when its write does, or when the launcher stops it."""
        if self.pending is not None:
            logger.warning(
                f"{self.pending.folder.name}: its asynchronous save was abandoned; it stays incomplete, and a "
                "resume passes over it"
            )
            self.pending = None
        self._unhook()

    def _complete(self, reached: int) -> None:
        pending, self.pending = self.pending, None
        self._unhook()
        for future in pending.futures:
            # a failed write raises here, on the rank that saw it
            future.result()
        seconds = round(time.monotonic() - pending.started, 3)
        staged, in_place = sum(pending.staged_bytes), all(pending.in_place)
        self.completed.append(
            {
                "step": pending.step,
                "seconds": seconds,
                "training_reached": reached,
                "staged_bytes": staged,
                "in_place": in_place,
                "optimizer_wait_seconds": round(pending.optimizer_wait, 3),
            }
        )
        if self.trainer.args.should_save:
            # shard_digests.json: every rank's files are written
            self.trainer.describer.finish_checkpoint(pending.folder)
            if pending.trainer_state is not None:
                path, held = pending.trainer_state
                # last: the checkpoint is complete
                held.save_to_json(str(path))
            self.trainer.rotate_checkpoints()
        if self.trainer.is_world_process_zero():
            source = (
                "straight from this rank's shards in host memory, no copy; the next optimizer step waited "
                f"{pending.optimizer_wait:.1f} s for it"
                if in_place
                else f"from a host copy of {staged / 2**20:,.1f} MiB of this rank's shards, reused by every checkpoint"
            )
            logger.info(
                f"{pending.folder.name} written in the background in {seconds:.1f} s while training went on to "
                f"step {reached} ({source})"
            )

    def report(self) -> dict:
        """fsdp_report.json's checkpoint_writes: how checkpoints were written, and (background) what each cost here."""
        # this rank's shard files (rank 0's in the report); with --direct_io_checkpoints false DCP writes them itself
        files = {"direct_io": True, "shard_files": self.shard_files.report()} if self.direct else {"direct_io": False}
        if not self.active:
            return {
                "mode": "blocking",
                "why": "--async_checkpoints false" if not self.enabled else self.why_not(),
                **files,
            }
        done = self.completed
        return {
            "mode": "background",
            **files,
            "saves": len(done),
            # auto: in place where the shards live in host memory; each save's in "last"
            "staging": self.staging,
            "in_place_saves": sum(c["in_place"] for c in done),
            "optimizer_wait_seconds_max": max((c["optimizer_wait_seconds"] for c in done), default=0.0),
            # rank 0's host copy per save
            "staged_bytes_max": max((c["staged_bytes"] for c in done), default=0),
            "seconds_max": max((c["seconds"] for c in done), default=0.0),
            # one per save of a checkpoint (model, optimizer), reused
            "host_copies_made": self.host_copies_made + sum(s.made for s in self.stagers),
            # the first copy's buffers, made after step 1
            **({"host_copy_ahead": self.ahead_report} if self.ahead_report else {}),
            "last": done[-5:],
        }
