"""The one place that deletes, replaces or moves paths. Standard library only.

Every tool here writes next to things it did not make: a user's home folder given as an output, another run's
checkpoints, the model a run fine-tunes. So nothing is removed on a name or a guess. A folder is removed only when

- the caller names an exact, documented shape (``shape``) and the folder has it: a model folder holding only the
  files a merge writes, a checkpoint holding only the files a training checkpoint holds. Anything else inside it
  (a notes.txt, a data/ folder, a .ssh/) and it is refused, whoever made it; or
- without a shape, this project made it: ``make_folder`` writes a marker file into it (``MARKER``: tool, purpose,
  host, process, time, and the folder's device and inode), and ``remove`` asks for the same purpose back. The
  marker counts only in the folder it was written into: a copy (``cp -a``) or a marker file copied elsewhere has
  another inode, and proves nothing.

A symlink is never followed into: a link is refused, not its target removed. (A path the user names may be resolved
before it gets here: the merge's output is its real path, so `--overwrite` through a link replaces the model folder
the link points to, as the user asked.) Everything refused raises
``RefusedRemoval`` with one line naming the path and what it holds. ``tests/unit/shared/test_removal.py`` fails when any
other
module of the package, tools/, bench/ or train_fsdp.py calls rmtree, unlink, remove, rename, replace or rmdir.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import socket
import stat
import time
from collections.abc import Callable
from pathlib import Path

from fsdp_recipes.errors import RefusedRemoval, one_line

MARKER = ".made-by-fsdp-recipes"


def make_folder(path: str | os.PathLike, purpose: str, exist_ok: bool = False) -> Path:
    """Create ``path`` (parents too) and mark it as made for ``purpose``; an existing folder is marked only when
    ``exist_ok`` and it is empty or already ours for that purpose."""
    path = Path(path)
    if path.is_symlink():
        raise RefusedRemoval(
            f"{path} is a symbolic link: refusing to write through it; remove the link or choose another path"
        )
    if path.exists() and not exist_ok:
        raise RefusedRemoval(f"{path} exists: refusing to take it over; move it away or choose another path")
    if path.exists() and any(p.name != MARKER for p in path.iterdir()) and not is_ours(path, purpose):
        raise RefusedRemoval(f"{path} exists and holds {contents(path)}: refusing to take it over; move it away")
    try:
        path.mkdir(parents=True, exist_ok=True)
    # a stop's exception (SIGTERM, Ctrl-C) raised just after the mkdir: the folder is still marked, ours
    finally:
        if path.is_dir() and not path.is_symlink():
            _write_marker(path, purpose)
    return path


def identity(path: str | os.PathLike) -> tuple[int, int] | None:
    """(device, inode) of the entry at ``path`` itself, a link not followed (None: nothing there). What tells the folder
    we made from one put in its place under the same name: every ownership check here compares it."""
    try:
        where = os.lstat(path)
    except OSError:
        return None
    return where.st_dev, where.st_ino


def fingerprint(folder: str | os.PathLike) -> list | None:
    """identity() of a result folder, which ships without a marker, made hard to mistake: a folder made after ours was
    deleted gets our freed inode number (ext4 hands it to the next mkdir), so the folder's change time (moved by any
    entry added, removed or renamed, a chmod, a touch) and ``entries`` go with it. A list, as it round-trips through
    JSON (None: nothing there, or not a folder we can list)."""
    try:
        where = os.lstat(folder)
    except OSError:
        return None
    listed = entries(folder)
    return None if listed is None else [where.st_dev, where.st_ino, where.st_ctime_ns, listed]


def entries(folder: str | os.PathLike) -> list | None:
    """Each entry's name, size, inode, modification and change time: a write changes the times, and a program can set
    the modification time back but not the change time (the clock moves it). A rename of the folder keeps them all."""
    try:
        return sorted(
            [e.name, (st := e.stat(follow_symlinks=False)).st_size, st.st_ino, st.st_mtime_ns, st.st_ctime_ns]
            for e in os.scandir(folder)
            if e.name != MARKER
        )
    except OSError:
        return None


def _write_marker(path: Path, purpose: str) -> None:
    # raises where identity() would say None: the folder was just made
    where = os.lstat(path)
    record = {
        "tool": "fsdp-recipes",
        "purpose": purpose,
        "host": socket.gethostname(),
        "pid": os.getpid(),
        "time": time.strftime("%Y-%m-%dT%H:%M:%S"),
        "device": where.st_dev,
        "inode": where.st_ino,
    }
    (path / MARKER).write_text(json.dumps(record) + "\n")


def remark(path: str | os.PathLike, purpose: str, new_purpose: str) -> None:
    """A folder of ours changes purpose (a merge's staging becomes an export's staging)."""
    if not is_ours(path, purpose):
        raise RefusedRemoval(f"{path} is not a folder this project made ({purpose}): refusing to touch it")
    _write_marker(Path(path), new_purpose)


def marker(path: str | os.PathLike) -> dict | None:
    """The marker ``make_folder`` wrote into the real folder ``path`` (None: not ours, or not a real folder)."""
    path = Path(path)
    if path.is_symlink() or not path.is_dir():
        return None
    file = path / MARKER
    try:
        if file.is_symlink() or not file.is_file() or file.stat().st_size > 4096:
            return None
        # opened without blocking and read only as a regular file: a FIFO swapped in since the checks above
        # cannot hang it
        fd = os.open(file, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0))
        with os.fdopen(fd, "rb") as f:
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                return None
            record = json.loads(f.read(4097))
    except (OSError, ValueError):
        return None
    if not isinstance(record, dict) or record.get("tool") != "fsdp-recipes":
        return None
    return record if (record.get("device"), record.get("inode")) == identity(path) else None


def is_ours(path: str | os.PathLike, purpose: str) -> bool:
    record = marker(path)
    return record is not None and record.get("purpose") == purpose


def unmark(path: str | os.PathLike, purpose: str) -> None:
    """Take the marker out of a folder of ours that becomes a result (a merged model folder ships without it)."""
    if not is_ours(path, purpose):
        raise RefusedRemoval(f"{path} is not a folder this project made ({purpose}): refusing to touch it")
    (Path(path) / MARKER).unlink()


def reclaim(path: str | os.PathLike, purpose: str, made: tuple[int, int]) -> bool:
    """Mark ``path`` again for ``purpose``: a folder this process made and unmarked to become a result, stopped before
    it
    was renamed into place. Only while it is still that very folder (``made``: its identity when made)."""
    path = Path(path)
    if path.is_symlink() or not path.is_dir() or identity(path) != tuple(made):
        return False
    _write_marker(path, purpose)
    return True


def contents(path: Path, limit: int = 3) -> str:
    try:
        names = sorted(p.name + ("/" if p.is_dir() and not p.is_symlink() else "") for p in path.iterdir())
        names = [one_line(n) for n in names]
    except OSError as err:
        return f"unreadable contents ({err.strerror})"
    if not names:
        return "nothing"
    return ", ".join(names[:limit]) + (f" and {len(names) - limit} more" if len(names) > limit else "")


def remove(
    path: str | os.PathLike, purpose: str, shape: Callable[[Path], bool] | None = None, missing_ok: bool = False
) -> None:
    """Delete the folder ``path``: when ``shape`` (an exact-shape predicate) is given, only if it accepts the folder;
    without one, only if this project made it for ``purpose`` (its marker). Anything else: RefusedRemoval naming it
    and what it holds."""
    path = Path(path)
    if not path.exists() and not path.is_symlink():
        if missing_ok:
            return
        raise RefusedRemoval(f"{path} does not exist")
    if path.is_symlink() or not path.is_dir():
        raise RefusedRemoval(
            f"{path} is {'a symbolic link' if path.is_symlink() else 'not a folder'}: refusing to "
            f"remove it ({purpose}); move it away yourself"
        )
    if not (shape(path) if shape is not None else is_ours(path, purpose)):
        raise RefusedRemoval(
            f"{path} is not a folder this project made ({purpose}; it holds {contents(path)}): refusing to "
            "remove it; move it away yourself, or choose another path"
        )
    _refuse_mount_points(path)
    shutil.rmtree(path)


def mount_points(path: str | os.PathLike) -> list[str]:
    """Mount points at or under ``path``, from /proc/self/mountinfo ([] where there is none). A bind mount of another
    folder looks like any folder (same device, no link), and rmtree would empty it: someone else's checkpoint, a
    dataset, a whole filesystem."""
    try:
        with open("/proc/self/mountinfo", "rb") as f:
            text = f.read(1 << 24).decode("utf-8", "replace")
    except OSError:
        return []
    top = os.path.realpath(path)
    points = (
        re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), line.split(" ")[4])
        for line in text.splitlines()
        if line.count(" ") >= 5
    )
    return sorted(p for p in points if p == top or p.startswith(top.rstrip("/") + "/"))


def _refuse_mount_points(path: Path) -> None:
    if found := mount_points(path):
        raise RefusedRemoval(
            f"{path} is or holds a mount point ({one_line(found[0])}): refusing to remove it, which would "
            "empty what is mounted there; unmount it, or move the folder away yourself"
        )


def make_room(path: Path, purpose: str, shape: Callable[[Path], bool], warn, published: Callable[[Path], bool]) -> Path:
    """Free ``path`` for a finished result (the final model, the adapter): an earlier result there (``shape``), still as
    the export that ``published`` it left it, is removed; anything else (a file put there while the run trained, a
    folder made again or changed since), or what is left of an earlier result that would not go, is moved to the next
    free ``path.kept-N``, said in one warning. Nothing of the user's is deleted, and the result still lands at
    ``path``, where everything that reads it looks."""
    if not (path.exists() or path.is_symlink()):
        return path
    if path.is_symlink() or not path.is_dir() or not shape(path):
        held = "a link" if path.is_symlink() else "a file" if not path.is_dir() else contents(path)
        why = f"held {held}, which the export does not write"
    elif not published(path):
        why = (
            "holds only files an export writes, but is not the folder an export of this run published, as it left it "
            "(a file written, added or removed, its permissions changed since, or the folder made again or copied)"
        )
    else:
        try:
            # checked again just before
            remove(path, purpose, shape=lambda p: shape(p) and published(p))
            return path
        # a file held open over NFS, an immutable file: partly removed
        except (OSError, RefusedRemoval) as err:
            why = f"could not be removed ({err.strerror if isinstance(err, OSError) else err}), what is left of it"
    try:
        aside = keep_aside(path, path)
    # a mount point (EBUSY), a read-only folder: the result stays in its staging folder
    except OSError as err:
        raise RefusedRemoval(
            f"{path} {why}, and cannot be moved aside ({err.strerror}): move it away yourself; the "
            "checkpoints are kept, and --resume_from_checkpoint true writes the final model again"
        ) from None
    warn(f"{path} {why}: moved to {aside.name} (nothing deleted); this export is in {path}")
    return path


def keep_aside(path: Path, name: Path) -> Path:
    """Move ``path`` to the first free ``name.kept-N`` (N from 2) beside ``name``, and return where it went: what is the
    user's stays whole and in sight. OSError where it cannot be moved (a mount point, a read-only folder)."""
    for n in range(2, 1 << 20):
        try:
            return move(path, name.with_name(f"{name.name}.kept-{n}"))
        # that name is taken
        except RefusedRemoval:
            continue
    raise RefusedRemoval(f"{path}: no free {name.name}.kept-N name to move it to: move it away yourself")


def remove_inside(folder: str | os.PathLike, name: str, purpose: str) -> None:
    """Delete ``folder/name`` (a file or a folder, whatever it holds) inside a folder this project made for
    ``purpose``: what a tool writes into its own work folder is its own."""
    path = Path(folder) / name
    if not is_ours(folder, purpose) or "/" in name or name in ("", ".", "..", MARKER):
        raise RefusedRemoval(f"{path}: not inside a folder this project made ({purpose}): refusing to delete it")
    if path.is_dir() and not path.is_symlink():
        _refuse_mount_points(path)
        shutil.rmtree(path)
    elif path.exists() or path.is_symlink():
        path.unlink()


def remove_file(folder: str | os.PathLike, name: str, purpose: str) -> None:
    """Delete the file ``name`` directly inside a folder this project made for ``purpose``."""
    if not is_ours(folder, purpose) or "/" in name or name in ("", ".", "..", MARKER):
        raise RefusedRemoval(
            f"{Path(folder) / name}: not a file of a folder this project made ({purpose}): refusing to delete it"
        )
    (Path(folder) / name).unlink()


def process_alive(pid: int) -> bool:
    """Whether process ``pid`` exists on this host: what decides that a lock or staging folder it left is stale."""
    # no process's number (kill(0, ...) and kill(-n, ...) would ask about process groups)
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    # gone, or a number no pid can be
    except (ProcessLookupError, OverflowError):
        return False
    # another user's process: alive
    except PermissionError:
        return True
    return True


def remove_lock_file(path: str | os.PathLike, content: bytes) -> bool:
    """Delete the lock file ``path`` only while it holds exactly ``content``: the line this process wrote into it, or
    a dead owner's line its caller has just read. Another run's lock, a link or a folder is never removed."""
    path = Path(path)
    try:
        if path.is_symlink() or not path.is_file():
            return False
        with open(path, "rb") as f:
            if f.read(len(content) + 1) != content:
                return False
        path.unlink()
    except OSError:
        return False
    return True


def move(src: str | os.PathLike, dst: str | os.PathLike) -> Path:
    """Rename ``src`` to ``dst`` on one filesystem; never over an existing path (a file or a folder)."""
    src, dst = Path(src), Path(dst)
    if dst.exists() or dst.is_symlink():
        raise RefusedRemoval(f"{dst} exists: refusing to move {src.name} over it")
    os.rename(src, dst)
    return dst


def replace_file(
    src: str | os.PathLike, dst: str | os.PathLike, purpose: str, shape: Callable[[Path], bool] | None = None
) -> None:
    """Move a finished file out of a folder this project made for ``purpose`` (or of the exact ``shape``) onto
    ``dst`` (a file of the same name is replaced, as an export replaces an earlier export's; a folder or link there
    is refused)."""
    src, dst = Path(src), Path(dst)
    if not (shape(src.parent) if shape is not None else is_ours(src.parent, purpose)):
        raise RefusedRemoval(f"{src} is not in a folder this project made ({purpose}): refusing to move it")
    if dst.is_symlink() or dst.is_dir():
        raise RefusedRemoval(
            f"{dst} is {'a symbolic link' if dst.is_symlink() else 'a folder'}: refusing to replace it with {src.name}"
        )
    os.replace(src, dst)
