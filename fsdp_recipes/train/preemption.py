"""Preemption: SIGTERM or SIGUSR1 ends the run after the current optimizer step, with a complete checkpoint.

SLURM sends SIGTERM to every process of a job step at the time limit or on preemption (then SIGKILL after
KillWait, 30 s by default), and with ``#SBATCH --signal=USR1@<seconds>`` SIGUSR1 that long before the limit
(tools/slurm/train_fsdp.sbatch asks for it and requeues the job). Without a handler every rank dies at once and
the work since the last periodic checkpoint is lost. Here a signal only sets a flag; at the end of each optimizer
step the ranks agree, by an all-reduce of that flag, whether any of them got one (the signal reaches ranks at
slightly different moments, and every rank must stop at the same step), and if so the Trainer writes
``checkpoint-<step>`` exactly as a periodic save would and stops. The run then says how to resume and exits
with 128 + the signal number.

The agreement costs one all-reduce of one integer per optimizer step. It runs on a gloo group, on the CPU, so a
GPU run never waits for its device to drain at step ends.

The stop has a deadline it does not set: torch elastic (accelerate launch, torchrun) sends SIGKILL to the ranks 30 s
after the SIGTERM it forwards (TORCH_ELASTIC_SHUTDOWN_TIMEOUT changes it; accelerate leaves it), SLURM KillWait after
its own. A checkpoint whose write is cut short there stays incomplete (no trainer_state.json) and a resume passes
over it; so when the stop begins, rank 0 says which checkpoints are still to be written and where a resume would
start if the job were killed first (``kill_warning``): after SIGKILL nothing can be said.
"""

from __future__ import annotations

import os
import signal
from pathlib import Path

from transformers import TrainerCallback

STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1)


class Preemption(TrainerCallback):
    def __init__(self):
        # the signal number, 0 while none came
        self.received = 0
        # the step whose checkpoint was written because of it
        self.stopped_at: int | None = None
        self.signal = 0
        self._group = None
        # a stop whose Stopped was lost (a finalizer swallows it) ends here, before training
        stopped_before()
        for sig in STOP_SIGNALS:
            signal.signal(sig, self._on_signal)

    def _on_signal(self, signum, frame):
        self.received = signum

    def on_train_begin(self, args, state, control, **kwargs):
        import torch.distributed as dist

        global _training
        _training = True
        if dist.is_available() and dist.is_initialized() and self._group is None:
            # every rank gets here, in the same order: the collective creation is matched
            self._group = dist.group.WORLD if dist.get_backend() == "gloo" else dist.new_group(backend="gloo")

    def on_step_end(self, args, state, control, **kwargs):
        import torch
        import torch.distributed as dist

        flag = torch.tensor([self.received], dtype=torch.int32)
        if self._group is not None:
            dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self._group)
        if flag.item():
            self.signal, self.stopped_at = int(flag.item()), state.global_step
            control.should_save = True
            control.should_training_stop = True
        return control

    def describe(self) -> str:
        return signal.Signals(self.signal).name if self.signal else ""

    def late(self) -> str | None:
        """The signal that came after the last step (training had finished; the run still writes its model)."""
        return signal.Signals(self.received).name if self.received and self.stopped_at is None else None


def kill_warning(
    stop: str, stopped_at: int | None, step: int, writing: list[str], run_dir: str | os.PathLike, env=os.environ
) -> str | None:
    """The line for the save of step ``step``: None unless it is the stop's own (``stopped_at``, by signal ``stop``).
    ``writing``: the checkpoint folders not yet complete, in the order their writes end (a background save still in
    flight, then this step's); ``run_dir``: where the complete ones are."""
    if stopped_at is None or stopped_at != step or not writing:
        return None
    before = resume_point(run_dir, writing)
    if len(writing) == 1:
        lost = f"{writing[0]} is left incomplete and " + (
            f"a resume starts from {before}" if before else "no complete checkpoint is left to resume from"
        )
    else:
        lost = (
            f"the one cut short is left incomplete and a resume starts from {writing[-2]} if its write had ended, "
            + (f"else from {before}" if before else "else no complete checkpoint is left to resume from")
        )
    waiting = f", once {', '.join(writing[:-1])} (still being written) is complete" if len(writing) > 1 else ""
    ends = "its write ends" if len(writing) == 1 else "those writes end"
    return (
        f"{stop} after step {step}: saving {writing[-1]} before stopping{waiting}; if the job is killed before {ends}"
        f"{grace(stop, env)}, {lost}"
    )


def resume_point(run_dir: str | os.PathLike, writing: list[str]) -> str | None:
    """The checkpoint ``--resume_from_checkpoint true`` would take were the writes in flight cut short: the newest
    resumable checkpoint-N (fsdp_recipes.ckpt.status, which reads no shard's data) that is not one of them."""
    from fsdp_recipes.ckpt.layout import checkpoint_steps
    from fsdp_recipes.ckpt.status import checkpoint_status

    for folder in checkpoint_steps(Path(run_dir)):
        if folder.name not in writing and checkpoint_status(folder).resumable:
            return folder.name
    return None


def grace(stop: str, env=os.environ) -> str:
    """How long a torch elastic launch gives the ranks after its SIGTERM, and the variable that sets it (torchrun's
    own, PET_SHUTDOWN_TIMEOUT, wins over TORCH_ELASTIC_SHUTDOWN_TIMEOUT)."""
    if stop != "SIGTERM" or "TORCHELASTIC_RUN_ID" not in env:
        return ""
    name = next((n for n in ("PET_SHUTDOWN_TIMEOUT", "TORCH_ELASTIC_SHUTDOWN_TIMEOUT") if env.get(n)), None)
    seconds = env[name] if name else "30"
    return (
        f" (the launcher kills the ranks {seconds} s after SIGTERM; {name or 'TORCH_ELASTIC_SHUTDOWN_TIMEOUT'} sets it)"
    )


# Before the Trainer exists (argument checks, process group, data, model loading) there is no step to finish and
# nothing to save: a stop signal ends the run at once, in one line, with 128 + the signal number (Stopped), instead
# of the default handler's silent death or a traceback. Preemption replaces these handlers when it is created.
class Stopped(BaseException):
    """SIGTERM or SIGUSR1 before training started."""

    def __init__(self, signum: int):
        super().__init__(signum)
        self.signum = signum

    def describe(self) -> str:
        return signal.Signals(self.signum).name


_stops: list[int] = []
_raise_on_stop = True


def _on_stop_before_training(signum, frame):
    _stops.append(signum)
    if _raise_on_stop and not _ending() and not _deferred(signum, frame):
        raise Stopped(signum)


def _ending() -> bool:
    """Whether the main thread is already handling a stop or Ctrl-C (the run is ending: on its way to its one line).
    A second signal then is only recorded: raised there (say at the call that would have set _raise_on_stop to
    False), it would replace the first with a traceback."""
    import sys

    return isinstance(sys.exc_info()[1], (Stopped, KeyboardInterrupt))


def watch_stops() -> None:
    _catch_lost_signals()
    for sig in STOP_SIGNALS:
        signal.signal(sig, _on_stop_before_training)


def stopped_before() -> None:
    """Raises Stopped (or KeyboardInterrupt) for a signal that came before this point and did not end the run."""
    if _stops and _raise_on_stop:
        raise Stopped(_stops[-1])
    if _interrupts and _raise_on_interrupt:
        raise KeyboardInterrupt


# A handler's exception is raised wherever the main thread runs, and inside a finalizer (a __del__, a weakref
# callback: datasets and torch have them) Python prints it as "Exception ignored in ..." and goes on: the stop or
# Ctrl-C would be lost and training would start. So a handler that finds itself inside a finalizer (or inside the
# hook below) does not raise there: it sends the same signal again a moment later, from another thread, when the
# main thread has left it (were it in one again, again). A finalizer Python calls with no frame of ours to see
# (a weakref callback from a deallocation in C) still swallows the exception: the unraisable hook below sends the
# signal again the same way, without the traceback. At exit (atexit callbacks, the wait for threads) an interrupt
# is reported as Python always did: a re-sent one would only abort the next exit callback.
# seconds
REDELIVER_AFTER = 0.01


def _send_again(signum: int) -> None:
    import os
    import threading

    again = threading.Timer(REDELIVER_AFTER, os.kill, (os.getpid(), signum))
    again.daemon = True
    again.start()


def _deferred(signum: int, frame) -> bool:
    """Whether ``frame`` (where the handler interrupted the main thread) is inside a finalizer or the unraisable hook,
    where an exception would be swallowed; if so, the signal is sent again."""
    depth = 0
    while frame is not None and depth < 64:
        code = frame.f_code
        if (
            code.co_name == "__del__"
            or code is _redeliver.__code__
            or (code.co_name == "__call__" and code.co_filename.endswith("weakref.py"))
        ):
            _send_again(signum)
            return True
        frame, depth = frame.f_back, depth + 1
    return False


def _at_exit(unraisable) -> bool:
    import sys

    return (
        sys.is_finalizing()
        or "atexit" in (unraisable.err_msg or "")
        or unraisable.object is sys.modules.get("threading")
    )


def _redeliver(unraisable):
    exc, signum = unraisable.exc_value, None
    if isinstance(exc, Stopped) and _raise_on_stop and signal.getsignal(exc.signum) is _on_stop_before_training:
        signum = exc.signum
    elif (
        isinstance(exc, KeyboardInterrupt) and _raise_on_interrupt and signal.getsignal(signal.SIGINT) is _on_interrupt
    ):
        signum = signal.SIGINT
    if signum is None or _at_exit(unraisable):
        _previous_hook[0](unraisable)
    else:
        _send_again(signum)


# the hook ours replaced, once installed
_previous_hook: list = []


def _catch_lost_signals() -> None:
    import sys

    if not _previous_hook:
        _previous_hook.append(sys.unraisablehook)
        sys.unraisablehook = _redeliver


def quiet_stops() -> None:
    """A run that is already ending (one line said, waiting to exit): a stop signal, such as the launcher's SIGTERM
    to the ranks that are left, is only recorded."""
    global _raise_on_stop
    _raise_on_stop = False


def stop_received() -> int:
    """The stop signal that came before training (0: none), counting one whose handler has not run yet."""
    import time

    global _raise_on_stop
    _raise_on_stop = False
    # a call: the interpreter runs pending signal handlers
    time.sleep(0.05)
    return _stops[-1] if _stops else 0


# Ctrl-C sends SIGINT to the foreground process group; torch elastic starts each rank in a session of its own and
# forwards the signal to every rank. A rank inside a collective at that moment may first see its peer leave (gloo:
# "Connection closed by peer") and fail with that before its own KeyboardInterrupt is raised; that failure is the
# interrupt too, and is reported as one.
_interrupts: list[int] = []
_raise_on_interrupt = True
# set when the Trainer begins: what a Ctrl-C's line says was lost
_training = False


def training_began() -> bool:
    """Whether the Trainer had begun training (a Ctrl-C before then lost nothing this run made)."""
    return _training


def _on_interrupt(signum, frame):
    _interrupts.append(signum)
    if _raise_on_interrupt and not _ending() and not _deferred(signum, frame):
        raise KeyboardInterrupt


def watch_interrupts() -> None:
    """SIGINT raises KeyboardInterrupt, as Python's default handler does, and is remembered."""
    _catch_lost_signals()
    signal.signal(signal.SIGINT, _on_interrupt)


def was_interrupted() -> bool:
    """Whether SIGINT came, counting one that arrived but whose handler has not run yet (it runs here, quietly).
    Its callers are ending the run (an error): from here on a SIGINT is only recorded, and ends wait_for_stop."""
    import time

    global _raise_on_interrupt
    _raise_on_interrupt = False
    # a call: the interpreter runs pending signal handlers
    time.sleep(0.05)
    return bool(_interrupts)


def wait_for_stop(seconds: float) -> None:
    """For a rank that is ending: sleep up to ``seconds``, less when the launcher ends it first (SIGTERM, SIGUSR1 or
    SIGINT, whoever handled them before: here they are only counted)."""
    import time

    global _raise_on_stop, _raise_on_interrupt
    _raise_on_stop = _raise_on_interrupt = False
    # the Preemption callback's handler, if training had started, would only note it
    watch_stops()
    signal.signal(signal.SIGINT, _on_interrupt)
    # the launcher is already ending the job (Ctrl-C, a stop): rank 0 needs a head start only
    if _stops or _interrupts:
        seconds = min(seconds, 3)
    end, seen = time.monotonic() + seconds, len(_stops) + len(_interrupts)
    while time.monotonic() < end and len(_stops) + len(_interrupts) == seen:
        time.sleep(0.1)
