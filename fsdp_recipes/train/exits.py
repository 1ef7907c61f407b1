"""How a run of train_fsdp.py ends: every stop, every error line and every exit code, decided here.

- an error with a fix (RecipeError and the other one-line errors): ``train_fsdp.py: error: ...``, exit 2;
- a full disk while training or writing the final model, a damaged checkpoint in the export: the same, with
  what to do next (``training_errors``, ``export_errors``);
- a stop (SIGTERM, SIGUSR1) or Ctrl-C before training started, imports included: one line, 128 + the signal;
- a stop during training: the Trainer saves a checkpoint of the step (fsdp_recipes.train.preemption), then one
  line and 128 + the signal (``stopped_after_checkpoint``);
- Ctrl-C during training: one line saying what to run next, exit 130;
- anything else: Python's traceback, exit 1.

Every rank fails alike and local rank 0 prints (``fail``). Nothing but the standard library and the errors is
imported at import time: train_fsdp.py installs ``catch_stops_while_importing`` first thing, before the
seconds-long imports of torch and transformers; the rest is imported where it is used, by then loaded.
"""

from __future__ import annotations

import atexit
import os
import signal
import sys
from collections.abc import Callable
from contextlib import contextmanager
from typing import NoReturn

from fsdp_recipes.errors import CheckpointError, InternalsChanged, NotShardedError, RecipeError, RefusedRemoval

PROG = "train_fsdp.py"
ONE_LINE_ERRORS = (RecipeError, NotShardedError, InternalsChanged, RefusedRemoval)
# how long a failing rank other than local rank 0 waits for it to print its line
FAIL_WAIT_SECONDS = 30
RESUME = "run the same command with --resume_from_checkpoint true to continue"


def before_training(how: str) -> str:
    """The line for a stop or Ctrl-C before training started (``how``: "interrupted", "stopped by SIGTERM")."""
    return (
        f"{PROG}: {how} before training started: nothing was trained or saved by this run; run the same command "
        "again to start (with --resume_from_checkpoint true, to continue from the last checkpoint of an earlier run)"
    )


def _stopped_while_importing(signum, frame):
    """A stop or Ctrl-C while torch and transformers import (the first ~5 s): the line of any stop before training,
    not a bare exit 143 or an import traceback. Nothing has started that needs cleaning up: leave at once."""
    if os.environ.get("LOCAL_RANK", "0") == "0":
        how = "interrupted" if signum == signal.SIGINT else f"stopped by {signal.Signals(signum).name}"
        os.write(2, (before_training(how) + "\n").encode())
    os._exit(128 + signum)


def catch_stops_while_importing() -> None:
    """Until ``run`` installs the real handlers. A signal ignored (a job started with &) stays ignored."""
    for signum in (signal.SIGINT, signal.SIGUSR1, signal.SIGTERM):
        if signal.getsignal(signum) is not signal.SIG_IGN:
            signal.signal(signum, _stopped_while_importing)


class Interrupted(KeyboardInterrupt):
    """Ctrl-C during training, with what to run next as output_dir was left (a first save cut short leaves none to
    resume from)."""

    def __init__(self, advice: str):
        super().__init__(advice)
        self.advice = advice


@contextmanager
def training_errors(trainer, output_dir: str):
    """Ctrl-C becomes Interrupted, a full disk one RecipeError; the progress bar is closed first, so the line that
    follows starts a line of its own."""
    # a BaseException
    from torch.distributed.checkpoint.api import CheckpointException

    from fsdp_recipes.ckpt.stop_advice import disk_full_problem, how_to_go_on
    from fsdp_recipes.train.preemption import was_interrupted

    try:
        yield
    except (Exception, CheckpointException, KeyboardInterrupt) as err:
        trainer.close_progress_bar()
        # A Ctrl-C during a save comes back wrapped by DCP, and from inside torch.save's C++ writer as its own
        # RuntimeError ("unexpected pos", which a full disk also gives): after a SIGINT, any error is the interrupt
        if isinstance(err, KeyboardInterrupt) or was_interrupted():
            raise Interrupted(how_to_go_on(output_dir)) from None
        if (problem := disk_full_problem(err, output_dir)) is None:
            raise
        raise RecipeError(problem) from None


@contextmanager
def export_errors(output_dir: str):
    """The final model's export, after training or from a finished checkpoint: a damaged checkpoint (the merge's
    CheckpointError) or a full disk is one RecipeError with its fix; after a Ctrl-C, any error is the interrupt (as
    in ``training_errors``)."""
    from torch.distributed.checkpoint.api import CheckpointException

    from fsdp_recipes.ckpt.stop_advice import disk_full_problem
    from fsdp_recipes.train.preemption import was_interrupted

    try:
        yield
    except (Exception, CheckpointException) as err:
        if was_interrupted():
            raise KeyboardInterrupt from None
        if isinstance(err, CheckpointError):
            raise RecipeError(f"the final export failed: {err}") from None
        if (problem := disk_full_problem(err, output_dir, export=True)) is None:
            raise
        raise RecipeError(problem) from None


def stopped_after_checkpoint(preemption, output_dir: str, log) -> NoReturn:
    """SIGTERM or SIGUSR1 during training: the Trainer has saved the step's checkpoint; exit 128 + the signal."""
    from fsdp_recipes.config.launcher import tell_launcher

    step = preemption.stopped_at
    message = (
        f"stopped by {preemption.describe()} after step {step}: saved {output_dir}/checkpoint-{step}; "
        f"the run is not finished: {RESUME}"
    )
    log(message)
    tell_launcher(f"{PROG}: {message}")
    sys.exit(128 + preemption.signal)


def fail(message: str, code: int) -> NoReturn:
    """One line per machine on stderr, and the same line as the launcher's root cause (its report ends with it).

    Every rank fails alike, and local rank 0 prints. The launcher stops the other ranks as soon as one exits, so
    the others wait for local rank 0 to print and exit (the launcher then stops them): were they first, it could be
    stopped before its line. A fixed head start was not enough on a loaded machine, where rank 0 can reach its
    error much later than rank 1; a rank whose error rank 0 does not share (a folder only it sees) still ends
    within the wait."""
    from fsdp_recipes.config.launcher import tell_launcher
    from fsdp_recipes.train.preemption import quiet_stops, wait_for_stop

    # the launcher's SIGTERM to the ranks still waiting here is no second failure; once local rank 0 has exited,
    # it ends their wait
    quiet_stops()
    tell_launcher(message)
    if os.environ.get("LOCAL_RANK", "0") == "0":
        print(message, file=sys.stderr, flush=True)
    else:
        wait_for_stop(FAIL_WAIT_SECONDS)
    sys.exit(code)


def run(main: Callable[[], None]) -> None:
    """``main()`` under the policy above. An error on a rank whose peer left on Ctrl-C or a stop (a collective
    broken under it) is that interrupt or stop."""
    from fsdp_recipes.train.preemption import (
        Stopped,
        stop_received,
        training_began,
        was_interrupted,
        watch_interrupts,
        watch_stops,
    )

    # until the Trainer's preemption handler takes over: a stop before training ends in one line
    watch_interrupts()
    watch_stops()
    try:
        try:
            main()
        except (*ONE_LINE_ERRORS, KeyboardInterrupt):
            raise
        except Exception:
            if was_interrupted():
                raise KeyboardInterrupt from None
            if signum := stop_received():
                raise Stopped(signum) from None
            raise
    except ONE_LINE_ERRORS as err:
        fail(f"{PROG}: error: {err}", 2)
    except Stopped as stop:
        fail(before_training(f"stopped by {stop.describe()}"), 128 + stop.signum)
    except KeyboardInterrupt as stop:
        # parsing, --help, loading: nothing of this run to lose
        if not training_began():
            fail(before_training("interrupted"), 130)
        go_on = getattr(stop, "advice", f"{RESUME} from the last checkpoint")
        fail(
            f"{PROG}: interrupted: nothing was saved since the last checkpoint; {go_on} (SIGTERM or SIGUSR1 instead "
            "of Ctrl-C saves one first)",
            130,
        )


def run_as_script(main: Callable[[], None]) -> None:
    """``run(main)``, then leave with its exit code as soon as every atexit handler has run, skipping the teardown
    of torch, transformers and peft module by module (about 1.5 s per process, after all output is written)."""
    code = [0]
    atexit.register(_exit_after_atexit, code)
    try:
        run(main)
    except SystemExit as stop:
        code[0] = stop.code if isinstance(stop.code, int) else (0 if stop.code is None else 1)
        raise
    except BaseException:
        # Python prints the traceback before atexit runs
        code[0] = 1
        raise


def _exit_after_atexit(code: list[int]) -> None:
    """Registered before the others of the run, so it runs after them (threads are joined by then)."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code[0])
