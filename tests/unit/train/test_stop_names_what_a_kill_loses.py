"""A stop (SIGTERM, SIGUSR1) saves its step's checkpoint before the run ends, and the launcher kills the ranks a
grace period after its SIGTERM. When the stop begins, rank 0 says which checkpoints are still to be written (a
background write in flight first) and where a resume starts were the job killed before they are: the same checkpoint
the resume then takes, never one it would pass over; only the stop's own save says it. (The launch, killed mid-write:
tests/integration/test_stop_outlasting_the_grace.py.)"""

from __future__ import annotations

import itertools
import os

import pytest
from conftest import plain_checkpoint

from fsdp_recipes.ckpt.status import newest_resumable
from fsdp_recipes.train.preemption import grace, kill_warning

WORLD = 2
STEP = 9
# (complete checkpoints, damaged ones: trainer_state.json there, an RNG file missing, so a resume passes over them)
LAYOUTS = {
    "no checkpoint": ([], []),
    "one complete": ([6], []),
    "two complete": ([3, 6], []),
    "the newest damaged": ([3], [6]),
    "only damaged": ([], [3, 6]),
}
WRITING = {
    "the stop's save alone": ["checkpoint-9"],
    "a background save still in flight": ["checkpoint-8", "checkpoint-9"],
}
ELASTIC = {"TORCHELASTIC_RUN_ID": "none"}


def run_folder(root, complete: list[int], damaged: list[int], writing: list[str]):
    """The run folder as a kill would leave it: the folders being written cut short (no trainer_state.json), and
    decoys a resume never takes (a set-aside folder, a file with a checkpoint's name)."""
    run = root / "run"
    for step in complete + damaged:
        plain_checkpoint(run, step, WORLD)
    for step in damaged:
        (run / f"checkpoint-{step}" / f"rng_state_{WORLD - 1}.pth").unlink()
    for name in writing:
        (plain_checkpoint(run, int(name.split("-")[1]), WORLD) / "trainer_state.json").unlink()
    plain_checkpoint(run, 12, WORLD).rename(run / "incomplete-checkpoint-12")
    (run / "checkpoint-11").write_text("not a folder")
    return run


@pytest.mark.parametrize("layout, writing, stop", itertools.product(LAYOUTS, WRITING, ["SIGTERM", "SIGUSR1"]))
def test_the_line_names_what_is_cut_short_and_where_the_resume_then_starts(tmp_path, layout, writing, stop):
    complete, damaged = LAYOUTS[layout]
    names = WRITING[writing]
    run = run_folder(tmp_path, complete, damaged, names)
    line = kill_warning(stop, STEP, STEP, names, run, env=ELASTIC)

    # what --resume_from_checkpoint true takes after the kill
    chosen, _ = newest_resumable(run)
    resumed = None if chosen is None else os.path.basename(chosen.path)
    assert resumed == (f"checkpoint-{max(complete)}" if complete else None)
    assert line is not None and "\n" not in line
    assert line.startswith(f"{stop} after step {STEP}: saving checkpoint-{STEP} before stopping")
    assert all(name in line for name in names) and "left incomplete" in line and "killed" in line
    tail = f"from {resumed}" if resumed else "no complete checkpoint is left to resume from"
    assert line.endswith(tail), line
    # the one in flight ends first: a kill after it leaves the resume there
    if len(names) > 1:
        assert f"once {names[0]} (still being written) is complete" in line
        assert f"a resume starts from {names[0]} if its write had ended" in line
    assert ("TORCH_ELASTIC_SHUTDOWN_TIMEOUT" in line) == (stop == "SIGTERM")


@pytest.mark.parametrize(
    "stopped_at, step, writing",
    [
        # a periodic save, no stop
        (None, 6, ["checkpoint-6"]),
        # a periodic save while one is in flight, no stop
        (None, 9, ["checkpoint-6", "checkpoint-9"]),
        # not the stop's step
        (9, 6, ["checkpoint-6"]),
        # nothing left to write
        (9, 9, []),
    ],
)
def test_only_the_stops_own_save_says_it(tmp_path, stopped_at, step, writing):
    assert kill_warning("SIGTERM", stopped_at, step, writing, tmp_path, env=ELASTIC) is None


@pytest.mark.parametrize(
    "env, said",
    [
        # not a torch elastic launch (srun, mpirun): its own grace, not known here
        ({}, ""),
        (ELASTIC, " (the launcher kills the ranks 30 s after SIGTERM; TORCH_ELASTIC_SHUTDOWN_TIMEOUT sets it)"),
        (
            {**ELASTIC, "TORCH_ELASTIC_SHUTDOWN_TIMEOUT": "120"},
            " (the launcher kills the ranks 120 s after SIGTERM; TORCH_ELASTIC_SHUTDOWN_TIMEOUT sets it)",
        ),
        (
            {**ELASTIC, "TORCH_ELASTIC_SHUTDOWN_TIMEOUT": "120", "PET_SHUTDOWN_TIMEOUT": "45"},
            " (the launcher kills the ranks 45 s after SIGTERM; PET_SHUTDOWN_TIMEOUT sets it)",
        ),
    ],
)
def test_the_grace_is_the_launchers_and_names_its_setting(env, said):
    assert grace("SIGTERM", env) == said
    # SLURM's early warning: the kill comes at the time limit
    assert grace("SIGUSR1", env) == ""


def test_the_grace_named_is_what_accelerate_launch_gives(monkeypatch):
    """accelerate launch hands torch elastic the torchrun defaults for what it has no flag of its own: no shutdown
    timeout, so LaunchConfig's, 30 s or TORCH_ELASTIC_SHUTDOWN_TIMEOUT."""
    import torch.distributed.run as distrib_run
    from accelerate.commands.launch import launch_command_parser
    from torch.distributed.launcher.api import LaunchConfig

    monkeypatch.delenv("PET_SHUTDOWN_TIMEOUT", raising=False)
    monkeypatch.delenv("TORCH_ELASTIC_SHUTDOWN_TIMEOUT", raising=False)
    assert "shutdown_timeout" not in vars(launch_command_parser().parse_args(["train.py"]))
    assert distrib_run.get_args_parser().parse_args(["train.py"]).shutdown_timeout is None
    assert LaunchConfig(min_nodes=1, max_nodes=1, nproc_per_node=1).shutdown_timeout == 30
    monkeypatch.setenv("TORCH_ELASTIC_SHUTDOWN_TIMEOUT", "120")
    assert LaunchConfig(min_nodes=1, max_nodes=1, nproc_per_node=1).shutdown_timeout == 120
