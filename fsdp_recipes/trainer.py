"""The Trainer train_fsdp.py runs: transformers' Trainer, checked for real sharding, with an exact FSDP1 resume.

``FSDPTrainer`` adds the repository's callbacks (ShardingReport, DescribeCheckpoints) and overrides one
step of resuming. With accelerate 1.15, resuming FSDP1 from a SHARDED_STATE_DICT checkpoint restores an
empty optimizer: ``load_fsdp_optimizer`` builds the template it loads into from the optimizer as it is,
and a freshly created optimizer has no state entries, so DCP fills nothing. Weights, schedule and step
come back, Adam's moments do not, and the run continues silently wrong. Giving the optimizer its state
entries first (``_init_optim_state``: one step with zero gradients and lr 0, exactly what
``get_optimizer_state_dict`` does for FSDP2 before loading) makes DCP restore every moment.

It also moves one step of saving. The Trainer deletes checkpoints beyond ``save_total_limit`` as soon as rank 0
has written trainer_state.json, while the other ranks may still be writing their RNG state: a rank killed in
that window left the run with no complete checkpoint (with a limit of 1, the only good one was just deleted).
``FSDPTrainer`` deletes them once every rank is done.

SIGTERM and SIGUSR1 (a cluster's time limit or preemption) end the run after the current optimizer step with a
complete checkpoint of that step (fsdp_recipes.preemption).
"""

from __future__ import annotations

import logging
from pathlib import Path

from transformers import Trainer
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR, rotate_checkpoints

from .checkpoint_files import REPLACED_PREFIX
from .checkpoints import set_aside
from .checks import ShardingReport
from .export import DescribeCheckpoints
from .preemption import Preemption

logger = logging.getLogger(__name__)


class FSDPTrainer(Trainer):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.add_callback(ShardingReport(self))
        self.describer = DescribeCheckpoints(self, self.processing_class)
        self.add_callback(self.describer)
        self.preemption = Preemption()  # SIGTERM/SIGUSR1: checkpoint at the end of the current step, then stop
        self.add_callback(self.preemption)

    def _fsdp1_sharded(self) -> bool:
        plugin = getattr(self.accelerator.state, "fsdp_plugin", None)
        return plugin is not None and plugin.fsdp_version == 1 and "SHARDED" in str(plugin.state_dict_type)

    def _load_optimizer_and_scheduler(self, checkpoint: str | None) -> None:
        if checkpoint is not None and self._fsdp1_sharded():
            from torch.distributed.checkpoint.state_dict import _init_optim_state

            _init_optim_state(self.optimizer.optimizer)  # the torch optimizer inside accelerate's wrapper
        super()._load_optimizer_and_scheduler(checkpoint)

    def _save_checkpoint(self, model, trial) -> None:
        folder = Path(self._get_output_dir(trial=trial)) / f"{PREFIX_CHECKPOINT_DIR}-{self.state.global_step}"
        if self.args.should_save:
            if folder.exists():  # never rewrite a checkpoint in place: a kill midway would mix two runs' files
                moved = set_aside(folder, REPLACED_PREFIX)
                logger.warning(f"{folder} existed (another run's step {self.state.global_step}): moved it to {moved.name}")
            folder.mkdir(parents=True)
            self.describer.describe(folder)  # before any shard, so before trainer_state.json
        self.accelerator.wait_for_everyone()
        limit = self.args.save_total_limit
        self.args.save_total_limit = None  # the Trainer's own rotation, which would run before the other ranks finish
        try:
            super()._save_checkpoint(model, trial)
        finally:
            self.args.save_total_limit = limit
        self.accelerator.wait_for_everyone()
        if self.args.should_save:
            rotate_checkpoints(
                output_dir=self._get_output_dir(trial=trial), save_total_limit=limit,
                best_model_checkpoint=self.state.best_model_checkpoint, use_mtime=True,
            )
