"""Asynchronous checkpoints (fsdp_recipes.train.async_checkpoints), with real multi-process runs: a checkpoint whose
writing is held back by fault injection until training has gone on two more steps, so that the overlap is certain
and not a matter of timing; the same run killed while that write is in flight; the flag that turns it off; a rank
killed before its last file, with save_total_limit 1, leaving the checkpoint before. Each interrupted run has a
launch of its own; their resumes share one (the ``interrupted`` fixture).

On CPU the shards live in host memory, so by default a save is written from the live tensors and the next optimizer
step waits for it: a write held until step N + 2 could never finish there. The held-write tests therefore ask for the
host copy (``--async_checkpoint_staging copy``, what GPU runs use); the in-place writes have tests of their own."""

from __future__ import annotations

import re
import subprocess
import sys
import time

import pytest
import torch
from conftest import FAULT_SCRIPT, QUICK, REPO, launch, quick, read_json, shard_files_written
from helpers.launch_sequence import resumed_together
from safetensors.torch import load_file

# every test here launches real runs
pytestmark = pytest.mark.slow

ZERO3 = "accelerate_configs/zero3.yaml"
# checkpoints 3, 6, 9, 12 of the same 12 steps as the session's reference run
EVERY_3 = quick(save_steps="3")
# a host copy: the write can go on while later optimizer steps run
COPY = ("--async_checkpoint_staging", "copy")


def limit_1(background: bool) -> list[str]:
    flags = [*quick(save_total_limit="1"), "--async_checkpoints", str(background).lower()]
    return flags if background else [*flags, "--direct_io_checkpoints", "false"]


# Interrupted runs, each killed or stopped in a launch of its own: name -> (its flags, its fault injections, whether
# the launch gets a process group of its own, the flags of its resume, which ends normally).
INTERRUPTED = {
    "killed_while_written": ([*EVERY_3, *COPY], {"FSDP_FAULT": "all:killheldsave:6"}, False, EVERY_3),
    "preempted_while_written": ([*QUICK, *COPY], {"FSDP_FAULT": "all:sigtermheldsave:6"}, True, QUICK),
    "in_place_slow_write": (EVERY_3, {"FSDP_SLOW_SAVE": "3:4", "FSDP_FAULT": "all:step:5"}, False, EVERY_3),
    "rng_sync": (limit_1(False), {"FSDP_FAULT": "1:rng:12"}, False, limit_1(False)),
    "rng_background": (limit_1(True), {"FSDP_FAULT": "1:rng:12"}, False, limit_1(True)),
}


def interrupt(flags, env, new_session):
    def launched(out):
        return launch(
            ZERO3, *flags, "--output_dir", str(out), script=FAULT_SCRIPT, env=env, check=False, new_session=new_session
        )

    return launched


@pytest.fixture(scope="module")
def interrupted(tmp_path_factory):
    """Every INTERRUPTED run launched alone; their resumes (``--resume_from_checkpoint true``) in one launch."""
    cases = {
        name: (interrupt(flags, env, new_session), [*resume, "--resume_from_checkpoint", "true"])
        for name, (flags, env, new_session, resume) in INTERRUPTED.items()
    }
    return resumed_together(tmp_path_factory.mktemp("interrupted"), ZERO3, cases)


def assert_same_model(model_dir, reference_dir) -> None:
    final, reference = load_file(model_dir / "model.safetensors"), load_file(reference_dir / "model.safetensors")
    assert set(final) == set(reference)
    for name in reference:
        assert torch.equal(final[name], reference[name]), name


def test_training_goes_on_while_a_checkpoint_is_written(trained, tmp_path):
    out = tmp_path / "run"
    run = launch(
        ZERO3, *EVERY_3, *COPY, "--output_dir", str(out), script=FAULT_SCRIPT, env={"FSDP_FAULT": "all:heldsave:3"}
    )
    assert "checkpoints are written in the background while training goes on" in run.stdout
    assert "fault injection: checkpoint-3 still being written at step 5" in run.stderr
    written = {
        int(s): int(r)
        for s, r in re.findall(
            r"checkpoint-(\d+) written in the background in [\d.]+ s while training went on to step (\d+)", run.stdout
        )
    }
    # its write finished only after step 5
    assert sorted(written) == [3, 6, 9, 12] and written[3] >= 5, written
    for step in (6, 9):
        # nothing held: still written while the next step trained
        assert written[step] > step
    # save_total_limit 3: the newest three, each complete
    for step in (6, 9, 12):
        assert read_json(out / f"checkpoint-{step}" / "trainer_state.json")["global_step"] == step
        assert (out / f"checkpoint-{step}" / "shard_digests.json").is_file()
    # rotated away once checkpoint-12 was complete
    assert not (out / "checkpoint-3").exists()
    writes = read_json(out / "fsdp_report.json")["checkpoint_writes"]
    assert (
        writes["mode"] == "background"
        and writes["saves"] == 4
        and writes["staging"] == "copy"
        and writes["in_place_saves"] == 0
    )
    # the model's and the optimizer's, made at checkpoint-3, reused by 6, 9, 12
    assert writes["host_copies_made"] == 2, writes
    # rank 0: 4 x (model, optimizer)
    assert writes["direct_io"] is True and writes["shard_files"] == shard_files_written(8, out), writes
    # measured by the run from its own tensors
    rank0 = read_json(out / "fsdp_report.json")["ranks"][0]["bytes"]
    # this rank's weights and Adam's two moments
    shards = rank0["params"] + rank0["optimizer"]
    # + Adam's step counters
    assert shards <= writes["staged_bytes_max"] <= shards + 4096, (writes, rank0)
    # the first copy's buffers, made after step 1 on a thread, not at checkpoint-3
    ahead = writes["host_copy_ahead"]
    assert (
        ahead["bytes"] == shards
        and ahead["bytes_not_taken"] == 0
        and ahead["tensors_made_at_save"] == 0
        and "error" not in ahead
    ), (ahead, rank0)
    # saving in the background changes no training step
    assert_same_model(out / "model", trained(ZERO3).model_dir)


def test_killed_while_a_checkpoint_is_written_resumes_from_the_one_before_to_the_same_bits(trained, interrupted):
    """checkpoint-6's write is held until step 8, where every rank is killed: it has shards but no trainer_state.json.
    The resume takes checkpoint-3, which was itself written while steps 4 and 5 trained, so an exact end also proves
    that a background save holds the weights of its own step, not the ones training has moved on to."""
    run = interrupted["killed_while_written"]
    out, killed, left = run.out, run.killed, run.as_left
    assert killed.returncode != 0 and "fault injection: SIGKILL" in killed.stderr, killed.stderr[-3000:]
    assert "checkpoint-6 still being written at step 8" in killed.stderr
    assert (left / "checkpoint-6" / "pytorch_model_fsdp_0").is_dir() and not (
        left / "checkpoint-6" / "trainer_state.json"
    ).exists()
    assert read_json(left / "checkpoint-3" / "trainer_state.json")["global_step"] == 3

    resumed = run.resume()
    assert f"resuming from {out / 'checkpoint-3'}" in resumed.stdout
    # set aside, never deleted
    assert (out / "incomplete-checkpoint-6").is_dir()
    assert read_json(out / "trainer_state.json")["global_step"] == 12
    assert_same_model(out / "model", trained(ZERO3).model_dir)


def test_preempted_while_a_checkpoint_is_written_finishes_it_saves_its_step_and_resumes_exactly(trained, interrupted):
    """checkpoint-6's write is held until step 8, when SIGTERM reaches the launcher and every rank: the preemption's
    checkpoint-9 waits for it, both end complete, and the resumed run ends on the uninterrupted run's bits."""
    from fsdp_recipes.ckpt.status import checkpoint_status

    run = interrupted["preempted_while_written"]
    out, stopped, left = run.out, run.killed, run.as_left
    assert "checkpoint-6 still being written at step 8" in stopped.stderr
    assert f"stopped by SIGTERM after step 9: saved {out}/checkpoint-9" in stopped.stdout + stopped.stderr, (
        stopped.stderr[-3000:]
    )
    assert stopped.returncode != 0 and not (left / "model").exists()
    assert checkpoint_status(left / "checkpoint-6").resumable and checkpoint_status(left / "checkpoint-9").resumable
    assert f"resuming from {out / 'checkpoint-9'}" in run.resume().stdout
    assert_same_model(out / "model", trained(ZERO3).model_dir)


def test_in_place_a_slow_write_holds_the_next_optimizer_step_so_the_checkpoint_is_its_steps_and_resumes_exactly(
    trained, interrupted
):
    """The default on CPU: no host copy, the live shards written while the next step's forward and backward run. The
    write of checkpoint-3 is slowed by 4 s (fault injection, before any byte is read), far longer than the tiny model's
    steps: step 4's optimizer step must wait for it, else it would change the weights and Adam's state being written
    and training would run on. Every rank is then killed at step 5 and the resume from checkpoint-3 must end on the
    uninterrupted run's bits: a checkpoint holding anything but step 3's state would not."""
    run = interrupted["in_place_slow_write"]
    out, killed = run.out, run.killed
    assert killed.returncode != 0 and "fault injection: SIGKILL" in killed.stderr, killed.stderr[-3000:]
    assert "straight from this rank's weight and optimizer shards, which live in host memory" in killed.stdout
    done = re.search(
        r"checkpoint-3 written in the background in ([\d.]+) s while training went on to step (\d+) \(straight "
        r"from this "
        r"rank's shards in host memory, no copy; the next optimizer step waited ([\d.]+) s for it\)",
        killed.stdout,
    )
    assert done, killed.stdout[-3000:]
    seconds, reached, waited = float(done[1]), int(done[2]), float(done[3])
    # step 4's optimizer step held until the write was done
    assert seconds >= 4 and reached == 4 and waited >= 2, done[0]
    assert read_json(run.as_left / "checkpoint-3" / "trainer_state.json")["global_step"] == 3
    assert f"resuming from {out / 'checkpoint-3'}" in run.resume().stdout
    writes = read_json(out / "fsdp_report.json")["checkpoint_writes"]
    # 6, 9, 12 of the resumed run
    assert writes["staging"] == "auto" and writes["in_place_saves"] == writes["saves"] == 3, writes
    # no host memory added
    assert writes["staged_bytes_max"] == 0 and writes["host_copies_made"] == 0, writes
    assert_same_model(out / "model", trained(ZERO3).model_dir)


def test_an_error_while_a_checkpoint_is_written_leaves_it_incomplete(tmp_path):
    """An exception in training abandons the save in flight: its files may still be written, but never
    trainer_state.json, so no resume takes it; the run ends with the error, without waiting on anything."""
    out = tmp_path / "run"
    began = time.monotonic()
    failed = launch(
        ZERO3,
        *EVERY_3,
        *COPY,
        "--output_dir",
        str(out),
        script=FAULT_SCRIPT,
        env={"FSDP_FAULT": "all:raiseheldsave:6"},
        check=False,
    )
    assert failed.returncode != 0 and "fault injection: an error in step 9" in failed.stderr, failed.stderr[-3000:]
    # not the 30 minutes of a collective timeout
    assert time.monotonic() - began < 240
    assert "checkpoint-6: its asynchronous save was abandoned; it stays incomplete" in failed.stdout + failed.stderr
    assert (
        not (out / "checkpoint-6" / "trainer_state.json").exists()
        and (out / "checkpoint-3" / "trainer_state.json").is_file()
    )
    proc = subprocess.run(
        [sys.executable, "tools/check_checkpoint.py", str(out)], cwd=REPO, capture_output=True, text=True, timeout=120
    )
    assert "resume: --resume_from_checkpoint true uses checkpoint-3" in proc.stdout, proc.stdout + proc.stderr


def test_the_trainers_end_of_training_cleanup_waits_for_the_save_in_flight_and_deletes_only_checkpoints(tmp_path):
    """With a best checkpoint and save_total_limit 1, the Trainer deletes every other checkpoint folder as training
    ends; it must wait for the save in flight (deleting checkpoint-12 while its files are written leaves no model).
    greater_is_better makes the first checkpoint, the highest loss, the best one. The Trainer's cleanup is
    shutil.rmtree of whatever a checkpoint-N folder holds: a user's notes put into the newest, checkpoint-12, keep it,
    and it is said; checkpoint-6 and checkpoint-9, ours alone, go."""
    out = tmp_path / "run"
    best = [
        "--validation_split_percentage",
        "10",
        "--eval_strategy",
        "steps",
        "--eval_steps",
        "3",
        "--metric_for_best_model",
        "eval_loss",
        "--greater_is_better",
        "true",
    ]
    run = launch(
        ZERO3,
        *quick(save_steps="3", save_total_limit="1"),
        *best,
        "--output_dir",
        str(out),
        script=FAULT_SCRIPT,
        env={"FSDP_NOTE_BEFORE_CLEANUP": "eval-notes.txt"},
    )
    assert "checkpoints are written in the background while training goes on" in run.stdout
    assert read_json(out / "trainer_state.json")["best_model_checkpoint"] == str(out / "checkpoint-3")
    # after the write
    assert sorted(p.name for p in out.glob("checkpoint-*")) == ["checkpoint-12", "checkpoint-3"]
    assert (out / "checkpoint-12" / "eval-notes.txt").read_text() == "a user's notes\n"
    assert (
        "save_total_limit: kept checkpoint-12, not a checkpoint holding nothing else (it holds eval-notes.txt"
        in run.stdout + run.stderr
    )
    assert (out / "model" / "model.safetensors").is_file()


@pytest.mark.parametrize("background", [False, True], ids=["sync", "background"])
def test_rank_killed_before_its_rng_file_leaves_the_previous_checkpoint(trained, interrupted, background):
    """With save_total_limit 1 the Trainer deletes the older checkpoint as soon as rank 0 has written
    trainer_state.json, while other ranks may still be writing their files: a rank killed there left no complete
    checkpoint at all. FSDPTrainer deletes only after every rank is done, so the resume starts from checkpoint-6.
    A background save (the default) goes further: trainer_state.json itself waits for every rank's files.
    The sync runs also take --direct_io_checkpoints false (DCP writes the shard files itself, through the page cache;
    the other resume tests read checkpoints written direct, the default) and say that each save is waited for."""
    run = interrupted["rng_background" if background else "rng_sync"]
    out, killed, left = run.out, run.killed, run.as_left
    assert killed.returncode != 0 and "fault injection: SIGKILL" in killed.stderr, killed.stderr[-3000:]
    assert (left / "checkpoint-12" / "trainer_state.json").is_file() is not background
    assert not (left / "checkpoint-12" / "rng_state_1.pth").exists()
    assert (left / "checkpoint-6" / "trainer_state.json").is_file()
    resumed = run.resume()
    assert "skipping checkpoint-12" in resumed.stderr and f"resuming from {out / 'checkpoint-6'}" in resumed.stdout
    # the limit still holds
    assert sorted(p.name for p in out.glob("checkpoint-*")) == ["checkpoint-12"]
    final, reference = (
        load_file(out / "model" / "model.safetensors"),
        load_file(trained(ZERO3).model_dir / "model.safetensors"),
    )
    assert set(final) == set(reference) and all(torch.equal(final[k], reference[k]) for k in reference)
    if not background:
        assert "checkpoints are written before training goes on (--async_checkpoints false)" in resumed.stdout
        assert "written in the background" not in resumed.stdout
        assert read_json(out / "fsdp_report.json")["checkpoint_writes"] == {
            "mode": "blocking",
            "why": "--async_checkpoints false",
            "direct_io": False,
        }
