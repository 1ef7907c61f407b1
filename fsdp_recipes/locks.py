"""Who holds a run's output_dir, read without taking anything: the kernel lock a training run keeps on the folder
(named from /proc/locks, this host only), or the lock file it writes where the filesystem has no folder locks.
train/run_lock.py takes the lock; tools/check_checkpoint.py only asks, so that "INCOMPLETE" of a checkpoint a live
run is still writing is not read as damage. Probing by taking the lock for an instant would make a run starting
in that instant refuse its own folder: this never does.
"""

from __future__ import annotations

import os
import re
import socket
import stat
from pathlib import Path

from fsdp_recipes.errors import one_line

# the O_EXCL lock where the filesystem has no folder locks
OWNER_NAME = ".run.lock.owner"
# bytes of /proc/locks read to name a holder
PROC_LOCKS_LIMIT = 1 << 20
# bytes of a lock file read: the line this project writes is well under it
LINE_LIMIT = 300
# what run_lock writes: host, pid, the pid's start time (/proc/<pid>/stat, field 22; absent where there is no /proc and
# in the lines of earlier versions), the SLURM job (for people: a job's id says nothing of whether its process lives)
OWNER_LINE = re.compile(
    rb"host (\S+), pid ([0-9]{1,10})(?:, started ([0-9]{1,20}))?(?:, job ([0-9]{1,20}))?, since [^\n]*\n"
)
# bytes of /proc/<pid>/stat read: its 52 numbers and a command name of at most 64 bytes
STAT_LIMIT = 4096


def read_head(path: Path, limit: int = LINE_LIMIT + 1) -> bytes | None:
    """At most ``limit`` bytes of a regular file, never following a link or blocking on a FIFO; None otherwise."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError:
        return None
    try:
        return os.read(fd, limit) if stat.S_ISREG(os.fstat(fd).st_mode) else None
    finally:
        os.close(fd)


def shown(text: bytes) -> str:
    """A lock file's text for a one-line message: control characters and non-ASCII escaped, at most LINE_LIMIT."""
    line = text[:LINE_LIMIT].decode(errors="replace").strip()
    printable = one_line(line) or "an empty lock file"
    return printable if len(printable) <= 160 else printable[:160] + "..."


def flock_holder(folder: os.stat_result) -> str | None:
    """ "pid N on HOST" holding a kernel lock on the folder, from /proc/locks (this host's kernel); None if none is
    listed (or /proc/locks cannot be read)."""
    key = f"{os.major(folder.st_dev):02x}:{os.minor(folder.st_dev):02x}:{folder.st_ino}".encode()
    try:
        with open("/proc/locks", "rb") as f:
            table = f.read(PROC_LOCKS_LIMIT)
    except OSError:
        return None
    for line in table.splitlines():
        # "1: FLOCK  ADVISORY  WRITE 1234 08:01:5678 0 EOF": a run's lock is exclusive (WRITE)
        fields = line.split()
        if b"FLOCK" in fields and b"WRITE" in fields and key in fields and (pids := [f for f in fields if f.isdigit()]):
            return f"pid {int(pids[0])} on {socket.gethostname()}"
    return None


def live_run(folder: str | os.PathLike) -> str | None:
    """Whether a run trains in ``folder`` now, as far as this host can tell (the end of one line), or None."""
    folder = Path(folder)
    try:
        held = flock_holder(os.stat(folder))
    except OSError:
        return None
    if held:
        return f"a run is training in it now ({held})"
    text = read_head(folder / OWNER_NAME)
    owner = OWNER_LINE.fullmatch(text) if text else None
    if owner is None:
        # none, or not a lock file this project writes
        return None
    if owner_gone(owner):
        # a run of this host that died: its lock file is stale (the next run removes it)
        return None
    return (
        f"a run may be training in it ({shown(text)}, says its lock file; this host cannot tell whether that run "
        f"is gone: if it is, delete {folder / OWNER_NAME})"
    )


def start_time(pid: int) -> int | None:
    """When process ``pid`` started, in clock ticks since boot (/proc/<pid>/stat, field 22): with the pid, what names
    one process for the life of the host (a pid alone is reused); None when it is gone or this host has no /proc."""
    text = read_head(Path(f"/proc/{pid}/stat"), STAT_LIMIT) if pid > 0 else None
    # the command name, in parentheses, may hold anything
    fields = text.rpartition(b")")[2].split() if text else []
    # field 22 is the 20th after it
    return int(fields[19]) if len(fields) > 19 and fields[19].isdigit() else None


def owner_gone(owner: re.Match) -> bool:
    """Whether the run an OWNER_LINE names is provably over: it names this host, and its pid is gone, or is held by
    another process now (a start time other than the one the line records). A run on another host, or a live pid
    whose start cannot be compared, is not gone."""
    if owner[1].decode(errors="replace") != socket.gethostname():
        return False
    pid = int(owner[2])
    if not _alive(pid):
        return True
    return owner[3] is not None and start_time(pid) not in (None, int(owner[3]))


def _alive(pid: int) -> bool:
    # no process's number (kill(0, ...) and kill(-n, ...) would ask about process groups)
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except (ProcessLookupError, OverflowError):
        return False
    # another user's process
    except PermissionError:
        return True
    return True
