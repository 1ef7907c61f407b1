"""Large files written past the page cache (O_DIRECT) where the filesystem takes it, through it where not.

Why: a write through the page cache costs the writing process a kernel copy of every byte into cache pages it
allocates. On the 2-core development VM that copy runs at ~330 MB/s of CPU: 1 GiB written took 3.2 s of CPU
buffered and 0.09 s with O_DIRECT (the device reads our buffer itself), and a 1.7 GB DCP shard 4.2 s of CPU against
0.8 s (`python bench/direct_writes.py`). A checkpoint written in the background takes that CPU from training; one
written in the foreground is training's stall. A checkpoint also has no reason to evict the dataset from the cache.

O_DIRECT wants the file offset, the length and the buffer's address aligned to the device's logical block (512 or
4096 bytes). :class:`DirectFile` gathers what is written into a page-aligned buffer and writes it out in whole
aligned chunks; the last partial block goes through an ordinary descriptor at close. Two buffers take turns: a
thread writes the full one while the caller fills the other, so the device is never idle while the caller copies
(a single buffer wrote 3 GB out of the page cache in 2.3-3.2 s here, two in 1.4-1.7 s; `dd oflag=direct` 2.7-3.4 s).
The file's bytes are exactly what an ordinary write makes (tested). Where ``open(O_DIRECT)`` or an aligned write fails
with EINVAL (tmpfs before
Linux 6.6, some FUSE and network mounts; macOS has no O_DIRECT) the same buffer goes out through the page cache, and
``DirectFile.page_cache_why`` says why.

The writer thread, the waits a signal may cut short and the files and folders synced before a rename into place
keep one rule: no descriptor, lock or count that a Ctrl-C between two bytecodes can leave behind
(tests/unit/shared/test_direct_writes.py interrupts every line).
"""

from __future__ import annotations

import _thread
import errno
import fcntl
import io
import mmap
import os
import queue
import sys

import numpy as np

BLOCK = 4096  # a multiple of every logical block size O_DIRECT asks for (512 or 4096)
CHUNK = 32 << 20  # bytes per write: large enough that the device streams, small enough to hold twice per open file
GIL_FREE_COPY = 64 << 10  # bytes from which a write's copy into the buffer lets other threads run (see write)
O_DIRECT = getattr(os, "O_DIRECT", 0)  # 0 where the platform has none (macOS)


class _Done:
    """One piece of the writer thread's work (a chunk, or the thread's whole life): ``done`` once it ended, with its
    ``error``; ``lock``, held until then, lets a waiter sleep. Flags and a C lock only: an exception a signal raises
    in the waiter between two bytecodes (Ctrl-C) can leave no Python-level lock held, no count out of step, and no
    waiter asleep for good (see _until)."""

    __slots__ = ("file", "data", "offset", "done", "error", "lock", "pid")

    def __init__(self, file=None, data=None, offset=0):
        self.file, self.data, self.offset, self.done, self.error = file, data, offset, False, None
        self.pid = os.getpid()  # the process whose writer thread ends it: a forked child has no such thread
        self.lock = _thread.allocate_lock()
        self.lock.acquire()

    def end(self, error: BaseException | None = None) -> None:
        self.error = error
        self.done = True
        self.lock.release()


def _until(done: _Done) -> None:
    """Sleep until ``done`` has ended. The flag is the truth and the lock only a wake-up: a wake-up consumed by a wait a
    signal cut short costs the next wait one timeout, never a wait for good. While the interpreter finalizes, the
    writer thread may never run again: that is an error, not a wait."""
    while not done.done:
        if sys.is_finalizing():
            raise RuntimeError("the interpreter is exiting while a write of this file is under way: it is incomplete")
        if done.pid != os.getpid():
            raise RuntimeError(
                "a process forked while a write of this file was under way: the child has no writer thread; "
                "finish files before forking"
            )
        done.lock.acquire(timeout=0.05)


def _writer(jobs: queue.SimpleQueue, life: _Done) -> None:
    """The writer thread: each chunk handed to it, in order, until None. It holds a file only while writing for it
    (a file dropped unclosed is collected, and closed, when the last of its chunks is written)."""
    try:
        while (job := jobs.get()) is not None:
            try:
                job.file._write_at(job.data, job.offset)
            except BaseException as err:
                job.end(err)
            else:
                job.end()
            finally:
                job.file = job.data = None  # may run the file's finalizer (close) here: the job has ended first
            del job
    finally:
        life.end()


class _Descriptor(io.FileIO):
    """The descriptor's owner (a subclass, so that a test can make its close fail)."""


class DirectFile(io.RawIOBase):
    """A write-only file object (``write``, ``tell``, ``fileno``, ``close``) for one new file, written with O_DIRECT
    where possible. ``sync``: fsync before close returns. ``abort()`` instead of close: the descriptors close, and
    what was not written yet is dropped (after an error: the file is incomplete and whoever made it knows).
    ``page_cache_why``: None if every whole block went out with O_DIRECT, else why the page cache wrote some.
    A write that failed, or that an exception (Ctrl-C) cut short anywhere, fails every later write and close (the
    file may have a gap where it was meant to be: never a file of the right size that looks whole)."""

    def __init__(self, path, *, sync: bool = True):
        super().__init__()
        self.path, self.sync = os.fspath(path), sync
        self.fd, self.direct, self._owner = -1, False, None
        # anonymous mmaps: page-aligned, and a page is memory only once touched; the second buffer is made when the
        # first is handed to the writer (a small file reserves one)
        self._buffers, self._views, self._arrays = [], [], []
        self._turn = -1  # the buffer being filled; the other may be in the writer's hands
        self._next_buffer()
        self._jobs: queue.SimpleQueue | None = None  # the writer thread's work, once it runs (see _start_writer)
        self._writer_life: _Done | None = None
        self._writer_ident: int | None = None
        self._pending: _Done | None = None  # the write of the other buffer, until it is waited for
        self._failed: BaseException | None = None  # the write that failed: every later write and close fails too
        self._unfinished = False  # a write or copy_from began and did not return: its bytes are unknown
        self._closing = False  # a close or abort began: no more writes (the writer may have been told to end)
        self._close_cut = (
            False  # a close began and neither returned nor raised an error (Ctrl-C): a later close says so
        )
        self._filled = 0  # bytes in the buffer
        self._written = 0  # bytes of the file written or being written (a multiple of BLOCK while direct)
        self.page_cache_why = None if O_DIRECT else "this platform has no O_DIRECT"
        # A C object owns the descriptor from the moment it exists: a number os.open returned could be left open and
        # owned by nothing by a signal's exception before it was stored (the review leaked 10,923 in ~46k Ctrl-Cs).
        # FileIO has no O_DIRECT mode: it is set as _buffered clears it, and refused (EINVAL) where open refuses it.
        self._owner = _Descriptor(self.path, "w")
        self.fd = self._owner.fileno()
        if O_DIRECT:
            try:
                fcntl.fcntl(self.fd, fcntl.F_SETFL, fcntl.fcntl(self.fd, fcntl.F_GETFL) | O_DIRECT)
                self.direct = True
            except OSError as e:
                if e.errno != errno.EINVAL:
                    raise
                self.page_cache_why = "the filesystem refused O_DIRECT"

    @property
    def failure(self) -> BaseException | None:
        """The write that failed (every later call fails because of it), or None."""
        return self._failed

    def writable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._written + self._filled

    def fileno(self) -> int:
        return self.fd

    def _next_buffer(self) -> None:
        self._turn = (self._turn + 1) % 2
        if self._turn == len(self._buffers):
            self._buffers.append(mmap.mmap(-1, CHUNK))
            self._views.append(memoryview(self._buffers[-1]))
            self._arrays.append(
                np.frombuffer(self._buffers[-1], dtype=np.uint8)
            )  # the same bytes, for copies that release the GIL
        self._view, self._array, self._filled = self._views[self._turn], self._arrays[self._turn], 0

    def _check_open(self) -> None:
        if self.closed or self._closing:
            raise ValueError(f"{self.path}: write to a closed file")
        self._check_whole()

    def _check_whole(self) -> None:
        if self._failed is not None:
            raise OSError(
                getattr(self._failed, "errno", None) or errno.EIO,
                f"an earlier write of this file failed ({self._failed}): it has a gap",
                self.path,
            )
        if self._unfinished:
            raise OSError(
                errno.EIO,
                "an earlier write of this file was cut short (an exception while it ran, e.g. "
                "Ctrl-C): it may have a gap",
                self.path,
            )

    def write(self, data) -> int:
        self._check_open()
        view = memoryview(data)
        if not view.nbytes:
            return 0  # as a file does (an empty multi-dimensional buffer cannot be cast)
        self._unfinished = True  # until the last line: an exception anywhere between leaves it set
        view = view.cast("B")
        done = 0
        while done < len(view):
            n = min(CHUNK - self._filled, len(view) - done)
            if n >= GIL_FREE_COPY:
                # numpy's copy of bytes releases the GIL; a memoryview slice assignment holds it for the whole copy,
                # and in a background save's writing thread that stops the training thread's Python meanwhile
                # (bench/gil_copies.py: a Python-driven loop beside such copies ran 14 iterations against 11,727)
                np.copyto(
                    self._array[self._filled : self._filled + n], np.frombuffer(view[done : done + n], dtype=np.uint8)
                )
            else:
                self._view[self._filled : self._filled + n] = view[done : done + n]
            self._filled += n
            done += n
            if self._filled == CHUNK:
                self._hand_off()
        self._unfinished = False
        return done

    def copy_from(self, fd: int, offset: int, count: int) -> int:
        """Append ``count`` bytes of the open file ``fd`` from ``offset``, read straight into the aligned buffer
        (one copy, out of the page cache; the write is the device's). Returns the bytes appended: fewer only where
        that file ends.

        Why not copy_file_range: the kernel copies page cache to page cache, at full speed only where source and
        destination lie at the same offset within a page; a safetensors file packs tensors back to back, so a
        checkpoint's records land at other page offsets, and that copy ran 2-3x slower than `cp`'s and varied 3x
        from run to run (bench/merge_benchmark.py; a buffered write of the same bytes from user space cost 20 s
        of CPU for 5.9 GB here)."""
        self._check_open()
        self._unfinished = True
        done = 0
        while done < count:
            want = min(CHUNK - self._filled, count - done)
            target = self._view[self._filled : self._filled + want]
            if hasattr(os, "preadv"):
                n = os.preadv(fd, [target], offset + done)  # releases the GIL
            else:  # macOS before 11
                data = os.pread(fd, want, offset + done)
                n = len(data)
                target[:n] = data
            if n == 0:
                break
            self._filled += n
            done += n
            if self._filled == CHUNK:
                self._hand_off()
        self._unfinished = False
        return done

    def flush(self) -> None:
        pass  # the buffer goes out in aligned chunks only; close writes the rest

    def _hand_off(self) -> None:
        """The full buffer to the writer thread; the caller goes on filling the other one, once its last write is done
        (which raises that write's error, if any). While the interpreter finalizes, no thread may run again: written
        here."""
        self._wait()
        if sys.is_finalizing():
            self._drain(CHUNK)
            return
        if self._jobs is None:
            self._start_writer()
        job = _Done(self, self._view[:CHUNK], self._written)
        self._written += CHUNK
        self._jobs.put(job)  # C: atomic. Cut short before the next line, the job is the writer's all the same, and
        self._pending = job  # this file is unfinished: abort waits for the writer's end, which comes after every job
        self._next_buffer()

    def _start_writer(self) -> None:
        """A thread of _thread's, not threading's: Thread.start waits on Python-level locks that a signal's exception
        can
        leave held, and the new thread then waits on them for good. Its queue is known before it starts, so abort
        tells it to end whatever happens next; its number after, so abort waits only for a thread that may hold a
        chunk (cut short in between, none was handed to it)."""
        if self._closing:  # another thread closes this file meanwhile (misuse): no thread that nothing would end
            raise ValueError(f"{self.path}: write to a closed file")
        self._writer_life, self._jobs = _Done(), queue.SimpleQueue()
        self._writer_ident = _thread.start_new_thread(_writer, (self._jobs, self._writer_life))

    def _wait(self) -> None:
        """The pending write ended; its error is raised, and kept for every later call. A signal's exception while
        waiting (Ctrl-C) leaves it pending: the next wait waits again."""
        if self._failed is not None:
            self._check_whole()
        job = self._pending
        if job is None:
            return
        _until(job)
        if job.error is not None:
            self._failed = job.error  # before the job is let go: cut short between, the error is still kept
        self._pending = None
        if job.error is not None:
            raise job.error

    def _drain(self, count: int) -> None:
        """Write the buffer's first ``count`` bytes at the file's end, now; keep the rest at the buffer's start."""
        self._wait()
        try:
            self._write_at(self._view[:count], self._written)
        except BaseException as err:
            self._failed = err
            raise
        self._written += count
        rest = self._filled - count
        self._view[:rest] = self._view[count : self._filled]
        self._filled = rest

    def _write_at(self, data: memoryview, offset: int) -> None:
        """All of ``data`` at ``offset`` (in the writer thread, or in the caller's with none pending: never both)."""
        done = 0
        while done < len(data):
            try:
                n = os.pwrite(self.fd, data[done:], offset + done)
            except OSError as e:
                if not (self.direct and e.errno == errno.EINVAL):
                    raise OSError(e.errno, e.strerror, self.path) from None  # a write's error names no file: this one
                self._buffered("the filesystem refused an aligned O_DIRECT write")
                continue
            if n <= 0:
                raise OSError(errno.EIO, f"{self.path}: a write made no progress")
            if self.direct and n % BLOCK and done + n < len(data):
                self._buffered("a short O_DIRECT write left the offset unaligned")
            done += n

    def _buffered(self, why: str | None) -> None:
        """The rest of the file through the page cache (``why``: None for the last partial block, which must). The same
        descriptor, O_DIRECT cleared: never the path again (it may have been renamed or replaced since)."""
        self.page_cache_why = self.page_cache_why or why
        fcntl.fcntl(self.fd, fcntl.F_SETFL, fcntl.fcntl(self.fd, fcntl.F_GETFL) & ~O_DIRECT)
        self.direct = False

    def close(self) -> None:
        if (
            self._close_cut
        ):  # closed or not, this one may be short (or written twice, were it finished again): said again
            self.abort()
            raise OSError(
                errno.EIO,
                "an earlier close of this file was cut short (an exception while it ran, e.g. "
                "Ctrl-C): it may be incomplete",
                self.path,
            )
        if self.closed:
            return
        if self.fd < 0:  # the open failed: nothing to finish
            return self.abort()
        self._closing = self._close_cut = True  # until the last line: an exception anywhere between leaves it set
        try:
            try:
                self._finish()
            finally:
                self.abort()
        except Exception:
            self._close_cut = False  # an error, raised as itself: closing again does nothing, as for any file
            raise
        self._close_cut = False

    def _finish(self) -> None:
        """What close writes: the last chunks and the partial block, then fsync."""
        self._wait()  # before testing self.direct, which that write may have cleared
        self._check_whole()  # a write cut short: its bytes are unknown
        if self.direct:
            aligned = self._filled - self._filled % BLOCK
            if aligned:
                self._drain(aligned)
            if self._filled:
                self._buffered(None)
        if self._filled:
            self._drain(self._filled)
        if self.sync:
            try:
                os.fsync(self.fd)
            except OSError as e:  # EIO, or ENOSPC/EDQUOT a network filesystem reports only now
                raise OSError(e.errno, e.strerror, self.path) from None

    def abort(self) -> None:
        """The descriptors close, what was not written is dropped. The writer thread ends first (after the chunks it
        holds: a write after the close could land in whatever file is opened next with that number); cut short while
        waiting for it, the descriptor stays open for the next close, abort or the finalizer. In the writer thread
        itself (a file collected unclosed), it is told to end and not waited for."""
        if self.closed:
            return
        self._closing = True
        jobs, life = self._jobs, self._writer_life
        if jobs is not None:
            jobs.put(None)  # after every chunk handed to it; a second None (an abort again) is never read
            if self._writer_ident not in (None, _thread.get_ident()) and life.pid == os.getpid():
                _until(life)  # (in a forked child the parent's thread writes on, into the parent's file description)
            self._jobs = None
        self._pending = None  # its error, if any, was raised or is moot: the file is incomplete either way
        try:
            self.fd = -1  # no write after this
            if self._owner is not None:
                self._owner.close()  # C: forgets the number before closing it (a failed close still frees it), once
        finally:
            if self._owner is None or self._owner.closed:  # cut short before, the next close or abort closes it
                self._release()

    def _release(self) -> None:
        self._array = self._arrays = None  # numpy's views of the buffers, which would keep them open
        self._view = None
        for view, buffer in zip(self._views, self._buffers):
            view.release()
            try:
                buffer.close()
            except BufferError:
                pass  # a slice of it still lives (an exception's traceback holds one): freed with the last of them
        super().close()


def sync_folder(folder: str | os.PathLike) -> None:
    """Every file in ``folder`` and the folder's entries on disk (fsync), before it is renamed into place: a
    renamed folder whose files still sat in the page cache would, after a crash, be a model folder with empty or
    torn files that looks complete. Files DirectFile wrote are already on disk; their fsync costs nothing."""
    for entry in os.scandir(folder):
        if entry.is_file(follow_symlinks=False):
            with io.FileIO(entry.path, "r") as f:  # owned from the start (see DirectFile.__init__)
                os.fsync(f.fileno())
    sync_entries(folder)


def sync_entries(folder: str | os.PathLike) -> None:
    """The folder's entries (a rename into it, a new file's name) on disk, where the platform can fsync a folder.
    The open, fsync and close run on a thread of their own: Python runs signal handlers in the main thread only, so
    Ctrl-C can cut the wait short but never land between the open and the close (io.FileIO, which owns a file's
    descriptor from the start, refuses a folder)."""
    done = _Done()
    _thread.start_new_thread(_sync_entries, (os.fspath(folder), done))
    _until(done)


def _sync_entries(folder: str, done: _Done) -> None:
    try:
        fd = os.open(folder, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
        try:
            os.fsync(fd)
        except OSError:
            pass  # some filesystems refuse fsync on a folder (EINVAL): their renames are as durable as they get
        finally:
            os.close(fd)
    except OSError:
        pass  # a folder that cannot be opened: nothing to sync
    finally:
        done.end()
