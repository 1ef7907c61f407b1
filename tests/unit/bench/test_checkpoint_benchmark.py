"""bench/checkpoint_benchmark.py's arithmetic (its launches are measured, not tested: see its docstring)."""

from __future__ import annotations

import argparse
import random

import pytest

from bench.checkpoint_benchmark import first_and_later, queued, ranks_label, split, stall_of_each_save, step_seconds


@pytest.mark.parametrize(
    "write, step, save_steps, need",
    [
        # the H200 run of bench/results/h200/checkpoint-stall-2: 0.04 s of training per 1.8 s write
        (1.8, 0.02, 2, 90),
        (2.0, 1.0, 1, 2),
        (2.1, 1.0, 1, 3),
        # 2 s of training per save: the write overlaps it
        (0.5, 0.02, 100, None),
        # exactly as long: nothing waits
        (2.0, 1.0, 2, None),
        # no background write logged
        (None, 0.02, 2, None),
        # no step time to judge by
        (2.0, 0.0, 2, None),
    ],
)
def test_a_write_from_a_host_copy_longer_than_the_training_between_saves_is_named(write, step, save_steps, need):
    note = queued(write, step, save_steps)
    if need is None:
        assert note is None
    else:
        assert (
            f"outlasts the training between saves ({step * save_steps:.2f} s)" in note
            and f"--save-steps {need} or more" in note
        )
        # the least that leaves room
        assert queued(write, step, need) is None and queued(write, step, need - 1) is not None


@pytest.mark.parametrize(
    "write, step, save_steps, noted",
    [(1.8, 0.02, 100, True), (4.2, 3.2, 1, True), (4.2, 3.2, 5, True), (2.0, 3.2, 1, False)],
)
def test_a_write_in_place_overlaps_one_step_whatever_the_save_steps(write, step, save_steps, noted):
    """In place, the next optimizer step waits for the write: more --save-steps give it no room, and
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


@pytest.mark.parametrize("seed", range(40))
def test_each_saves_stall_is_found_in_generated_step_times(seed):
    """Step times without saves drawn at random; the same run with saves pays a known stall in the step after each
    save's step (the Trainer saves after on_step_end: test_a_save_lands_between_its_steps_end_and_the_next). Every
    save's stall is recovered, the first apart from the later ones, whatever the warm-up and --save-steps."""
    rng = random.Random(seed)
    warmup, k, saves = rng.randint(0, 4), rng.choice([1, 2, 3, 5, 100]), rng.randint(1, 7)
    steps = saves * k + warmup
    plain = [rng.uniform(0.01, 0.05) for _ in range(steps)]
    # the Trainer saves at every multiple of k
    paid = {m: rng.uniform(0.0, 3.0) for m in range(1, steps // k + 1)}
    with_saves = list(plain)
    for m, stall in paid.items():
        # step m*k+1 holds save m; a save after the last step is after the last step time
        if m * k < steps:
            with_saves[m * k] += stall
    ends = lambda durations: [sum(durations[: i + 1]) for i in range(steps)]  # noqa: E731
    a = argparse.Namespace(warmup=warmup, save_steps=k)
    found = stall_of_each_save({"step_end": ends(with_saves)}, {"step_end": ends(plain)}, a)
    # the step holding it (m*k+1) is timed after the warm-up
    measurable = {m: v for m, v in paid.items() if warmup < m * k < steps}
    assert found.keys() == measurable.keys()
    for m, stall in measurable.items():
        assert found[m] == pytest.approx(stall, abs=1e-9)
    summary = first_and_later(found)
    assert summary["stall_first_save_seconds"] == (pytest.approx(paid[1], abs=1e-4) if 1 in measurable else None)
    later = sorted(v for m, v in measurable.items() if m > 1)
    if later:
        assert min(later) - 1e-4 <= summary["stall_later_saves_median_seconds"] <= max(later) + 1e-4
    else:
        assert summary["stall_later_saves_median_seconds"] is None
    assert split(summary).count("/") == 1


def test_a_save_lands_between_its_steps_end_and_the_next(tmp_path):
    """The order stall_of_each_save relies on, asked of a real transformers Trainer: a checkpoint at step s is written
    after on_step_end of step s and before step s+1 ends."""
    import torch
    from transformers import Trainer, TrainerCallback, TrainingArguments

    events = []

    class Order(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            events.append(("end", state.global_step))

        def on_save(self, args, state, control, **kwargs):
            events.append(("save", state.global_step))

    class Tiny(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.w = torch.nn.Linear(2, 1)

        def forward(self, x, labels=None):
            return {"loss": ((self.w(x).squeeze(-1) - labels) ** 2).mean()}

    data = [{"x": torch.randn(2), "labels": torch.tensor(0.0)} for _ in range(8)]
    args = TrainingArguments(
        str(tmp_path),
        max_steps=5,
        save_strategy="steps",
        save_steps=2,
        per_device_train_batch_size=1,
        report_to="none",
        use_cpu=True,
        save_only_model=True,
        logging_strategy="no",
    )
    Trainer(model=Tiny(), args=args, train_dataset=data, callbacks=[Order()]).train()
    for s in (2, 4):
        i = events.index(("save", s))
        assert events[i - 1] == ("end", s) and events[i + 1] == ("end", s + 1), events


@pytest.mark.parametrize("args", [["--save-steps", "0"], ["--saves", "0"], ["--warmup", "-1"], ["--nprocs", "0"]])
def test_numbers_out_of_range_are_one_line_before_anything_runs(args, capsys):
    """Not a per-save split that loops for good (--save-steps 0), nor a division by zero at the end (--saves 0)."""
    import bench.checkpoint_benchmark as benchmark

    with pytest.raises(SystemExit) as stopped:
        benchmark.main(args)
    assert stopped.value.code == 2 and f"{args[0]} must be at least" in capsys.readouterr().err
