"""Train several recipes one after another in the same processes, each exactly as train_fsdp.py trains it (its
``main`` after ``parse_args``): one launch for a corpus of recipes, where one launch each would cost the start-up of
torch, transformers and the process group every time.

    accelerate launch --config_file accelerate_configs/zero3.yaml tests/helpers/trl_recipe_sequence.py RECIPE...

Between two recipes accelerate's state singletons are reset (the process group stays: the next PartialState finds it
joined), the launcher's mixed precision is restored (a run on a CPU changes it) and the run's output_dir lock is let
go, as its process's end would (a later recipe may resume that folder). Rank 0 starts each recipe's
output with a line ``=== RECIPE <path>`` (on stdout and stderr) and writes ``<path>.result.json``: {"seconds",
"error", "errors"}, the first rank's error as ``Type: message`` (None when the run ended normally on every rank)
and every rank's (a list, by rank); then the next recipe runs. Used by tests/integration/test_trl_recipe_runs.py,
and through tests/helpers/argv_sequence.py by the tests that share a launch among runs."""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

# train_fsdp.py, not tests/helpers/, first
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import train_fsdp  # noqa: E402 (after the path)
from fsdp_recipes.config.parse import parse_args  # noqa: E402
from fsdp_recipes.train import run_lock  # noqa: E402


def reset_accelerate() -> None:
    """accelerate's singletons as before the first run: the next TrainingArguments builds them afresh. dynamo's
    compiled code too, as in a new process: a second run's modules would otherwise count against its recompile
    limit, past which it runs them eagerly without a word."""
    from fsdp_recipes.compat import internals

    internals.get("torch._dynamo.reset")()
    internals.get("accelerate.state.AcceleratorState._reset_state")(reset_partial_state=True)
    internals.get("accelerate.state.GradientState._reset_state")()


def train_each(recipes: list[str]) -> None:
    import torch.distributed as dist

    precision = os.environ.get("ACCELERATE_MIXED_PRECISION")
    rank0 = os.environ.get("RANK", "0") == "0"
    for recipe in recipes:
        if rank0:
            print(f"=== RECIPE {recipe}", flush=True)
            print(f"=== RECIPE {recipe}", file=sys.stderr, flush=True)
        start, error = time.monotonic(), None
        try:
            train_fsdp.main(*parse_args([recipe]))
        except Exception as err:  # noqa: BLE001 (the test names it; the next recipe runs)
            error = f"{type(err).__name__}: {err}"
            print(error, file=sys.stderr, flush=True)
        errors = [error]
        # every rank's error: a run that failed on rank 1 alone failed
        if dist.is_initialized():
            errors = [None] * dist.get_world_size()
            dist.all_gather_object(errors, error)
            error = next((e for e in errors if e is not None), None)
        if rank0:
            result = {"seconds": round(time.monotonic() - start, 1), "error": error, "errors": errors}
            # errors has every rank's once joined
            result["world_size"] = int(os.environ.get("WORLD_SIZE", "1"))
            Path(f"{recipe}.result.json").write_text(json.dumps(result))
        reset_accelerate()
        run_lock.release()
        if precision is None:
            os.environ.pop("ACCELERATE_MIXED_PRECISION", None)
        else:
            os.environ["ACCELERATE_MIXED_PRECISION"] = precision


def leave(recipes: list[str]) -> None:
    """train_each, then leave as train_fsdp.py leaves (exits.run_as_script: once the atexit handlers have run, without
    the interpreter's teardown). The teardown aborted a rank now and then after the last run had ended: a thread of
    torch's still joinable ("terminate called without an active exception")."""
    from fsdp_recipes.train import exits

    exits.run_as_script(lambda: train_each(recipes))


if __name__ == "__main__":
    leave(sys.argv[1:])
