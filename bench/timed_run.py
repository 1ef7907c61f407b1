"""train_fsdp.py, unchanged, with bench/step_times.py's StepTimes added to its trainer (bench/scaling.py launches it
in place of train_fsdp.py with the same arguments)."""

import runpy
import sys
from pathlib import Path

from step_times import StepTimes

import fsdp_recipes.train.trainer as trainer_module

REPO = Path(__file__).resolve().parent.parent
_init = trainer_module.FSDPTrainer.__init__


def _init_with_step_times(self, *args, **kwargs):
    _init(self, *args, **kwargs)
    self.add_callback(StepTimes())


trainer_module.FSDPTrainer.__init__ = _init_with_step_times
sys.argv[0] = str(REPO / "train_fsdp.py")
runpy.run_path(sys.argv[0], run_name="__main__")
