"""The feature runs on accelerate_configs/zero3.yaml that end normally, of several test files, trained one after
another in one launch (tests/helpers/launch_sequence.py): a launch each would pay torch's start-up every time.

    runs = zero3_runs(trained, tmp_path_factory)  # in a module-scoped fixture of the test file
    out, said = runs("chat")  # the run's output_dir (its own: copy it to change it) and its SequencedRun

The first test file to ask launches them all, under a file lock; the others read the runs. A run that is resumed
is resumed by a launch of its own, from a copy: the sequence's process holds each run's output_dir until it ends."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from conftest import QUICK, quick, shared_temp
from helpers.launch_sequence import FAULT_SEQUENCE, SequencedRun, launch_sequence

ZERO3 = "accelerate_configs/zero3.yaml"


def feature_runs(base: Path) -> dict[str, list[str]]:
    """Each run's train_fsdp.py arguments but --output_dir; ``base``: the session's trained run's model."""
    return {
        # test_training: evaluated, profiled and reported to TensorBoard; first, as in a launch of its own
        "evaluation": [
            *QUICK,
            "--validation_split_percentage",
            "10",
            "--eval_strategy",
            "steps",
            "--eval_steps",
            "6",
            "--report_to",
            "tensorboard",
            "--profile_steps",
            "3-4",
        ],
        # test_training: chat SFT over the trained run, padding-free
        "chat": [
            "recipes/tiny-llama/chat_sft.yaml",
            "--model_name_or_path",
            str(base),
            "--max_steps",
            "12",
            "--logging_steps",
            "2",
            "--save_steps",
            "12",
            "--packing",
            "padding_free",
        ],
        # test_cpu_runs: the batch size chosen by the run
        "auto_batch": [
            "--max_steps",
            "2",
            "--save_strategy",
            "no",
            "--per_device_train_batch_size",
            "auto",
            "--block_size",
            "32",
        ],
        # test_resume_refusals: a model built in bf16 under mixed precision, which a launch of its own resumes
        "bf16": [*quick(max_steps="2", save_steps="2"), "--dtype", "bfloat16", "--cpu_bf16", "true"],
    }


def zero3_runs(trained, tmp_path_factory) -> Callable[[str], tuple[Path, SequencedRun]]:
    """``get(name)`` -> (output_dir, SequencedRun) of feature_runs' run ``name``, ended normally. Evaluations leave
    each rank's metrics in the "eval" folder beside the runs (FSDP_DUMP_EVAL, tests/helpers/train_with_fault.py)."""
    folder = shared_temp(tmp_path_factory) / "zero3-feature-runs"
    (folder / "eval").mkdir(parents=True, exist_ok=True)
    runs = feature_runs(trained(ZERO3).model_dir)
    get = launch_sequence(
        folder,
        ZERO3,
        {name: [*flags, "--output_dir", str(folder / name)] for name, flags in runs.items()},
        script=FAULT_SEQUENCE,
        env={"FSDP_DUMP_EVAL": str(folder / "eval")},
    )
    return lambda name: (folder / name, get(name))
