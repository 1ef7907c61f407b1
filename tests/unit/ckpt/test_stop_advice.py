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
        dcp.save(_state(), storage_writer=dcp.FileSystemWriter(str(tmp_path / "ours")), no_dist=True)
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


def _errors(code: int):
    """The shapes a failed write's error reaches the run's end in: (name, error)."""
    from torch.distributed.checkpoint.api import CheckpointException

    plain = OSError(code, os.strerror(code))
    try:
        try:
            raise plain
        except OSError:
            raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 704 vs 598") from None
    except RuntimeError as err:
        wrapped = err  # torch.save into a Python stream: the OSError is only the context
    wrapped.__suppress_context__ = False
    wrapped.__context__ = plain
    rust = RuntimeError(f'Error while serializing: IoError(Os {{ code: {code}, message: "{os.strerror(code)}" }})')
    return [
        ("the write's own", plain),
        ("torch.save's, the write's as its context", wrapped),
        ("DCP's, one rank's error in it", CheckpointException("write", {1: (plain, None)})),
        ("safetensors', its message only", rust),
    ]


@pytest.mark.parametrize("code", list(LINES))
@pytest.mark.parametrize("kept", [True, False], ids=["a checkpoint kept", "none yet"])
@pytest.mark.parametrize("export", [False, True], ids=["training", "final export"])
def test_every_shape_of_the_error_gives_the_same_line(tmp_path, code, kept, export):
    if kept:
        plain_checkpoint(tmp_path, step=6, world=2)
    lines = {name: disk_full_problem(err, tmp_path, export=export) for name, err in _errors(code)}
    assert len(set(lines.values())) == 1, lines
    line = next(iter(lines.values()))
    if LINES[code] is None:
        assert line is None
        return
    assert line.startswith(f"{LINES[code]} {tmp_path}"), line
    assert ("checkpoint-6 is intact" if kept else "no complete checkpoint was written yet") in line, line
    assert ("while writing the final model" in line) is export, line
    assert ("MB free" in line or "MB is free" in line) is (code == errno.ENOSPC), line  # a quota is not the disk's


@pytest.mark.parametrize("free, full", [(0, True), (400_000, True), (10**9, False)])
def test_torch_save_to_a_path_is_a_full_disk_only_when_less_than_a_checkpoint_is_free(
    tmp_path, monkeypatch, free, full
):
    """torch.save to a path keeps no errno ("unexpected pos", its context a C++ iostream error): a full disk when less
    is free than the newest checkpoint takes, else a failing device, which is not called a full disk."""
    import torch

    ckpt = plain_checkpoint(tmp_path, step=6, world=2)
    torch.save({"state": {0: {"exp_avg": torch.zeros(125_000)}}, "param_groups": []}, ckpt / "optimizer.pt")
    # the free space this module reads, and only here (the checkpoint's status reads the real filesystem)
    disk = SimpleNamespace(disk_usage=lambda _: SimpleNamespace(total=shutil.disk_usage(tmp_path).total, free=free))
    monkeypatch.setattr(stop_advice, "shutil", disk)
    err = RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 576 vs 534")
    err.__context__ = RuntimeError("basic_ios::clear: iostream error")
    line = disk_full_problem(err, tmp_path)
    assert (line is not None and line.startswith(f"no space left on {tmp_path}: a checkpoint takes 0.5 MB")) is full
    assert (line is None) is not full, line
