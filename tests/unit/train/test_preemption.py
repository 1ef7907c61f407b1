"""Stops (fsdp_recipes/train/preemption.py): a SIGTERM, SIGUSR1 or Ctrl-C while torch imports, or inside a
finalizer, or two at once, ends the run with the one line every stop before training gives and a defined exit,
never a traceback, a hang or a stop lost; an interrupt at exit is reported as Python does. (A stop signal during a
real launch: tests/integration/test_fault_tolerance.py.)"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest
from conftest import REPO


@pytest.mark.parametrize("sig", ["TERM", "USR1", "INT"])
def test_a_stop_while_torch_imports_is_one_line(tmp_path, sig):
    """SIGTERM in the first seconds of train_fsdp.py, while torch and transformers import, ends it with one line, not
    a bare 143 (Ctrl-C: not an import traceback). The handlers are in place before torch is loaded (read from
    /proc: the process has caught SIGTERM, the last installed, while no libtorch is mapped yet); the signal then
    ends it with the one line every stop before training gives."""
    import re
    import signal
    import sys
    import time

    signum = getattr(signal, "SIG" + sig)
    env = {k: v for k, v in os.environ.items() if k not in ("LOCAL_RANK", "RANK", "WORLD_SIZE")}
    # a suite run with & ignores it
    proc = subprocess.Popen(
        [sys.executable, str(REPO / "train_fsdp.py"), "--output_dir", str(tmp_path / "run")],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    try:
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            status = Path(f"/proc/{proc.pid}/status").read_text()
            maps = Path(f"/proc/{proc.pid}/maps").read_text()
            if int(re.search(r"SigCgt:\s*([0-9a-f]+)", status).group(1), 16) >> (signal.SIGTERM - 1) & 1:
                break
            assert "libtorch" not in maps, "torch was loaded before the stop handlers were in place"
            time.sleep(0.002)
        assert "libtorch" not in maps, "torch was loaded before the stop handlers were in place"
        os.kill(proc.pid, signum)
        _, err = proc.communicate(timeout=60)
    finally:
        proc.kill()
    how = "interrupted" if sig == "INT" else f"stopped by SIG{sig}"
    assert proc.returncode == 128 + signum and err.splitlines() == [
        f"train_fsdp.py: {how} before training started: nothing was trained or saved by this run; run the same command "
        "again to start (with --resume_from_checkpoint true, to continue from the last checkpoint of an earlier run)"
    ], err[-3000:]


# fsdp_recipes.train.preemption imports transformers only for the base class of its Trainer callback, which these
# scenarios do not use: a stand-in spares each process ~5 s of imports (transformers and torch install no signal
# handler or unraisable hook there, so the signals meet the same Python machinery)
WITHOUT_TRANSFORMERS = """
import sys, types
sys.modules["transformers"] = types.SimpleNamespace(TrainerCallback=object)
"""

SIGNALS_IN_FINALIZERS = r"""
import os, signal, sys, time, weakref
from fsdp_recipes.train import preemption
from fsdp_recipes.train.preemption import Stopped

class Holder:
    pass

def spin():
    for _ in range(100000):  # the handler runs here, inside the finalizer
        pass

def send(*names):
    def finalizer():
        both = {getattr(signal, "SIG" + n) for n in names}
        signal.pthread_sigmask(signal.SIG_BLOCK, both)  # pending together: the second's handler runs amid the first's
        for n in names:
            os.kill(os.getpid(), getattr(signal, "SIG" + n))
        signal.pthread_sigmask(signal.SIG_UNBLOCK, both)
        spin()
    return finalizer

class Finalized:
    def __init__(self, finalizer):
        self.finalizer = finalizer
    def __del__(self):
        self.finalizer()

def scenario(where, names):
    preemption._stops.clear(); preemption._interrupts.clear()
    preemption._raise_on_stop = preemption._raise_on_interrupt = True
    preemption.watch_interrupts(); preemption.watch_stops()
    try:
        if where == "del":
            Finalized(send(*names))  # dropped at once: __del__ runs
        else:
            weakref.finalize(Holder(), send(*names))  # the object dies at once: the callback runs
        for _ in range(1000):  # 10 s of work: a loaded machine may start the re-send late
            time.sleep(0.01)
        outcome = "went on"
    except (Stopped, KeyboardInterrupt) as stop:
        preemption.quiet_stops(), preemption.was_interrupted()  # as train_fsdp.py's fail(): later signals only noted
        outcome = stop.describe() if isinstance(stop, Stopped) else "interrupted"
    time.sleep(0.2)  # a second signal sent again arrives here, quietly, not in the next scenario
    return outcome

for case in sys.argv[1:]:
    where, names = case.split(":")
    print(case, scenario(where, names.split(",")), flush=True)
"""


def _finalizer_scenarios(*cases: str) -> dict[str, str]:
    proc = subprocess.run(
        ["python", "-c", WITHOUT_TRANSFORMERS + SIGNALS_IN_FINALIZERS, *cases],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )
    assert "Exception ignored" not in proc.stderr and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    return dict(line.split(" ", 1) for line in proc.stdout.splitlines())


FINALIZER_CASES = [f"{where}:{sig}" for where in ("del", "weakref") for sig in ("TERM", "USR1", "INT")]
SIGNAL_PAIRS = ["USR1,TERM", "TERM,INT", "INT,USR1", "INT,INT"]


@pytest.fixture(scope="module")
def finalizer_outcomes() -> dict[str, str]:
    """Every scenario of the two tests below, in one process."""
    return _finalizer_scenarios(*FINALIZER_CASES, *(f"del:{pair}" for pair in SIGNAL_PAIRS))


# seconds of subprocess scenarios: the full tier keeps the quick one under 3 minutes
@pytest.mark.slow
# subprocess scenarios of 5-9 s: the full tier's, keeping the quick tier within 3 minutes
@pytest.mark.slow
def test_a_stop_that_lands_in_a_finalizer_still_stops_the_run_without_a_traceback(finalizer_outcomes):
    """Python swallows (and prints) an exception raised in a finalizer: a stop or Ctrl-C whose handler raised there was
    lost and the run trained on (seen as a traceback in the one-line stop test). Now the handler does not raise there
    and the signal comes again outside. In one process, scenario after scenario, for a __del__ and a weakref.finalize
    callback."""
    got = {case: finalizer_outcomes.get(case) for case in FINALIZER_CASES}
    assert got == {
        case: {"TERM": "SIGTERM", "USR1": "SIGUSR1", "INT": "interrupted"}[case.split(":")[1]]
        for case in FINALIZER_CASES
    }


# subprocess scenarios of 5-9 s: the full tier's, keeping the quick tier within 3 minutes
@pytest.mark.slow
def test_two_signals_at_once_in_a_finalizer_still_stop_the_run_in_one_line(finalizer_outcomes):
    """The second signal's handler may run inside the unraisable hook dealing with the first, where Python would
    swallow it too (a traceback, and the run going on). Either signal may be the one that stops it."""
    names = {"TERM": "SIGTERM", "USR1": "SIGUSR1", "INT": "interrupted"}
    got = {pair: finalizer_outcomes.get(f"del:{pair}") for pair in SIGNAL_PAIRS}
    assert all(got[pair] in {names[n] for n in pair.split(",")} for pair in SIGNAL_PAIRS), got


def test_a_stop_recorded_before_the_trainer_takes_over_is_not_dropped():
    """The last line of defence: a stop that came before training and did not end the run (its Stopped lost) ends it
    when the Trainer's preemption handler takes over, instead of being replaced with it."""
    from fsdp_recipes.train import preemption

    preemption._stops.append(15)
    try:
        with pytest.raises(preemption.Stopped):
            preemption.Preemption()
    finally:
        preemption._stops.clear()
    # a Ctrl-C the same way
    preemption._interrupts.append(2)
    try:
        with pytest.raises(KeyboardInterrupt):
            preemption.Preemption()
    finally:
        preemption._interrupts.clear()


AT_EXIT = r"""
import atexit, os, signal, sys, time
from fsdp_recipes.train.preemption import watch_interrupts, watch_stops
watch_interrupts()
watch_stops()

def slow(name):
    for _ in range(30):
        time.sleep(0.01)
    print("completed", name, flush=True)

for name in "cba":
    atexit.register(slow, name)
atexit.register(os.kill, os.getpid(), signal.SIGINT)  # runs first: Ctrl-C as the program finishes
"""


# seconds of subprocess scenarios: the full tier keeps the quick one under 3 minutes
@pytest.mark.slow
def test_an_interrupt_at_exit_is_not_sent_again_into_the_next_exit_callback():
    """A KeyboardInterrupt in an atexit callback reaches the unraisable hook too: at exit it is reported as Python
    always does, not sent again (which would abort every later exit callback in turn, silently)."""
    proc = subprocess.run(
        ["python", "-c", WITHOUT_TRANSFORMERS + AT_EXIT],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )
    assert proc.stdout.split() == ["completed", "a", "completed", "b", "completed", "c"], (
        proc.stdout,
        proc.stderr[-2000:],
    )


CTRL_C_IN_A_SAVE = """
import signal, sys
from pathlib import Path
from types import SimpleNamespace
import torch
import torch.distributed.checkpoint as dcp
from fsdp_recipes import direct_writes
from fsdp_recipes.compat.async_dcp import ShardFiles, checkpoint_saves
from fsdp_recipes.train import exits, preemption
direct_writes.CHUNK = 1 << 20  # the shard spans 7 chunks: most of its bytes go through torch.save's C++ writer
write, calls = direct_writes.DirectFile.write, []
def interrupted_write(self, data):
    calls.append(memoryview(data).nbytes)
    if len(calls) == at:
        signal.raise_signal(signal.SIGINT)
    return write(self, data)
direct_writes.DirectFile.write = interrupted_write
def save(out):
    with checkpoint_saves(ShardFiles(), direct=True):
        writer = dcp.FileSystemWriter(str(out / "checkpoint-3" / "pytorch_model_fsdp_0"))
        dcp.save({"w": torch.randn(1500, 1100), "step": torch.tensor(3)}, storage_writer=writer, no_dist=True)
at = 0
save(Path(sys.argv[1]) / "whole")
# a Ctrl-C in the first write, the last, the largest (the tensor's bytes: every chunk) and every n-th between
n, largest = len(calls), calls.index(max(calls)) + 1
errors = {  # a training step's checkpoint, and the final export's sharded save
    "training": lambda out: exits.training_errors(SimpleNamespace(close_progress_bar=lambda: None), str(out)),
    "export": lambda out: exits.export_errors(str(out)),
}
for at in sorted({1, 2, largest, n, *range(1, n + 1, max(1, n // 8))}):
    for where, policy in errors.items():
        calls.clear(); preemption._interrupts.clear(); preemption._raise_on_interrupt = True
        preemption.watch_interrupts()
        out = Path(sys.argv[1]) / f"{where}-at-{at}"
        try:
            with policy(out):
                save(out)
            print(f"{where}:{at}", "saved", flush=True)
        except BaseException as err:
            print(f"{where}:{at}", type(err).__name__, str(err).replace(chr(10), " ")[:200], flush=True)
"""


def test_ctrl_c_anywhere_in_a_checkpoint_save_is_the_interrupt_not_a_full_disk(tmp_path):
    """A Ctrl-C landing in any write of a shard ends training as a Ctrl-C does (exits.Interrupted, how to go on), and
    the final export as a KeyboardInterrupt (exits.run's interrupted line), though DCP wraps it and torch.save's C++
    writer turns it into a RuntimeError of its own ("unexpected pos"), the error a full disk also gives: generated
    over the writes of the save, from its first to its last."""
    proc = subprocess.run(
        ["python", "-c", WITHOUT_TRANSFORMERS + CTRL_C_IN_A_SAVE, str(tmp_path)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )
    outcomes = dict(line.split(" ", 1) for line in proc.stdout.splitlines())
    assert len(outcomes) > 15 and {"training:1", "export:1"} <= set(outcomes), proc.stderr[-3000:]
    for at, outcome in outcomes.items():
        if at.startswith("training"):
            assert outcome.startswith("Interrupted no checkpoint is complete (checkpoint-3 cut short)"), (at, outcome)
        else:
            assert outcome == "KeyboardInterrupt ", (at, outcome)
