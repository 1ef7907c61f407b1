"""bench/checkpoint_benchmark.py's arithmetic (its launches are measured, not tested: see its docstring)."""

from __future__ import annotations

import pytest

from bench.checkpoint_benchmark import queued, ranks_label, step_seconds


@pytest.mark.parametrize("write, step, save_steps, need", [
    (1.8, 0.02, 2, 90),   # the H200 run of bench/results/h200/checkpoint-stall-2: 0.04 s of training per 1.8 s write
    (2.0, 1.0, 1, 2),
    (2.1, 1.0, 1, 3),
    (0.5, 0.02, 100, None),  # 2 s of training per save: the write overlaps it
    (2.0, 1.0, 2, None),  # exactly as long: nothing waits
    (None, 0.02, 2, None),  # no background write logged
    (2.0, 0.0, 2, None),  # no step time to judge by
])
def test_a_write_from_a_host_copy_longer_than_the_training_between_saves_is_named(write, step, save_steps, need):
    note = queued(write, step, save_steps)
    if need is None:
        assert note is None
    else:
        assert f"outlasts the training between saves ({step * save_steps:.2f} s)" in note and f"--save-steps {need} or more" in note
        assert queued(write, step, need) is None and queued(write, step, need - 1) is not None  # the least that leaves room


@pytest.mark.parametrize("write, step, save_steps, noted", [(1.8, 0.02, 100, True), (4.2, 3.2, 1, True), (4.2, 3.2, 5, True),
                                                             (2.0, 3.2, 1, False)])
def test_a_write_in_place_overlaps_one_step_whatever_the_save_steps(write, step, save_steps, noted):
    """(hostile review) in place, the next optimizer step waits for the write: more --save-steps give it no room, and
    advice to raise them would be false."""
    note = queued(write, step, save_steps, in_place=True)
    assert (note is not None) == noted
    if noted:
        assert "outlasts the step it can overlap" in note and "--save-steps" not in note


def test_the_ranks_are_named_as_the_run_ran():
    assert ranks_label(2, "cpu") == "2 CPU ranks (FSDP2 FULL_SHARD over gloo"
    assert ranks_label(1, "cuda:0").startswith("1 GPU rank (") and ranks_label(1, "cuda:0").endswith("over nccl")


def test_step_seconds_leave_out_the_warm_up():
    assert step_seconds([0.0, 5.0, 6.0, 8.0, 11.0], skip=2) == [2.0, 3.0]


@pytest.mark.parametrize("ends", ["returns", "raises"])
def test_the_temporary_work_folder_is_removed_however_the_runs_end(tmp_path, monkeypatch, ends):
    """It holds the model and four runs' checkpoints (17 GB for the 1 GB model): left behind, two runs filled this
    machine's disk. A --work folder the user gives is kept (its model is reused)."""
    import tempfile

    import bench.checkpoint_benchmark as benchmark

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    seen = []

    def measure(a, work, argv):
        seen.append(work)
        (work / "checkpoint-1").mkdir()
        (work / "checkpoint-1" / "shard.distcp").write_bytes(b"x" * 1000)
        if ends == "raises":
            raise SystemExit("launch failed")
        return 0

    monkeypatch.setattr(benchmark, "measure", measure)
    if ends == "raises":
        with pytest.raises(SystemExit):
            benchmark.main(["--gigabytes", "0.01"])
    else:
        assert benchmark.main(["--gigabytes", "0.01"]) == 0
    assert seen and seen[0].parent == tmp_path and not seen[0].exists()
    kept = tmp_path / "mine"
    kept.mkdir()
    benchmark.main(["--work", str(kept)]) if ends == "returns" else None
    assert kept.exists() and (ends == "raises" or (kept / "checkpoint-1").exists())
