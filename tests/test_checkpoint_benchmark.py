"""bench/checkpoint_benchmark.py's arithmetic (its launches are measured, not tested: see its docstring)."""

from __future__ import annotations

import pytest

from bench.checkpoint_benchmark import queued, ranks_label, step_seconds


@pytest.mark.parametrize("write, step, save_steps, need", [
    (1.8, 0.02, 2, 91),   # the H200 run of bench/results/h200/checkpoint-stall-2: 0.04 s of training per 1.8 s write
    (2.0, 1.0, 1, 3),
    (0.5, 0.02, 100, None),  # 2 s of training per save: the write overlaps it
    (2.0, 1.0, 2, None),  # exactly as long: nothing queues
    (None, 0.02, 2, None),  # no background write logged
])
def test_a_write_longer_than_the_training_between_saves_is_named(write, step, save_steps, need):
    note = queued(write, step, save_steps)
    if need is None:
        assert note is None
    else:
        assert f"outlasts the training between saves ({step * save_steps:.2f} s)" in note and f"--save-steps {need} or more" in note
        assert write <= step * need  # the --save-steps it names would leave the write its time


def test_the_ranks_are_named_as_the_run_ran():
    assert ranks_label(2, "cpu") == "2 CPU ranks (FSDP2 FULL_SHARD over gloo"
    assert ranks_label(1, "cuda:0").startswith("1 GPU rank (") and ranks_label(1, "cuda:0").endswith("over nccl")


def test_step_seconds_leave_out_the_warm_up():
    assert step_seconds([0.0, 5.0, 6.0, 8.0, 11.0], skip=2) == [2.0, 3.0]
