"""One run per output_dir on any filesystem: a kernel lock on the folder itself (no file, nothing left behind)
where the filesystem has one, an O_EXCL lock file with host and pid where flock fails with ENOLCK, EOPNOTSUPP or
EBADF (Lustre without flock, NFS); simulated here by making flock fail as those filesystems do."""

from __future__ import annotations

import errno
import fcntl
import os
import socket
import subprocess
import sys
import tempfile
from pathlib import Path
from types import SimpleNamespace

import pytest

from fsdp_recipes.errors import RecipeError
from fsdp_recipes.locks import live_run, start_time
from fsdp_recipes.train import run_lock
from fsdp_recipes.train.preflight import hold_output_dir


def _args(out):
    return SimpleNamespace(process_index=0, output_dir=str(out))


def _dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


# Lustre without flock; NFS (flock as a POSIX lock, refused on a read-only fd)
@pytest.fixture(params=[errno.ENOLCK, errno.EBADF])
def no_posix_locks(monkeypatch, request):
    def refuse(fd, cmd, *args):
        raise OSError(request.param, os.strerror(request.param))

    monkeypatch.setattr(fcntl, "flock", refuse)


def test_a_filesystem_without_posix_locks_gets_a_lock_file_and_one_warning(tmp_path, no_posix_locks):
    said = []
    hold_output_dir(_args(tmp_path), warn=said.append)
    owner = tmp_path / run_lock.OWNER_NAME
    assert len(said) == 1 and "without folder locks" in said[0] and str(owner) in said[0]
    assert f"pid {os.getpid()}" in owner.read_text() and socket.gethostname() in owner.read_text()
    # a second run: refused, not a warning
    with pytest.raises(RecipeError, match="is in use by another run .*pid"):
        hold_output_dir(_args(tmp_path), warn=said.append)


def test_a_stale_lock_file_of_this_host_is_taken_over(tmp_path, no_posix_locks):
    owner = tmp_path / run_lock.OWNER_NAME
    owner.write_text(f"host {socket.gethostname()}, pid {_dead_pid()}, since 2026-01-01 00:00:00\n")
    hold_output_dir(_args(tmp_path), warn=lambda m: None)
    assert f"pid {os.getpid()}," in owner.read_text()


@pytest.mark.parametrize("line", ["host another-node-7, pid 4242, since 2026-01-01 00:00:00\n", ""])
def test_a_lock_file_that_cannot_be_judged_is_named_not_removed(tmp_path, no_posix_locks, line):
    owner = tmp_path / run_lock.OWNER_NAME
    owner.write_text(line)
    with pytest.raises(RecipeError, match=f"if that run is gone, delete {owner}"):
        hold_output_dir(_args(tmp_path), warn=lambda m: None)
    assert owner.read_text() == line


def test_a_live_pid_on_this_host_keeps_its_lock(tmp_path, no_posix_locks):
    owner = tmp_path / run_lock.OWNER_NAME
    owner.write_text(f"host {socket.gethostname()}, pid {os.getppid()}, since 2026-01-01 00:00:00\n")
    with pytest.raises(RecipeError, match=f"pid {os.getppid()}"):
        hold_output_dir(_args(tmp_path), warn=lambda m: None)


def test_a_lock_held_elsewhere_is_in_use_not_a_filesystem_without_locks(tmp_path, monkeypatch):
    def held(fd, cmd, *args):
        raise OSError(errno.EWOULDBLOCK, os.strerror(errno.EWOULDBLOCK))

    # held by a process on another host: /proc/locks here does not name it
    monkeypatch.setattr(fcntl, "flock", held)
    said = []
    with pytest.raises(RecipeError, match=r"in use by another run \(another process\) \(a run that died holds nothing"):
        hold_output_dir(_args(tmp_path), warn=said.append)
    assert said == [] and list(tmp_path.iterdir()) == []


def test_the_lock_file_is_removed_when_the_run_ends(tmp_path):
    """A real process on a filesystem made lockless: its lock file is gone after it exits 0."""
    code = (
        "import errno, fcntl, os, sys\n"
        "def refuse(*a):\n    raise OSError(errno.EOPNOTSUPP, 'not supported')\n"
        "fcntl.flock = refuse\n"
        "from pathlib import Path\n"
        "from fsdp_recipes.train import run_lock\n"
        # a call, not an assert: python -O would skip it
        f"refused = run_lock.take(Path({str(tmp_path)!r}), print)\n"
        "if refused is not None:\n    sys.exit(refused)\n"
        f"print(os.path.exists({str(tmp_path / run_lock.OWNER_NAME)!r}))\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    # held while it ran
    assert proc.stdout.strip().endswith("True")
    # and removed at its end
    assert not (tmp_path / run_lock.OWNER_NAME).exists()


def _make(path, kind):
    """A lock file as a hostile or broken filesystem leaves it."""
    host = socket.gethostname()
    if kind == "folder":
        path.mkdir()
    elif kind == "fifo":
        os.mkfifo(path)
    elif kind == "link":
        (path.parent / "target").write_text(f"host {host}, pid {_dead_pid()}, since then\n")
        path.symlink_to(path.parent / "target")
    elif kind == "huge":
        with open(path, "wb") as f:
            # sparse: 1 GiB of NULs, read only as far as a lock line goes
            f.truncate(1 << 30)
    elif kind == "overflowing pid":
        path.write_text(f"host {host}, pid 99999999999999999999, since then\n")
    elif kind == "unicode digit pid":
        path.write_text(f"host {host}, pid \u00b2, since then\n")
    elif kind == "escape codes":
        path.write_bytes(b"host \x1b[2J\x1b[31mevil, pid 1, since then\n")
    elif kind == "dead owner, then more":
        path.write_text(f"host {host}, pid {_dead_pid()}, since then\n" + "x" * 400)


@pytest.mark.parametrize(
    "kind",
    ["folder", "fifo", "link", "huge", "overflowing pid", "unicode digit pid", "escape codes", "dead owner, then more"],
)
def test_a_broken_or_hostile_lock_file_is_one_line_and_left_alone(tmp_path, no_posix_locks, kind):
    owner = tmp_path / run_lock.OWNER_NAME
    _make(owner, kind)
    # a line as run_lock writes it (the host name made of escape codes) names a run; anything else is no lock of ours
    said = "in use by another run .*" if kind == "escape codes" else "is not a lock file this project writes .*delete "
    with pytest.raises(RecipeError, match=f"{said}{owner}") as err:
        hold_output_dir(_args(tmp_path), warn=lambda m: None)
    message = str(err.value)
    assert "\n" not in message and "\x1b" not in message and len(message) < 1000, message
    # nothing removed that this run cannot judge
    assert owner.is_symlink() or owner.exists()


HOLD = """
import os, signal, sys
from pathlib import Path
from fsdp_recipes.train import run_lock
refused = run_lock.take(Path(sys.argv[1]), print)  # a call, not an assert: python -O would skip it
if refused is not None:
    sys.exit(refused)
print("held", flush=True)
if sys.argv[2] == "kill":
    os.kill(os.getpid(), signal.SIGKILL)
if sys.argv[2] == "raise":
    raise RuntimeError("the run failed")
sys.stdin.readline()
"""


@pytest.mark.parametrize("end", ["exit", "raise", "kill"])
def test_a_run_leaves_no_lock_file_however_it_ends_and_its_folder_is_free_again(tmp_path, end):
    """Held while it runs (another run is refused, naming the holder's pid), nothing left in output_dir after it
    ends, whether it exits, fails or is killed with SIGKILL."""
    out = tmp_path / "run"
    out.mkdir()
    proc = subprocess.Popen(
        [sys.executable, "-c", HOLD, str(out), end],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    assert proc.stdout.readline().strip() == "held", proc.stderr.read()
    if end == "exit":
        with pytest.raises(RecipeError, match=rf"in use by another run \(pid {proc.pid} on {socket.gethostname()}\)"):
            hold_output_dir(_args(out), warn=lambda m: None)
        proc.stdin.write("\n")
        proc.stdin.flush()
    proc.wait(timeout=60)
    assert proc.returncode == {"exit": 0, "raise": 1, "kill": -9}[end]
    assert list(out.iterdir()) == []
    # free again
    hold_output_dir(_args(out), warn=lambda m: None)


def test_a_lock_naming_this_very_process_without_a_start_time_is_stale(tmp_path, no_posix_locks):
    owner = tmp_path / run_lock.OWNER_NAME
    # a recycled pid: not held by us
    owner.write_text(f"host {socket.gethostname()}, pid {os.getpid()}, since then\n")
    hold_output_dir(_args(tmp_path), warn=lambda m: None)
    assert f"pid {os.getpid()}, started {start_time(os.getpid())}," in owner.read_text()


@pytest.fixture(scope="module")
def live():
    """(pid, start time) of a live process of this host that is no run, and the pid of one that has ended."""
    proc = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"], stdin=subprocess.PIPE)
    yield proc.pid, start_time(proc.pid), _dead_pid()
    proc.stdin.close()
    proc.wait(timeout=60)


def _owners(live) -> dict[str, tuple[str, bool]]:
    """Lock lines, by who their owner is, and whether that owner is provably gone."""
    pid, start, dead = live
    host = socket.gethostname()
    return {
        "alive, same start": (f"host {host}, pid {pid}, started {start}, since then\n", False),
        "alive, same start, this SLURM job": (
            f"host {host}, pid {pid}, started {start}, job 4242, since then\n",
            False,
        ),
        "alive, no start recorded, this SLURM job": (f"host {host}, pid {pid}, job 4242, since then\n", False),
        "alive, another start (the pid reused)": (f"host {host}, pid {pid}, started {start + 1}, since then\n", True),
        "reused, this SLURM job": (f"host {host}, pid {pid}, started {start - 1}, job 4242, since then\n", True),
        "dead": (f"host {host}, pid {dead}, started {start}, since then\n", True),
        "dead, this SLURM job": (f"host {host}, pid {dead}, started 1, job 4242, since then\n", True),
        "dead, no start recorded": (f"host {host}, pid {dead}, since then\n", True),
        "another host": (f"host another-node-7, pid {pid}, started {start}, job 4242, since then\n", False),
        "another host, dead pid here": (f"host another-node-7, pid {dead}, started 1, since then\n", False),
    }


OWNERS = list(_owners((1, 1, 2)))


@pytest.mark.parametrize("who", OWNERS)
def test_a_lock_file_is_taken_over_only_when_its_owner_is_provably_gone(
    tmp_path, no_posix_locks, monkeypatch, live, who
):
    """Gone: this host, and the pid is dead or started at another time than the line records. Never by SLURM job
    id: two runs of one job on one host (a step started twice) are both alive."""
    monkeypatch.setenv("SLURM_JOB_ID", "4242")
    line, gone = _owners(live)[who]
    owner = tmp_path / run_lock.OWNER_NAME
    owner.write_text(line)
    if gone:
        hold_output_dir(_args(tmp_path), warn=lambda m: None)
        assert owner.read_text().startswith(f"host {socket.gethostname()}, pid {os.getpid()}, started ")
    else:
        with pytest.raises(RecipeError, match="in use by another run") as err:
            hold_output_dir(_args(tmp_path), warn=lambda m: None)
        assert line.strip() in str(err.value) and owner.read_text() == line


@pytest.mark.parametrize("who", OWNERS)
def test_check_checkpoint_reads_a_lock_file_by_the_same_rule(tmp_path, live, who):
    line, gone = _owners(live)[who]
    (tmp_path / run_lock.OWNER_NAME).write_text(line)
    assert (live_run(tmp_path) is None) == gone


def test_the_start_time_is_field_22_of_the_processes_stat_whatever_its_name():
    """/proc/<pid>/stat's field 22, read past a command name that holds ') ', '(' and spaces."""
    name = "a) b (c 1 2"
    link = Path(tempfile.mkdtemp()) / name
    link.symlink_to(sys.executable)
    proc = subprocess.Popen([str(link), "-c", "import sys; sys.stdin.read()"], stdin=subprocess.PIPE)
    try:
        stat = Path(f"/proc/{proc.pid}/stat").read_text()
        assert f"({name}) " in stat
        assert start_time(proc.pid) == int(stat.split(f"({name}) ", 1)[1].split()[19])
    finally:
        proc.stdin.close()
        proc.wait(timeout=60)
    assert start_time(_dead_pid()) is None and start_time(0) is None and start_time(2**40) is None


def test_a_pid_no_process_can_have_is_stale_not_a_traceback(tmp_path, no_posix_locks):
    owner = tmp_path / run_lock.OWNER_NAME
    # past any pid_max: os.kill overflows
    owner.write_text(f"host {socket.gethostname()}, pid 9999999999, since then\n")
    hold_output_dir(_args(tmp_path), warn=lambda m: None)
    assert f"pid {os.getpid()}," in owner.read_text()


def _holding(folder, how: str = "LOCK_EX") -> subprocess.Popen:
    """A real process holding a kernel lock on ``folder`` (LOCK_EX: as train_fsdp.py's rank 0 does) until its stdin
    closes."""
    code = (
        f"import fcntl, os, sys\nfd = os.open({str(folder)!r}, os.O_RDONLY)\nfcntl.flock(fd, fcntl.{how})\n"
        "print('held', flush=True)\nsys.stdin.read()"
    )
    holder = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert holder.stdout.readline().strip() == "held"
    return holder


@pytest.mark.parametrize("layout", ["checkpoints", "no checkpoint yet"])
def test_check_checkpoint_says_when_a_run_is_training_in_the_folder(tmp_path, capsys, monkeypatch, layout):
    """A real process holding the run's kernel lock, then the lock file of a lockless filesystem: check_checkpoint
    names the run, on the run folder, on one of its checkpoints and on "." inside it (read from /proc/locks and the
    lock file: nothing is taken); not for a shared lock of another tool, a stale lock file of this host, or once the
    run is gone."""
    import json

    from conftest import _checkpoint, cli

    run = tmp_path / "run"
    if layout == "checkpoints":
        _checkpoint(run / "checkpoint-3", marked=False)
    else:
        run.mkdir()
        (run / "run_args.json").write_text("{}")
    targets = [run, run / "checkpoint-3", "."] if layout == "checkpoints" else [run]
    note = f"{run}: a run is training in it now (pid "
    holder = _holding(run)
    try:
        for target in targets:
            monkeypatch.chdir(run / "checkpoint-3" if target == "." else tmp_path)
            cli("check_checkpoint", [str(target)])
            assert f"{note}{holder.pid} on {socket.gethostname()})" in capsys.readouterr().out, target
        cli("check_checkpoint", [str(run), "--json"])
        assert (
            json.loads(capsys.readouterr().out)["training_now"]
            == f"a run is training in it now (pid {holder.pid} on {socket.gethostname()})"
        )
    finally:
        holder.stdin.close()
        holder.wait(timeout=60)
    # another tool's shared lock is no run
    shared = _holding(run, "LOCK_SH")
    try:
        cli("check_checkpoint", [str(run)])
        assert "training in it now" not in capsys.readouterr().out
    finally:
        shared.stdin.close()
        shared.wait(timeout=60)
    (run / run_lock.OWNER_NAME).write_text(
        f"host {socket.gethostname()}, pid {_dead_pid()}, since 2026-01-01 00:00:00\n"
    )
    cli("check_checkpoint", [str(run)])
    # stale: that run died
    assert "training in it now" not in capsys.readouterr().out
    (run / run_lock.OWNER_NAME).write_text("host elsewhere, pid 4242, since 2026-01-01 00:00:00\n")
    cli("check_checkpoint", [str(run)])
    said = capsys.readouterr().out
    assert (
        f"{run}: a run may be training in it (host elsewhere, pid 4242, since 2026-01-01 00:00:00, says its lock file; "
        in said
    )
    assert f"if it is, delete {run / run_lock.OWNER_NAME})" in said
    # not a lock file this project writes
    (run / run_lock.OWNER_NAME).write_text("hello \x1b[31m\n")
    cli("check_checkpoint", [str(run)])
    assert "training in it" not in capsys.readouterr().out


# what a lock file may hold that no run of this project wrote: none of them names a run
NOT_A_LOCK_LINE = {
    "a word": "garbage\n",
    "binary": "\x00\x01\x02\xff",
    "no commas": f"host {socket.gethostname()} pid 1 since then\n",
    "no newline": f"host {socket.gethostname()}, pid 1, since then",
    "json": '{"host": "a", "pid": 1}\n',
    "escape codes": "hello \x1b[31m\n",
    "two lines": "host a, pid 1, since then\nhost b, pid 2, since then\n",
    "too long": "x" * 400,
    "a lone newline": "\n",
}


@pytest.mark.parametrize("kind", NOT_A_LOCK_LINE)
def test_a_lock_file_of_other_content_is_said_to_be_none_of_ours(tmp_path, no_posix_locks, kind):
    """Not "in use by another run": no run is named by such a file. The line says it is no lock file of ours and how
    to go on (delete it if no run trains there); the file is left as it is."""
    owner = tmp_path / run_lock.OWNER_NAME
    owner.write_bytes(NOT_A_LOCK_LINE[kind].encode("latin-1"))
    with pytest.raises(RecipeError) as err:
        hold_output_dir(_args(tmp_path), warn=lambda m: None)
    message = str(err.value)
    assert "\n" not in message and "\x1b" not in message and "in use by another run" not in message, message
    assert f"{owner} is not a lock file this project writes" in message, message
    assert f"if no run trains in {tmp_path}, delete {owner}" in message, message
    assert owner.read_bytes() == NOT_A_LOCK_LINE[kind].encode("latin-1")


def test_a_released_folder_can_be_taken_again_by_the_same_process(tmp_path):
    """flock is per open file: this process's second take of a folder it holds is "in use" until it lets go."""
    try:
        assert run_lock.take(tmp_path, warn=print) is None
        assert "is in use by another run" in run_lock.take(tmp_path, warn=print)
        run_lock.release()
        assert run_lock.take(tmp_path, warn=print) is None
    finally:
        # nothing held into the next test
        run_lock.release()
