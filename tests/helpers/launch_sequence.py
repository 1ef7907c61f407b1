"""One launch for several train_fsdp.py runs on one accelerate config, shared by the tests that read them: a launch
each would pay torch's, transformers' and the process group's start-up every time.

    runs = launch_sequence(folder, config, {"name": [train_fsdp.py's arguments...], ...})
    said = runs("name")  # the first call launches every run, one after another; the others read the result

    refused = runs("bad", refused=True).refusal  # a run expected to stop: the line train_fsdp.py would print

The runs train in the order given, each as its command line trains it (tests/helpers/argv_sequence.py), the first
as in a launch of its own. pytest-xdist's workers share the launch under a file lock. A run that did not end normally
(or, asked for as refused, one that did), or a launch that did not exit 0, fails the test that asks for it, with that
run's output."""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from conftest import launch, read_json

from fsdp_recipes.train.exits import ONE_LINE_ERRORS, PROG

HELPERS = Path(__file__).resolve().parent
SEQUENCE = HELPERS / "argv_sequence.py"
# the same, under train_with_fault.py's injections (its FSDP_* variables, given in env, act on every run)
FAULT_SEQUENCE = HELPERS / "fault_sequence.py"


@dataclass
class SequencedRun:
    # this run's part of the launch's stdout: after its marker line, before the next one
    stdout: str
    # ... and of its stderr (rank 0 prints the markers: another rank's lines may fall in a neighbour's)
    stderr: str
    # the whole launch's stdout and stderr: a line only this run says is said once in all of it
    launch_output: str
    # a refused run's line, as train_fsdp.py prints it ("train_fsdp.py: error: ...")
    refusal: str | None = None


def launch_sequence(
    folder: Path,
    config: str,
    runs: dict[str, list[str]],
    script: Path = SEQUENCE,
    env: dict | None = None,
    launch_args: tuple[str, ...] = (),
) -> Callable[..., SequencedRun]:
    """``get(name, refused=False)`` -> the SequencedRun of ``runs[name]``, trained with ``config`` in one launch of
    ``script`` with the others. Each run's arguments name its own --output_dir (or an earlier run's, to resume it);
    its command file is ``folder/<name>.json``. ``refused``: the run must stop on every rank with the same error, one
    that train_fsdp.py's exit policy prints as its one line (fsdp_recipes/train/exits.py: ONE_LINE_ERRORS)."""
    from filelock import FileLock

    def get(name: str, refused: bool = False) -> SequencedRun:
        done = folder / "launch.json"
        with FileLock(f"{folder}.lock"):
            if not done.is_file():
                folder.mkdir(parents=True, exist_ok=True)
                commands = []
                for each, arguments in runs.items():
                    (folder / f"{each}.json").write_text(json.dumps(arguments))
                    commands.append(str(folder / f"{each}.json"))
                launched = {"returncode": None, "stdout": "", "stderr": "the launch raised: see the first test's error"}
                # once, whatever happens: a second launch would find the first one's output folders
                try:
                    proc = launch(config, *commands, script=script, env=env, launch_args=launch_args, check=False)
                    launched = {"returncode": proc.returncode, "stdout": proc.stdout, "stderr": proc.stderr}
                finally:
                    done.write_text(json.dumps(launched))
        launched = read_json(done)
        marker = f"=== RECIPE {folder / name}.json\n"
        stdout, stderr = (
            launched[key].partition(marker)[2].partition("=== RECIPE ")[0] for key in ("stdout", "stderr")
        )
        assert launched["returncode"] == 0, f"the launch exited {launched['returncode']}:\n{launched['stderr'][-6000:]}"
        result = read_json(folder / f"{name}.json.result.json")
        output = launched["stdout"] + launched["stderr"]
        if not refused:
            assert result["error"] is None, f"{result['error']}\n{stderr[-6000:]}"
            return SequencedRun(stdout, stderr, output)
        kind, _, message = str(result["error"]).partition(": ")
        assert kind in {e.__name__ for e in ONE_LINE_ERRORS}, f"{name} was not refused:\n{stderr[-6000:]}"
        # every rank's error (a run refused before the process group exists has rank 0's alone), the same, one line
        assert len(result["errors"]) == result["world_size"], f"{name}: refused before every rank could say so"
        assert len(set(result["errors"])) == 1 and "\n" not in message, result["errors"]
        return SequencedRun(stdout, stderr, output, refusal=f"{PROG}: error: {message}")

    return get


class InterruptedRun:
    """A run left interrupted by a launch of its own (or by files put in place), resumed in a launch shared with
    others (``resumed_together``): its output_dir, the interrupted launch (None without one), that folder as it was
    before any resume (a copy), and the resume."""

    def __init__(self, out: Path, killed, resumes: Callable[[str], SequencedRun]):
        self.out, self.killed, self.as_left = out, killed, out.with_name(f"{out.name}-as-left")
        self._resumes = resumes

    def resume(self) -> SequencedRun:
        """The resume's part of the shared launch, which the first test to ask for a resume starts."""
        return self._resumes(self.out.name)


def run_and_resume(
    folder: Path, config: str, args: list[str], checkpoint: str, launch_args: tuple[str, ...] = ()
) -> tuple[Callable[..., SequencedRun], Path, Path]:
    """(launch_sequence's ``get``, the run's output_dir, its resume's): a run of ``args`` into ``folder/run`` and
    its resume from its ``checkpoint`` (checkpoint-N) into ``folder/resumed``, in one launch."""
    out, resumed = folder / "run", folder / "resumed"
    runs = {
        "run": [*args, "--output_dir", str(out)],
        "resumed": [*args, "--output_dir", str(resumed), "--resume_from_checkpoint", str(out / checkpoint)],
    }
    return launch_sequence(folder / "launch", config, runs, launch_args=launch_args), out, resumed


def resumed_together(
    root: Path,
    config: str,
    cases: dict[str, tuple[Callable, list[str]]],
    script: Path = SEQUENCE,
    env: dict | None = None,
) -> dict[str, InterruptedRun]:
    """``cases``: name -> (interrupt, resume's arguments). ``interrupt(out)`` leaves output_dir ``root/name`` as a
    resume finds it and returns the launch it interrupted, if any; the folder is then copied. Every resume (its
    arguments and ``--output_dir root/name``) trains in one launch of ``config``: a launch per resume would pay
    torch's start-up each time. ``script`` and ``env``: launch_sequence's (FAULT_SEQUENCE for the injections)."""
    runs, resumes = {}, {}
    # reads ``resumes`` when a test first asks
    get = launch_sequence(root / "resumes", config, resumes, script=script, env=env)
    for name, (interrupt, resume) in cases.items():
        out = root / name
        run = runs[name] = InterruptedRun(out, interrupt(out), get)
        assert out.is_dir(), f"{name}: the interruption left no {out}:\n{getattr(run.killed, 'stderr', '')[-3000:]}"
        shutil.copytree(out, run.as_left, symlinks=True)
        resumes[name] = [*resume, "--output_dir", str(out)]
    return runs
