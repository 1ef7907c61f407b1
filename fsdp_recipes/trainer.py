"""The Trainer train_fsdp.py runs: transformers' Trainer, checked for real sharding, with an exact FSDP1 resume.

``FSDPTrainer`` adds the repository's callbacks (ShardingReport, DescribeCheckpoints) and overrides one
step of resuming. With accelerate 1.15, resuming FSDP1 from a SHARDED_STATE_DICT checkpoint restores an
empty optimizer: ``load_fsdp_optimizer`` builds the template it loads into from the optimizer as it is,
and a freshly created optimizer has no state entries, so DCP fills nothing. Weights, schedule and step
come back, Adam's moments do not, and the run continues silently wrong. Giving the optimizer its state
entries first (``_init_optim_state``: one step with zero gradients and lr 0, exactly what
``get_optimizer_state_dict`` does for FSDP2 before loading) makes DCP restore every moment.
"""

from __future__ import annotations

from transformers import Trainer

from .checks import ShardingReport
from .export import DescribeCheckpoints


class FSDPTrainer(Trainer):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.add_callback(ShardingReport(self))
        self.add_callback(DescribeCheckpoints(self, self.processing_class))

    def _fsdp1_sharded(self) -> bool:
        plugin = getattr(self.accelerator.state, "fsdp_plugin", None)
        return plugin is not None and plugin.fsdp_version == 1 and "SHARDED" in str(plugin.state_dict_type)

    def _load_optimizer_and_scheduler(self, checkpoint: str | None) -> None:
        if checkpoint is not None and self._fsdp1_sharded():
            from torch.distributed.checkpoint.state_dict import _init_optim_state

            _init_optim_state(self.optimizer.optimizer)  # the torch optimizer inside accelerate's wrapper
        super()._load_optimizer_and_scheduler(checkpoint)
