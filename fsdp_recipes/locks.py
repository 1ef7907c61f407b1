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

OWNER_NAME = ".run.lock.owner"  # the O_EXCL lock where the filesystem has no folder locks
PROC_LOCKS_LIMIT = 1 << 20  # bytes of /proc/locks read to name a holder
LINE_LIMIT = 300  # bytes of a lock file read: the line this project writes is well under it
OWNER_LINE = re.compile(
    rb"host (\S+), pid ([0-9]{1,10})(?:, job ([0-9]{1,20}))?, since [^\n]*\n"
)  # what run_lock writes


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
        fields = line.split()  # "1: FLOCK  ADVISORY  WRITE 1234 08:01:5678 0 EOF": a run's lock is exclusive (WRITE)
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
        return None  # none, or not a lock file this project writes
    if owner[1].decode(errors="replace") == socket.gethostname() and not _alive(int(owner[2])):
        return None  # a run of this host that died: its lock file is stale (the next run removes it)
    return (
        f"a run may be training in it ({shown(text)}, says its lock file; this host cannot tell whether that run "
        f"is gone: if it is, delete {folder / OWNER_NAME})"
    )


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except (ProcessLookupError, OverflowError):
        return False
    except PermissionError:  # another user's process
        return True
    return True
