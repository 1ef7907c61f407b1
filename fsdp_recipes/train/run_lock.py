"""One run per output_dir: the lock global rank 0 takes before anything is written there.

A kernel lock (``flock``) on the output_dir folder itself first: no file is made, so none is left behind however
the run ends, and the kernel drops the lock when the process dies, so a killed run never holds it (its holder is
named from /proc/locks). Some cluster filesystems have no such lock on a folder (Lustre mounted without flock; NFS,
which takes flock as a POSIX lock that a folder opened read-only cannot hold): ``flock`` then fails with ENOLCK,
EOPNOTSUPP or EBADF, which is not "in use". There the lock is a file created with O_EXCL, ``.run.lock.owner``,
holding host, pid and the pid's start time; the run removes it when it ends, and a later run judges it stale only
when its owner is provably gone: it names this host, and its pid is gone or now belongs to a process that started
at another time (one warning says which lock is in force). Not by SLURM job id: two runs of one job (srun twice, a
step started again) are both alive. A lock file left by a run on another host cannot be judged from here: the
message names it, to delete once that run is known gone.
"""

from __future__ import annotations

import atexit
import errno
import os
import socket
import time
from pathlib import Path

from fsdp_recipes.locks import (
    LINE_LIMIT,
    OWNER_LINE,
    OWNER_NAME,
    flock_holder,
    owner_gone,
    read_head,
    shown,
    start_time,
)
from fsdp_recipes.removal import remove_lock_file

NO_FOLDER_LOCKS = {errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOTSUP, errno.ENOSYS, errno.EINVAL, errno.EBADF}
# the locked folder's file descriptor, open until the process ends (or release())
_held: list[int] = []
# the lock files this process created (its own pid in one it did not create is a recycled pid)
_mine: set[str] = set()
# closed by the caller's parenthesis
KERNEL_HINT = " (a run that died holds nothing: its lock went with it"


def _owner_line() -> str:
    job = (
        f", job {os.environ['SLURM_JOB_ID']}"
        if os.environ.get("SLURM_JOB_ID", "").isascii() and os.environ.get("SLURM_JOB_ID", "").isdigit()
        else ""
    )
    started = f", started {start}" if (start := start_time(os.getpid())) is not None else ""
    return f"host {socket.gethostname()}, pid {os.getpid()}{started}{job}, since {time.strftime('%Y-%m-%d %H:%M:%S')}\n"


def in_use(out: Path, holder: str) -> str:
    return (
        f"output_dir {str(out)!r} is in use by another run ({holder}): wait for it to end, or choose another "
        "--output_dir"
    )


def not_ours(out: Path, path: Path, what: str) -> str:
    """A lock file no run of this project wrote: it names no run, so none is said to hold the folder."""
    return (
        f"{path} is not a lock file this project writes ({what}), so it cannot tell whether a run trains in {out}: "
        f"if no run trains in {out}, delete {path} and start again; else choose another --output_dir"
    )


def take(out: Path, warn) -> str | None:
    """Take ``out`` for this process. Returns None when taken, else why not and what to do (one line)."""
    import fcntl

    try:
        fd = os.open(out, os.O_RDONLY | os.O_DIRECTORY)
    except OSError as err:
        return f"{out} cannot be opened as a folder ({os.strerror(err.errno)}): give a real folder as --output_dir"
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as err:
        # EWOULDBLOCK: another process holds it
        if err.errno not in NO_FOLDER_LOCKS:
            holder = flock_holder(os.fstat(fd)) or "another process"
            os.close(fd)
            return in_use(out, f"{holder}){KERNEL_HINT}")
        os.close(fd)
        holder = _take_by_file(out)
        if holder is None:
            warn(
                f"{out} is on a filesystem without folder locks ({os.strerror(err.errno)}): one run per output_dir is "
                f"kept by the lock file {out / OWNER_NAME} instead, removed when this run ends"
            )
        return holder
    _held.append(fd)
    return None


def release() -> None:
    """Let go of every folder this process took, as the kernel does when it ends: a process that trains several
    runs in turn (tests/helpers' sequences) may then take one of them again. A lock file stays until exit."""
    while _held:
        os.close(_held.pop())


def _stale(path: Path, text: bytes) -> bool:
    """A lock file this project wrote whose run is provably over (locks.owner_gone: this host, and its pid gone or
    started at another time), or, in a line without a start time, this very process's pid in a file it did not
    create (a recycled pid)."""
    found = OWNER_LINE.fullmatch(text)
    if found is None:
        return False
    legacy_self = (
        found[3] is None
        and found[1].decode(errors="replace") == socket.gethostname()
        and int(found[2]) == os.getpid()
        and str(path) not in _mine
    )
    return owner_gone(found) or legacy_self


def _take_by_file(out: Path) -> str | None:
    path = out / OWNER_NAME
    fix = f"on a filesystem without POSIX locks: if that run is gone, delete {path}"
    # a stale lock is removed once, then taken
    for _ in range(2):
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o644)
        except FileExistsError:
            text = read_head(path)
            if text is None:
                return not_ours(out, path, "a link, a folder, a FIFO or unreadable")
            # empty: a run may be between creating the file and writing its line
            if text and (len(text) > LINE_LIMIT or OWNER_LINE.fullmatch(text) is None):
                return not_ours(out, path, f"it reads: {shown(text)}")
            if _stale(path, text):
                # that run is over: its lock is stale
                remove_lock_file(path, text)
                continue
            return in_use(out, f"{shown(text)}; {fix}")
        except OSError as err:
            return in_use(out, f"{path} cannot be created ({os.strerror(err.errno)}); {fix}")
        line = _owner_line().encode()
        os.write(fd, line)
        os.close(fd)
        _mine.add(str(path))
        atexit.register(remove_lock_file, path, line)
        return None
    return in_use(out, f"a lock file that came back at once: {path}; {fix}")
