"""A TrainerCallback that records when each optimizer step ends, on global rank 0, for bench/scaling.py.

Both runs that bench/scaling.py compares (train_fsdp.py through bench/timed_run.py, and bench/bare_trainer.py)
carry exactly this callback and nothing else of the benchmark, so their step times are measured the same way.
The file named by $SCALING_STEP_TIMES gets {"step_end": [wall-clock seconds after step 1, 2, ...]}.
"""

from __future__ import annotations

import json
import os
import time

from transformers import TrainerCallback


class StepTimes(TrainerCallback):
    def __init__(self):
        self.ends: list[float] = []

    def on_step_end(self, args, state, control, **kwargs):
        # wall clock: comparable with the benchmark's launch time
        self.ends.append(time.time())

    def on_train_end(self, args, state, control, **kwargs):
        path = os.environ.get("SCALING_STEP_TIMES")
        if path and state.is_world_process_zero:
            with open(path, "w") as f:
                json.dump({"step_end": self.ends}, f)
