"""One run per output_dir: the lock global rank 0 takes before anything is written there.

A POSIX lock (``lockf``) on ``output_dir/.run.lock`` first: the kernel drops it when the process dies, so a killed
run never holds it. Some cluster filesystems have no POSIX locks at all (Lustre mounted without flock, NFS without
lockd): ``lockf`` then fails with ENOLCK or EOPNOTSUPP, which is not "in use". There the lock is a file created
with O_EXCL, ``.run.lock.owner``, holding host and pid; the run removes it when it ends, and a later run judges it
stale when it names this host and a pid that is gone (one warning says which lock is in force). A lock file left
by a run on another host cannot be judged from here: the message names it, to delete once that run is known gone.
"""

from __future__ import annotations

import atexit
import errno
import os
import re
import socket
import stat
import time
from pathlib import Path

from fsdp_recipes.removal import process_alive, remove_lock_file

LOCK_NAME = ".run.lock"
OWNER_NAME = ".run.lock.owner"  # the O_EXCL lock where the filesystem has no POSIX locks
NO_POSIX_LOCKS = {errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOTSUP, errno.ENOSYS, errno.EINVAL}
_held: list[int] = []  # the POSIX lock's file descriptor, open for the life of the process
_mine: set[str] = set()  # the lock files this process created (its own pid in one it did not create is a recycled pid)
POSIX_HINT = " (a run that died holds nothing: its lock went with it"  # closed by the caller's parenthesis
LINE_LIMIT = 300  # bytes of a lock file read: the line this project writes is well under it


def _owner_line() -> str:
    job = f", job {os.environ['SLURM_JOB_ID']}" if os.environ.get("SLURM_JOB_ID", "").isascii() and os.environ.get("SLURM_JOB_ID", "").isdigit() else ""
    return f"host {socket.gethostname()}, pid {os.getpid()}{job}, since {time.strftime('%Y-%m-%d %H:%M:%S')}\n"


def _read_head(path: Path, limit: int = LINE_LIMIT + 1) -> bytes | None:
    """At most ``limit`` bytes of a regular file, never following a link or blocking on a FIFO; None otherwise."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError:
        return None
    try:
        return os.read(fd, limit) if stat.S_ISREG(os.fstat(fd).st_mode) else None
    finally:
        os.close(fd)


def _shown(text: bytes) -> str:
    """A lock file's text for a one-line message: control characters and non-ASCII escaped, at most LINE_LIMIT."""
    line = text[:LINE_LIMIT].decode(errors="replace").strip()
    shown = "".join(c if c.isprintable() and c.isascii() else ascii(c)[1:-1] for c in line) or "an empty lock file"
    return shown if len(shown) <= 160 else shown[:160] + "..."


def take(out: Path, warn) -> str | None:
    """Take ``out`` for this process. Returns None when taken, else who holds it and what to do (one line)."""
    import fcntl

    path = out / LOCK_NAME
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK, 0o644)
    except OSError as err:
        return f"{path} cannot be opened as a lock file ({os.strerror(err.errno)}): remove it if it is not a run's lock"
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        return f"{path} is not a regular file: remove it"
    try:
        fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as err:
        if err.errno not in NO_POSIX_LOCKS:  # EAGAIN/EACCES: another process holds it
            holder = _shown(os.pread(fd, LINE_LIMIT, 0)) if os.fstat(fd).st_size else "another process"
            os.close(fd)
            return f"{holder}){POSIX_HINT}"
        os.close(fd)
        holder = _take_by_file(out)
        if holder is None:
            warn(f"{out} is on a filesystem without POSIX locks ({os.strerror(err.errno)}): one run per output_dir is "
                 f"kept by the lock file {out / OWNER_NAME} instead, removed when this run ends")
        return holder
    os.ftruncate(fd, 0)
    os.pwrite(fd, _owner_line().encode(), 0)
    _held.append(fd)
    return None


def _stale(path: Path, text: bytes) -> bool:
    """A lock file this project wrote on this host whose run is over: its pid is gone (or is this very process,
    which has not taken it), or its SLURM job is this job (a requeued job's earlier attempt has ended)."""
    found = re.fullmatch(rb"host (\S+), pid ([0-9]{1,10})(?:, job ([0-9]{1,20}))?, since [^\n]*\n", text)
    if found is None or found[1].decode(errors="replace") != socket.gethostname():
        return False
    pid, job = int(found[2]), found[3]
    if job is not None and job.decode() == os.environ.get("SLURM_JOB_ID"):
        return True
    return (pid == os.getpid() and str(path) not in _mine) or not process_alive(pid)


def _take_by_file(out: Path) -> str | None:
    path = out / OWNER_NAME
    fix = f"on a filesystem without POSIX locks: if that run is gone, delete {path}"
    for _ in range(2):  # a stale lock is removed once, then taken
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o644)
        except FileExistsError:
            text = _read_head(path)
            if text is None:
                return f"{path} is not a lock file this project writes (a link, a folder, a FIFO or unreadable): remove it"
            if len(text) <= LINE_LIMIT and _stale(path, text):
                remove_lock_file(path, text)  # that run is over: its lock is stale
                continue
            return f"{_shown(text)}; {fix}"
        except OSError as err:
            return f"{path} cannot be created ({os.strerror(err.errno)}); {fix}"
        line = _owner_line().encode()
        os.write(fd, line)
        os.close(fd)
        _mine.add(str(path))
        atexit.register(remove_lock_file, path, line)
        return None
    return f"a lock file that came back at once: {path}; {fix}"
