"""Stops and data that used to end in a traceback or a hang, each now one line with a defined exit: a stop signal
before training, a SLURM requeue loop that makes no progress, a node rank outside the job, and data files whose
records are null, numbers or empty cells (and ones that are fine although they look odd: a byte-order mark, a
first record over the sampled MiB)."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest
from conftest import QUICK, REPO, launch

from fsdp_recipes.ckpt.resume import MAX_STALLED_REQUEUES, REQUEUE_RECORD, check_requeue
from fsdp_recipes.config.data_files import train_file_problem
from fsdp_recipes.errors import RecipeError

FAULT = REPO / "tests" / "helpers" / "train_with_fault.py"


def _plain(**kw):
    """The data arguments these checks read (DataArguments' own __post_init__ would check the file first)."""
    from types import SimpleNamespace

    return SimpleNamespace(**{"text_column": "text", "messages_column": "messages", "data_format": "auto", **kw})


CHAT_OK = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]}
BAD_JSONL = {
    "text null": ([{"text": "a"}, {"text": None}], "record 2: 'text' is null, not text"),
    "text number": ([{"text": 5}], "record 1: 'text' is a int (5), not text"),
    "text list": ([{"text": ["a"]}], "record 1: 'text' is a list"),
    "text object": ([{"text": {"a": 1}}], "record 1: 'text' is a dict"),
    "chat content null": (
        [CHAT_OK, {"messages": [{"role": "user", "content": None}, {"role": "assistant", "content": "x"}]}],
        "record 2: a 'user' turn's 'content' is null, not text",
    ),
    "chat content number": (
        [{"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": 3.5}]}],
        "record 1: a 'assistant' turn's 'content' is a float",
    ),
}


@pytest.mark.parametrize("case", sorted(BAD_JSONL))
def test_records_that_are_not_text_are_named(tmp_path, case):
    records, expected = BAD_JSONL[case]
    path = tmp_path / "d.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    problem = train_file_problem(path, _plain())
    assert problem and expected in problem, problem


@pytest.mark.parametrize(
    "rows, expected",
    [
        ("text,label\nhello,1\n,2\n", "line 3: the 'text' cell is empty"),
        ("text,label\nhello,1\n   ,2\n", "line 3: the 'text' cell is empty"),
        ("body,label\nhello,1\n", "has no 'text' column"),
        ("text,label\nhello,1\nworld,2\n", None),
    ],
)
def test_csv_cells(tmp_path, rows, expected):
    path = tmp_path / "d.csv"
    path.write_text(rows)
    problem = train_file_problem(path, _plain())
    assert (problem is None) if expected is None else (problem and expected in problem), problem


def test_files_datasets_reads_are_accepted(tmp_path):
    """A byte-order mark and a first record longer than the sampled MiB: datasets reads both."""
    from datasets import load_dataset

    bom = tmp_path / "bom.jsonl"
    bom.write_bytes(b"\xef\xbb\xbf" + b'{"text": "hello"}\n{"text": "world"}\n')
    big = tmp_path / "big.jsonl"
    big.write_text(json.dumps({"text": "x" * (1 << 21)}) + "\n" + json.dumps({"text": "y"}) + "\n")
    for path in (bom, big):
        assert train_file_problem(path, _plain()) is None, path
        assert len(load_dataset("json", data_files=str(path), split="train")) == 2  # and datasets does read it


def test_a_null_past_the_sample_is_one_error_not_a_tokenizer_traceback():
    from datasets import Dataset

    from fsdp_recipes.train.data import pack_text
    from fsdp_recipes.train.modeling import load_tokenizer

    tokenizer = load_tokenizer(_plain(tokenizer_name=str(REPO / "assets" / "tiny-llama"), trust_remote_code=False))
    raw = Dataset.from_dict({"text": ["fine", None]})
    with pytest.raises(RecipeError, match="a record's 'text' is null, not text"):
        pack_text(raw, tokenizer, _plain(block_size=8, preprocessing_num_workers=None))


def test_requeue_loop_without_progress_stops(tmp_path, monkeypatch):
    out = tmp_path / "run"
    out.mkdir()
    ckpt = str(out / "checkpoint-9")
    monkeypatch.delenv("SLURM_RESTART_COUNT", raising=False)
    assert check_requeue(str(out), ckpt) is None  # not a requeued job: nothing recorded
    for restart in range(1, MAX_STALLED_REQUEUES + 1):  # the first requeue, then attempts that start where it did
        monkeypatch.setenv("SLURM_RESTART_COUNT", str(restart))
        record = check_requeue(str(out), ckpt)
        assert record == {"restart": restart, "step": 9, "stalled": restart - 1}
        (out / REQUEUE_RECORD).write_text(json.dumps(record))  # what preflight writes on rank 0
    monkeypatch.setenv("SLURM_RESTART_COUNT", str(MAX_STALLED_REQUEUES + 1))
    with pytest.raises(RecipeError, match=f"requeued {MAX_STALLED_REQUEUES} times in a row without a new checkpoint"):
        check_requeue(str(out), ckpt)
    assert check_requeue(str(out), str(out / "checkpoint-12"))["stalled"] == 0  # a newer checkpoint: progress


@pytest.mark.parametrize("nodes, node_id", [("2", "2"), ("2", "7"), ("2", "-1"), ("two", "0"), ("0", "0")])
def test_node_rank_outside_the_job_is_refused_not_a_hang(nodes, node_id):
    env = {
        **os.environ,
        "SLURM_NNODES": nodes,
        "SLURM_NODEID": node_id,
        "PATH": f"{REPO / 'tests/helpers/fake_slurm'}:{os.environ['PATH']}",
    }
    proc = subprocess.run(
        ["bash", str(REPO / "tools/slurm/launch_node.sh"), "accelerate_configs/zero3.yaml"],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert proc.returncode == 2 and proc.stderr.startswith("launch_node.sh: error: SLURM_NODEID="), proc.stderr


@pytest.mark.slow
@pytest.mark.parametrize("sig, code", [("TERM", 143), ("INT", 130)])
def test_stop_signal_before_training_is_one_line(tmp_path, sig, code):
    """A stop (or Ctrl-C: it said "nothing was saved since the last checkpoint", as if training had begun) while the
    model loads."""
    out = tmp_path / "run"
    proc = launch(
        "accelerate_configs/zero3.yaml",
        *QUICK,
        "--output_dir",
        str(out),
        script=FAULT,
        env={"FSDP_FAULT": f"all:early:{sig}"},
        check=False,
    )
    ours = [line for line in proc.stderr.splitlines() if line.startswith("train_fsdp.py:")]
    how = "interrupted" if sig == "INT" else f"stopped by SIG{sig}"
    assert proc.returncode != 0 and ours == [
        f"train_fsdp.py: {how} before training started: nothing was trained or saved by this run; run the same "
        "command again to start (with --resume_from_checkpoint true, to continue from the last checkpoint of an earlier run)"
    ], proc.stderr[-3000:]
    # no traceback of a rank (the launcher's own report about its failed children is the launcher's)
    assert f"exitcode  : {code}" in proc.stderr and "[rank" not in proc.stderr and "Stopped" not in proc.stderr, (
        proc.stderr[-3000:]
    )
    assert not list(out.glob("checkpoint-*"))


@pytest.mark.parametrize("sig", ["TERM", "USR1", "INT"])
def test_a_stop_while_torch_imports_is_one_line(tmp_path, sig):
    """(hostile probe) SIGTERM in the first seconds of train_fsdp.py, while torch and transformers import, ended it with
    a bare 143 and no line (Ctrl-C: an import traceback). The handlers are in place before torch is loaded (read from
    /proc: the process has caught SIGTERM, the last installed, while no libtorch is mapped yet); the signal then
    ends it with the one line every stop before training gives."""
    import re
    import signal
    import sys
    import time

    signum = getattr(signal, "SIG" + sig)
    env = {k: v for k, v in os.environ.items() if k not in ("LOCAL_RANK", "RANK", "WORLD_SIZE")}
    proc = subprocess.Popen(
        [sys.executable, str(REPO / "train_fsdp.py"), "--output_dir", str(tmp_path / "run")],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )  # a suite run with & ignores it
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
        ["python", "-c", SIGNALS_IN_FINALIZERS, *cases],
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
    """Every scenario of the two tests below, in one process (each process pays ~5 s importing transformers)."""
    return _finalizer_scenarios(*FINALIZER_CASES, *(f"del:{pair}" for pair in SIGNAL_PAIRS))


@pytest.mark.slow  # seconds of subprocess scenarios: the full tier keeps the quick one under 3 minutes
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


def test_two_signals_at_once_in_a_finalizer_still_stop_the_run_in_one_line(finalizer_outcomes):
    """(hostile review) the second signal's handler ran inside the unraisable hook dealing with the first, where Python
    swallowed it too: a traceback, and the run went on. Either signal may be the one that stops it."""
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
    preemption._interrupts.append(2)  # a Ctrl-C the same way
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


@pytest.mark.slow  # seconds of subprocess scenarios: the full tier keeps the quick one under 3 minutes
def test_an_interrupt_at_exit_is_not_sent_again_into_the_next_exit_callback():
    """(hostile review) a KeyboardInterrupt in an atexit callback reaches the unraisable hook too; sent again, it
    aborted every later exit callback in turn, silently. At exit it is reported as Python always did."""
    proc = subprocess.run(
        ["python", "-c", AT_EXIT],
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
