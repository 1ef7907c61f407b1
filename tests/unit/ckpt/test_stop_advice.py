"""A save that ran out of disk or of quota ends the run in one line naming which, however the error reached it (a real
DCP save failing at any write, direct or through the page cache, its error gathered from another rank; torch.save to
a path, which keeps no errno); any other failed write (a failing device) is not called either."""

from __future__ import annotations

import errno
import io
import os
import pickle
import shutil
from contextlib import contextmanager
from types import SimpleNamespace

import pytest
from conftest import fail_direct_writes, plain_checkpoint

from fsdp_recipes import direct_writes
from fsdp_recipes.ckpt import stop_advice
from fsdp_recipes.ckpt.stop_advice import disk_full_problem

LINES = {errno.ENOSPC: "no space left on", errno.EDQUOT: "disk quota exceeded on", errno.EIO: None}
CHUNK = 1 << 20


def _state():
    import torch

    return {"w": torch.randn(1024, 1300, generator=torch.Generator().manual_seed(0)), "step": torch.tensor(3)}


class FailingStream(io.FileIO):
    """A file whose write fails with ``code`` once ``limit`` bytes are written, as a full disk fails it."""

    def __init__(self, path, limit: int, code: int):
        super().__init__(path, "w")
        self.limit, self.code = limit, code

    def write(self, data):
        if self.tell() + len(memoryview(data).cast("B")) > self.limit:
            raise OSError(self.code, os.strerror(self.code))
        return super().write(data)


def failed_save(tmp_path, monkeypatch, *, direct: bool, code: int, at: int) -> BaseException:
    """A real DCP save inside checkpoint_saves whose ``at``-th write of its shard file fails with ``code``: its
    error as another rank receives it (DCP gathers every rank's error as a pickle)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException
    from torch.distributed.checkpoint.filesystem import FileSystem

    from fsdp_recipes.compat.async_dcp import ShardFiles, checkpoint_saves

    if direct:
        monkeypatch.setattr(direct_writes, "CHUNK", CHUNK)
        fail_direct_writes(monkeypatch, at, code)
    else:
        create_stream = FileSystem.create_stream

        @contextmanager
        def failing(self, path, mode):
            if not str(path).endswith(".distcp"):
                with create_stream(self, path, mode) as stream:
                    yield stream
                return
            stream = FailingStream(path, (at - 1) * CHUNK, code)
            try:
                yield stream
            finally:
                stream.close()

        monkeypatch.setattr(FileSystem, "create_stream", failing)
    with pytest.raises(CheckpointException) as raised, checkpoint_saves(ShardFiles(), direct=direct):
        # inside output_dir, as a run writes it
        shards = tmp_path / "run" / "checkpoint-12" / "pytorch_model_fsdp_0"
        dcp.save(_state(), storage_writer=dcp.FileSystemWriter(str(shards)), no_dist=True)
    monkeypatch.undo()
    return pickle.loads(pickle.dumps(raised.value))


@pytest.mark.parametrize("code", list(LINES))
@pytest.mark.parametrize("direct", [True, False], ids=["direct", "page-cache"])
@pytest.mark.parametrize("at", [1, 3, 5])
def test_a_failed_dcp_save_is_named_by_its_writes_error(tmp_path, monkeypatch, code, direct, at):
    err = failed_save(tmp_path, monkeypatch, direct=direct, code=code, at=at)
    plain_checkpoint(tmp_path / "run", step=6, world=2)
    line = disk_full_problem(err, tmp_path / "run")
    if LINES[code] is None:
        assert line is None, line
    else:
        assert line.startswith(f"{LINES[code]} {tmp_path / 'run'}: a checkpoint takes "), line
        assert "checkpoint-6 is intact" in line and line.endswith("--resume_from_checkpoint true"), line


def rust_error(code: int) -> RuntimeError:
    """safetensors' error for a failed write (from Rust): the OS's message, no errno."""
    return RuntimeError(f'Error while serializing: IoError(Os {{ code: {code}, message: "{os.strerror(code)}" }})')


def _errors(code: int):
    """The shapes a failed write's error reaches the run's end in with its errno: (name, error). A quota is named by
    safetensors' message too (a full disk only with the free space: the test below)."""
    from torch.distributed.checkpoint.api import CheckpointException

    plain = OSError(code, os.strerror(code))
    try:
        try:
            raise plain
        except OSError:
            raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 704 vs 598")  # noqa: B904
    except RuntimeError as err:
        # torch.save into a Python stream: the OSError is only the context
        wrapped = err
    return [
        ("the write's own", plain),
        ("torch.save's, the write's as its context", wrapped),
        ("DCP's, one rank's error in it", CheckpointException("write", {1: (plain, None)})),
        *([("safetensors', its message only", rust_error(code))] if code != errno.ENOSPC else []),
    ]


@pytest.mark.parametrize("code", list(LINES))
@pytest.mark.parametrize("kept", [True, False], ids=["a checkpoint kept", "none yet"])
@pytest.mark.parametrize("export", [False, True], ids=["training", "final export"])
def test_every_shape_of_the_error_gives_the_same_line(tmp_path, code, kept, export, monkeypatch):
    if kept:
        plain_checkpoint(tmp_path, step=6, world=2)
    # the line names the free space: read once, so that other tests writing to the same disk meanwhile cannot
    # make two shapes' lines differ
    usage = shutil.disk_usage(tmp_path)
    monkeypatch.setattr(stop_advice, "shutil", SimpleNamespace(disk_usage=lambda _: usage))
    lines = {name: disk_full_problem(err, tmp_path, export=export) for name, err in _errors(code)}
    assert len(set(lines.values())) == 1, lines
    line = next(iter(lines.values()))
    if LINES[code] is None:
        assert line is None
        return
    assert line.startswith(f"{LINES[code]} {tmp_path}"), line
    assert ("checkpoint-6 is intact" if kept else "no complete checkpoint was written yet") in line, line
    assert ("while writing the final model" in line) is export, line
    # a quota is not the disk's
    assert ("MB free" in line or "MB is free" in line) is (code == errno.ENOSPC), line


def torch_save_to_a_path(small: bool) -> RuntimeError:
    """torch.save to a path on a full disk: its zip writer's error over its stream's, or (a small file, failing only
    at close) its stream's alone; no errno either way."""
    stream = RuntimeError("basic_ios::clear: iostream error")
    if small:
        return stream
    err = RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 576 vs 534")
    err.__context__ = stream
    return err


ERRNO_LESS = {
    "torch.save to a path": lambda: torch_save_to_a_path(small=False),
    "torch.save of a small file to a path": lambda: torch_save_to_a_path(small=True),
    "safetensors' message": lambda: rust_error(errno.ENOSPC),
}


@pytest.mark.parametrize("shape", list(ERRNO_LESS))
@pytest.mark.parametrize("free, full", [(0, True), (400_000, True), (10**9, False)])
def test_an_errno_less_error_is_a_full_disk_only_when_less_than_a_checkpoint_is_free(
    tmp_path, monkeypatch, shape, free, full
):
    """Else it is a failing device, or another disk's (a DataLoader worker's full /dev/shm says "No space left" too),
    and keeps its traceback."""
    import torch

    ckpt = plain_checkpoint(tmp_path, step=6, world=2)
    torch.save({"state": {0: {"exp_avg": torch.zeros(125_000)}}, "param_groups": []}, ckpt / "optimizer.pt")
    # the free space this module reads, and only here (the checkpoint's status reads the real filesystem)
    disk = SimpleNamespace(disk_usage=lambda _: SimpleNamespace(total=shutil.disk_usage(tmp_path).total, free=free))
    monkeypatch.setattr(stop_advice, "shutil", disk)
    line = disk_full_problem(ERRNO_LESS[shape](), tmp_path)
    assert (line is not None and line.startswith(f"no space left on {tmp_path}: a checkpoint takes 0.5 MB")) is full
    assert (line is None) is not full, line


# torch elastic's record of a failed child, as ChildFailedError.failures holds it
class ProcessFailure:
    pass


class ChildFailed(Exception):
    failures = {0: ProcessFailure(), 1: ()}


def test_errors_that_are_not_a_failed_write_into_output_dir_are_left_alone(tmp_path):
    from torch.distributed.checkpoint.api import CheckpointException

    plain_checkpoint(tmp_path, step=6, world=2)
    try:
        try:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        except OSError:
            raise ValueError("a record is not JSON")  # noqa: B904
    except ValueError as err:
        while_handling = err
    cases = {
        "a full disk elsewhere": OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), "/dev/shm/torch_123"),
        "another error raised while one was handled": while_handling,
        "failures that are text": CheckpointException("write", {0: "a failure's text"}),
        "failures that are records": ChildFailed(),
    }
    lines = {name: disk_full_problem(err, tmp_path) for name, err in cases.items()}
    assert lines == dict.fromkeys(cases), lines
    inside = OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(tmp_path / "checkpoint-12" / "optimizer.pt"))
    assert disk_full_problem(inside, tmp_path).startswith(f"no space left on {tmp_path}: a checkpoint takes")
