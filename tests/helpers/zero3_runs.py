"""The feature runs on accelerate_configs/zero3.yaml that end normally, of several test files, trained one after
another in one launch (tests/helpers/launch_sequence.py): a launch each would pay torch's start-up every time.

    runs = zero3_runs(trained, tmp_path_factory)  # in a module-scoped fixture of the test file
    out, said = runs("chat")  # the run's output_dir (its own: copy it to change it) and its SequencedRun

The first test file to ask launches them all, under a file lock; the others read the runs. A resume that needs no
interruption trains here too, right after its run, from the run's checkpoint by its path into an output_dir of its
own (the run's folder stays as the run left it); one that starts from a changed copy is a launch of its own."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from conftest import QUICK, quick, shared_temp
from helpers.launch_sequence import FAULT_SEQUENCE, SequencedRun, launch_sequence

ZERO3 = "accelerate_configs/zero3.yaml"
# the "bf16" run's and its resume's
BF16 = ("--dtype", "bfloat16", "--cpu_bf16", "true")


def feature_runs(base: Path, folder: Path) -> dict[str, list[str]]:
    """Each run's train_fsdp.py arguments but --output_dir (``folder``/name); ``base``: the session's trained run's
    model."""
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
        # test_resume_refusals: a model built in bf16 under mixed precision (bf16 is slow on this CPU: 2 steps) ...
        "bf16": [*quick(max_steps="2", save_steps="2"), *BF16],
        # ... and its resume with the same flags, 2 steps on
        "bf16-resumed": [
            *quick(max_steps="4", save_steps="2"),
            *BF16,
            "--resume_from_checkpoint",
            str(folder / "bf16" / "checkpoint-2"),
        ],
    }


def zero3_runs(trained, tmp_path_factory) -> Callable[[str], tuple[Path, SequencedRun]]:
    """``get(name)`` -> (output_dir, SequencedRun) of feature_runs' run ``name``, ended normally. Evaluations leave
    each rank's metrics in the "eval" folder beside the runs (FSDP_DUMP_EVAL, tests/helpers/train_with_fault.py)."""
    folder = shared_temp(tmp_path_factory) / "zero3-feature-runs"
    (folder / "eval").mkdir(parents=True, exist_ok=True)
    runs = feature_runs(trained(ZERO3).model_dir, folder)
    get = launch_sequence(
        folder,
        ZERO3,
        {name: [*flags, "--output_dir", str(folder / name)] for name, flags in runs.items()},
        script=FAULT_SEQUENCE,
        env={"FSDP_DUMP_EVAL": str(folder / "eval")},
    )
    return lambda name: (folder / name, get(name))
