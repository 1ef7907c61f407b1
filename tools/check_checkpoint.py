"""Is a training checkpoint complete and resumable? Reads metadata and file sizes only, no tensors.

    python tools/check_checkpoint.py runs/tiny-llama-pretrain/checkpoint-120   # one checkpoint
    python tools/check_checkpoint.py runs/tiny-llama-pretrain                  # every checkpoint of a run
    python tools/check_checkpoint.py runs/tiny-llama-pretrain --json

Each checkpoint is "resumable", "INCOMPLETE: <what is missing or damaged>", "UNREADABLE BY THIS VERSION (<the
dtype or class another torch version wrote>)": that one may be complete, or "WEIGHTS ONLY": complete model weights
without optimizer state (save_only_model's), a model that cannot resume a run; `--resume_from_checkpoint true` stops
at either of the last two rather than passing over it. A run training in the folder now (its lock on this host, or
its lock file) is named first: a checkpoint it is still writing shows as INCOMPLETE until it is done.

Exit status 0 when the checkpoint (or, for a run folder, the one `--resume_from_checkpoint true` would use) is
resumable, 1 otherwise.
"""

import argparse
import json
import sys
from pathlib import Path

from fsdp_recipes.ckpt.layout import checkpoint_steps, final_model_folder
from fsdp_recipes.ckpt.status import checkpoint_status
from fsdp_recipes.console import HelpFormatter
from fsdp_recipes.locks import live_run


def is_run_folder(path: Path) -> bool:
    final_dir = final_model_folder(path)
    return (
        bool(checkpoint_steps(path))
        or (path / "run_args.json").is_file()
        or (final_dir is not None and final_dir != path)
    )


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(
        description="Report whether FSDP training checkpoints are complete and resumable: step, FSDP version, sharding "
        "strategy, state-dict type, world size, and every missing or truncated file (model and optimizer shards "
        "against their DCP metadata, scheduler, per-rank RNG states, trainer state). For a run folder, also which "
        "checkpoint `--resume_from_checkpoint true` would use.",
        formatter_class=HelpFormatter,
    )
    parser.add_argument("path", help="a checkpoint-N folder, or a run's output folder holding checkpoint-N folders")
    parser.add_argument("--json", action="store_true", help="print a JSON report instead of one line per checkpoint")
    args = parser.parse_args(argv)

    path = Path(args.path)
    if not path.is_dir():
        print(
            f"check_checkpoint.py: error: {path} is not a folder: give a checkpoint-N folder or a run's output folder",
            file=sys.stderr,
        )
        return 1
    final_dir = final_model_folder(path)
    run_folder = is_run_folder(path)
    final = final_dir if run_folder else None
    # a run training there now: a checkpoint it is still writing is INCOMPLETE until done, which is not damage
    run_dir = path if run_folder else path.resolve().parent
    training = live_run(run_dir) if run_folder or is_run_folder(run_dir) else None
    if training and not args.json:
        print(f"{run_dir}: {training}: a checkpoint it is still writing shows as INCOMPLETE until it is done")
    # a finished run that kept no checkpoint (save_strategy no)
    if run_folder and not checkpoint_steps(path):
        if args.json:
            print(
                json.dumps(
                    {
                        "checkpoints": [],
                        "resume_uses": None,
                        "final_model": final and str(final),
                        "training_now": training,
                    },
                    indent=2,
                )
            )
        else:
            print(
                f"{path}: no checkpoint-N folders (saved with save_strategy no, or none written yet): nothing to resume"
            )
            print(f"final model: {final}" if final else "final model: none (the run has not finished)")
        return 0 if final else 1
    folders = checkpoint_steps(path) or [path]
    statuses = [checkpoint_status(folder) for folder in folders]
    # as resolve_resume("true"): the newest resumable one, unless a newer one may be good (unreadable by this
    # version, weights only)
    stop = next((s for s in statuses if s.resumable or s.may_be_good), None)
    chosen = stop if stop is not None and stop.resumable else None
    if args.json:
        print(
            json.dumps(
                {
                    "checkpoints": [s.to_dict() for s in statuses],
                    "resume_uses": chosen and chosen.path,
                    "final_model": final and str(final),
                    "training_now": training,
                },
                indent=2,
            )
        )
    else:
        for status in statuses:
            print(status.summary())
        if len(statuses) > 1 or folders[0] != path:
            skipped = [Path(s.path).name for s in statuses[: statuses.index(chosen)]] if chosen else []
            if stop is not None and chosen is None and stop.weights_only:
                earlier = ", or resume an earlier checkpoint by its path" if any(s.resumable for s in statuses) else ""
                print(
                    f"resume: --resume_from_checkpoint true stops at {Path(stop.path).name} (model weights "
                    "only, no optimizer "
                    f"state): it cannot resume a run, and its line above says what it is good for{earlier}"
                )
            elif stop is not None and chosen is None:
                print(
                    f"resume: --resume_from_checkpoint true stops at {Path(stop.path).name} (unreadable by this "
                    "version, "
                    "it may be complete): resume it with the torch version that wrote it, or an earlier "
                    "checkpoint by its path"
                )
            elif chosen is None:
                print("resume: no resumable checkpoint; start without --resume_from_checkpoint")
            else:
                aside = f" (setting aside {', '.join(skipped)})" if skipped else ""
                print(f"resume: --resume_from_checkpoint true uses {Path(chosen.path).name}{aside}")
        if run_folder:
            print(
                f"final model: {final}"
                + (" (written by an earlier version, beside the checkpoints)" if final == path else "")
                if final
                else "final model: none yet (the run has not finished; tools/merge_checkpoint.py makes one "
                "from a checkpoint)"
            )
    return 0 if chosen else 1


if __name__ == "__main__":
    sys.exit(main())
