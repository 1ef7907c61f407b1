"""A stop whose checkpoint write outlasts the launcher's grace: SIGTERM during step 9, the stop's checkpoint-9 written
in the background and slowed past torch elastic's shutdown timeout (shortened here to 10 s), so the launcher kills
the ranks mid-write. The run has said beforehand what that kill loses and where a resume starts, and the resume
then passes over the checkpoint cut short and takes that one. (The line itself, over layouts and signals:
tests/unit/train/test_stop_names_what_a_kill_loses.py.)"""

from __future__ import annotations

import pytest
from conftest import FAULT_SCRIPT, QUICK, launch

# a real launch, killed
pytestmark = pytest.mark.slow

ZERO3 = "accelerate_configs/zero3.yaml"


def test_a_kill_during_the_stops_write_was_announced_and_the_resume_passes_over_it(tmp_path):
    from fsdp_recipes.ckpt.status import newest_resumable

    out = tmp_path / "run"
    killed = launch(
        ZERO3,
        *QUICK,
        "--output_dir",
        str(out),
        script=FAULT_SCRIPT,
        env={
            # SIGTERM to the launcher and every rank, as SLURM sends it
            "FSDP_FAULT": "0:sigterm:8",
            # the stop's checkpoint: its write outlasts the grace
            "FSDP_SLOW_SAVE": "9:120",
            "TORCH_ELASTIC_SHUTDOWN_TIMEOUT": "10",
        },
        check=False,
        new_session=True,
    )
    said = killed.stdout + killed.stderr
    assert killed.returncode != 0 and "stopped by SIGTERM after step 9: saved" not in said, said[-3000:]
    assert (
        "SIGTERM after step 9: saving checkpoint-9 before stopping; if the job is killed before its write ends "
        "(the launcher kills the ranks 10 s after SIGTERM; TORCH_ELASTIC_SHUTDOWN_TIMEOUT sets it), checkpoint-9 is "
        "left incomplete and a resume starts from checkpoint-6" in said
    ), said[-3000:]
    assert (out / "checkpoint-9").is_dir() and not (out / "checkpoint-9" / "trainer_state.json").exists()
    # what --resume_from_checkpoint true takes
    chosen, passed_over = newest_resumable(out)
    assert chosen.path.endswith("checkpoint-6") and [s.path for s in passed_over] == [str(out / "checkpoint-9")]
