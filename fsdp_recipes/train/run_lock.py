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
import socket
import time
from pathlib import Path

from fsdp_recipes.removal import remove_lock_file

LOCK_NAME = ".run.lock"
OWNER_NAME = ".run.lock.owner"  # the O_EXCL lock where the filesystem has no POSIX locks
NO_POSIX_LOCKS = {errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOTSUP, errno.ENOSYS, errno.EINVAL}
_held: list[int] = []  # the POSIX lock's file descriptor, open for the life of the process


def _owner_line() -> str:
    return f"host {socket.gethostname()}, pid {os.getpid()}, since {time.strftime('%Y-%m-%d %H:%M:%S')}\n"


def take(out: Path, warn) -> str | None:
    """Take ``out`` for this process. Returns None when taken, else who holds it (one line)."""
    import fcntl

    fd = os.open(out / LOCK_NAME, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as err:
        if err.errno not in NO_POSIX_LOCKS:  # EAGAIN/EACCES: another process holds it
            holder = os.pread(fd, 300, 0).decode(errors="replace").strip() or "another process"
            os.close(fd)
            return holder
        os.close(fd)
        warn(f"{out} is on a filesystem without POSIX locks ({os.strerror(err.errno)}): one run per output_dir is "
             f"kept by the lock file {out / OWNER_NAME} instead, removed when this run ends")
        return _take_by_file(out)
    os.ftruncate(fd, 0)
    os.pwrite(fd, _owner_line().encode(), 0)
    _held.append(fd)
    return None


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process: alive
        return True
    return True


def _take_by_file(out: Path) -> str | None:
    path = out / OWNER_NAME
    for _ in range(2):  # a stale lock is removed once, then taken
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        except FileExistsError:
            text = path.read_bytes()[:300] if path.is_file() and not path.is_symlink() else b""
            words = text.decode(errors="replace").replace(",", " ").split()
            host = words[words.index("host") + 1] if "host" in words[:-1] else None
            pid = words[words.index("pid") + 1] if "pid" in words[:-1] else ""
            if host == socket.gethostname() and pid.isdigit() and not _alive(int(pid)):
                remove_lock_file(path, text)  # that run died on this host: its lock is stale
                continue
            where = text.decode(errors="replace").strip() or "a lock file without an owner"
            return f"{where}; on a filesystem without POSIX locks: if that run is gone, delete {path}"
        line = _owner_line().encode()
        os.write(fd, line)
        os.close(fd)
        atexit.register(remove_lock_file, path, line)
        return None
    return f"a lock file that came back at once: {path}"
