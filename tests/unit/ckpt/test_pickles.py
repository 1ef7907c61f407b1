"""The pickle class, generated: every file of a checkpoint that can carry a pickle, with every kind of payload, is
refused before anything unpickles it, by every reader (tools/check_checkpoint.py, the resume check of
train_fsdp.py, the merge), and torch's own DCP reader refuses it too once guarded (the resume's actual load).
Nothing a payload names ever runs: each payload, unpickled plainly, would create a marker file."""

from __future__ import annotations

import ast
import io
import os
import pickle
import shutil
import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from conftest import REPO, cli

from fsdp_recipes.ckpt.dcp_layout import UnsafeCheckpointError
from fsdp_recipes.ckpt.dcp_pickles import guard_torch_dcp
from fsdp_recipes.ckpt.merge import merge_checkpoint
from fsdp_recipes.ckpt.resume import resolve_resume
from fsdp_recipes.ckpt.status import checkpoint_status
from fsdp_recipes.errors import CheckpointError, RecipeError


class Payload:
    """Unpickled plainly, runs ``how`` (a callable and its argument) which creates the marker file."""

    def __init__(self, how: str, marker: Path):
        self.how, self.marker = how, str(marker)

    def __reduce__(self):
        import subprocess

        if self.how == "os.system":
            return os.system, (f"touch {self.marker}",)
        if self.how == "subprocess":
            return subprocess.call, (["touch", self.marker],)
        if self.how == "eval":
            return eval, (f"open({self.marker!r}, 'w').close()",)
        return exec, (f"open({self.marker!r}, 'w').close()",)


PAYLOADS = ["os.system", "subprocess", "eval", "exec"]


def _quiet_save(state: dict, folder: Path) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        dcp.save(state, checkpoint_id=str(folder), no_dist=True)


def _poison_dcp(folder: Path, payload, where: str) -> None:
    """Point one entry of a DCP folder's metadata at a record holding the payload: an existing byte record (an
    optimizer's learning rate), a new byte entry, or a tensor record. The payload is a real torch.save record, as
    DCP writes them, in a file of its own."""
    # test-only: forging DCP metadata
    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata, MetadataIndex

    metadata = dcp.FileSystemReader(str(folder)).read_metadata()
    record = io.BytesIO()
    torch.save(payload, record)
    evil = folder / "__9_0.distcp"
    evil.write_bytes(record.getvalue())
    here = _StorageInfo(evil.name, 0, len(record.getvalue()))
    is_bytes = {k: isinstance(v, BytesStorageMetadata) for k, v in metadata.state_dict_metadata.items()}
    if where == "extra byte entry":
        metadata.state_dict_metadata["model.evil"] = BytesStorageMetadata()
        metadata.storage_data[MetadataIndex("model.evil")] = here
    else:
        key = sorted(k for k, b in is_bytes.items() if b == (where == "byte record"))[0]
        for index in [i for i in metadata.storage_data if i.fqn == key]:
            metadata.storage_data[index] = here
    (folder / ".metadata").write_bytes(pickle.dumps(metadata))


def _plain_read(folder: Path) -> None:
    """What an unguarded reader does with a byte record: torch.load(weights_only=False)."""
    metadata = dcp.FileSystemReader(str(folder)).read_metadata()
    info = next(i for i in metadata.storage_data.values() if i.relative_path == "__9_0.distcp")
    with open(folder / info.relative_path, "rb") as f:
        f.seek(info.offset)
        torch.load(io.BytesIO(f.read(info.length)), weights_only=False)


@pytest.fixture
def checkpoint(trained, tmp_path) -> Path:
    copy = tmp_path / "run" / "checkpoint-12"
    shutil.copytree(trained("accelerate_configs/zero3.yaml").output_dir / "checkpoint-12", copy)
    return copy


def _assert_refused_everywhere(ckpt: Path, marker: Path, capsys, merge_reads_it: bool) -> None:
    assert cli("check_checkpoint", [str(ckpt)]) == 1
    said = capsys.readouterr().out.strip().splitlines()
    assert "INCOMPLETE" in said[0] and ("refusing" in said[0] or "refused" in said[0]), said
    with pytest.raises(RecipeError, match="cannot resume from checkpoint-12 .*refus"):
        resolve_resume(str(ckpt), str(ckpt.parent))
    if merge_reads_it:
        with pytest.raises(CheckpointError, match="refus"):
            merge_checkpoint(ckpt, ckpt.parent.parent / "merged", log=lambda *_: None)
        assert not (ckpt.parent.parent / "merged").exists()
    assert not marker.exists(), "the payload ran"


@pytest.mark.parametrize("how", PAYLOADS)
@pytest.mark.parametrize(
    "folder,where",
    [
        ("optimizer_0", "byte record"),
        ("optimizer_0", "extra byte entry"),
        ("optimizer_0", "tensor record"),
        ("pytorch_model_fsdp_0", "extra byte entry"),
        ("pytorch_model_fsdp_0", "tensor record"),
    ],
)
def test_dcp_records_with_payloads(checkpoint, folder, where, how, tmp_path, capsys):
    marker = tmp_path / "code-ran"
    _poison_dcp(checkpoint / folder, Payload(how, marker), where)
    # the payload is live: torch's unguarded reader would run it (shown once, on the plain bytes)
    if how == "os.system":
        _plain_read(checkpoint / folder)
        assert marker.exists()
        marker.unlink()
    # a merge reads tensors only
    merge_reads_it = folder == "pytorch_model_fsdp_0" and where == "tensor record"
    _assert_refused_everywhere(checkpoint, marker, capsys, merge_reads_it)


@pytest.mark.parametrize("name", ["scheduler.pt", "rng_state_0.pth", "rng_state_1.pth"])
@pytest.mark.parametrize("how", PAYLOADS)
def test_small_files_with_payloads(checkpoint, name, how, tmp_path, capsys):
    marker = tmp_path / "code-ran"
    torch.save({"state": Payload(how, marker)}, checkpoint / name)
    _assert_refused_everywhere(checkpoint, marker, capsys, merge_reads_it=False)


@pytest.mark.parametrize("path", ["../escape.distcp", "/etc/passwd", "sub/../../x.distcp", "..", "link"])
def test_storage_paths_stay_inside_the_checkpoint(checkpoint, path, tmp_path, capsys):
    folder = checkpoint / "pytorch_model_fsdp_0"
    outside = tmp_path / "elsewhere.distcp"
    shutil.copyfile(folder / "__0_0.distcp", outside)
    metadata = dcp.FileSystemReader(str(folder)).read_metadata()
    if path == "link":
        (folder / "__0_0.distcp").unlink()
        (folder / "__0_0.distcp").symlink_to(outside)
    else:
        for info in metadata.storage_data.values():
            if info.relative_path == "__0_0.distcp":
                info.relative_path = path
        (folder / ".metadata").write_bytes(pickle.dumps(metadata))
    assert cli("check_checkpoint", [str(checkpoint)]) == 1
    assert "outside its folder: refusing to read it" in capsys.readouterr().out
    with pytest.raises(CheckpointError, match="outside its folder"):
        merge_checkpoint(checkpoint, tmp_path / "merged", log=lambda *_: None)


@pytest.mark.parametrize("how", PAYLOADS)
def test_torch_dcp_reader_is_guarded(tmp_path, how):
    """The resume's own load (DCP, as accelerate calls it) refuses a payload even where no earlier check ran."""
    marker = tmp_path / "code-ran"
    _quiet_save({"w": torch.ones(2, 2), "lr": 0.5, "evil": Payload(how, marker)}, tmp_path / "ckpt")
    guard_torch_dcp()
    # DCP wraps its ranks' errors in a CheckpointException
    with pytest.raises(BaseException) as caught:
        dcp.load({"w": torch.zeros(2, 2), "lr": 0.0, "evil": None}, checkpoint_id=str(tmp_path / "ckpt"), no_dist=True)
    assert "refusing to unpickle" in str(caught.value) and not marker.exists()
    # the same checkpoint's plain entries still load
    state = {"w": torch.zeros(2, 2), "lr": 0.0}
    dcp.load(state, checkpoint_id=str(tmp_path / "ckpt"), no_dist=True)
    assert state["lr"] == 0.5 and torch.equal(state["w"], torch.ones(2, 2))
    poisoned = dcp.FileSystemReader(str(tmp_path / "ckpt")).read_metadata()
    poisoned.planner_data = Payload(how, marker)
    (tmp_path / "ckpt" / ".metadata").write_bytes(pickle.dumps(poisoned))
    with pytest.raises(UnsafeCheckpointError):
        dcp.FileSystemReader(str(tmp_path / "ckpt")).read_metadata()
    assert not marker.exists()


def test_real_checkpoints_pass_every_check(checkpoint):
    """Our own checkpoints (model, optimizer with its byte records, RNG and scheduler files) are resumable."""
    status = checkpoint_status(checkpoint)
    assert status.resumable, status.problems


@pytest.mark.parametrize("trick", ["concat", "case"])
def test_zip_records_torch_reads_differently_from_zipfile(checkpoint, trick, tmp_path, capsys):
    """A byte record that Python's zipfile reads as a harmless float and torch's zip reader as a payload: refused
    before the resume, and by the guarded load itself."""

    from helpers import zip_differentials

    from fsdp_recipes.ckpt.dcp_pickles import vet_record

    marker = tmp_path / "code-ran"
    plain = io.BytesIO()
    torch.save(0.001, plain)
    evil = getattr(zip_differentials, trick)(plain.getvalue(), pickle.dumps(Payload("os.system", marker), protocol=2))
    # zipfile sees only the float: the differential is real
    vet_record(io.BytesIO(evil), plain_data=True)
    # and torch's reader runs the payload
    torch.load(io.BytesIO(evil), weights_only=False)
    assert marker.exists()
    marker.unlink()

    folder = checkpoint / "optimizer_0"
    metadata = dcp.FileSystemReader(str(folder)).read_metadata()
    key = sorted(i.fqn for i in metadata.storage_data if "param_groups" in i.fqn)[0]
    (folder / "__9_0.distcp").write_bytes(evil)
    # test-only: forging DCP metadata
    from torch.distributed.checkpoint.filesystem import _StorageInfo

    for index in [i for i in metadata.storage_data if i.fqn == key]:
        metadata.storage_data[index] = _StorageInfo("__9_0.distcp", 0, len(evil))
    (folder / ".metadata").write_bytes(pickle.dumps(metadata))
    _assert_refused_everywhere(checkpoint, marker, capsys, merge_reads_it=False)
    guard_torch_dcp()
    with pytest.raises(BaseException) as caught:
        dcp.load({key: None}, checkpoint_id=str(folder), no_dist=True)
    assert "refusing to unpickle" in str(caught.value) and not marker.exists()


def test_a_shard_swapped_for_a_fifo_after_the_checks_does_not_hang_the_load(tmp_path):
    """The checks before a resume saw a regular file; by the time torch opens it, it is a link to a FIFO (which would
    block the load forever, deaf to SIGTERM). The guarded reader checks every storage file again as it reads."""
    import signal

    _quiet_save({"w": torch.ones(2, 2)}, tmp_path / "ckpt")
    (tmp_path / "ckpt" / "__0_0.distcp").unlink()
    os.mkfifo(tmp_path / "fifo")
    (tmp_path / "ckpt" / "__0_0.distcp").symlink_to(tmp_path / "fifo")
    guard_torch_dcp()
    signal.signal(signal.SIGALRM, lambda *_: (_ for _ in ()).throw(TimeoutError("the load blocked on the FIFO")))
    signal.alarm(30)
    try:
        with pytest.raises(BaseException) as caught:
            dcp.load({"w": torch.zeros(2, 2)}, checkpoint_id=str(tmp_path / "ckpt"), no_dist=True)
    finally:
        signal.alarm(0)
    assert "a link to" in str(caught.value) and not isinstance(caught.value, TimeoutError)


def _unpickling_calls(path: Path) -> list[tuple[str, int, str]]:
    """(file, line, what) for every call that unpickles: pickle.load(s), torch.load, a DCP load."""
    import ast

    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if not (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and isinstance(node.func.value, ast.Name)
        ):
            continue
        owner, name = node.func.value.id, node.func.attr
        if (owner, name) in (("pickle", "load"), ("pickle", "loads"), ("dcp", "load"), ("dcp", "load_state_dict")):
            found.append((path.name, node.lineno, f"{owner}.{name}"))
        elif (owner, name) == ("torch", "load"):
            weights_only = next((k.value for k in node.keywords if k.arg == "weights_only"), None)
            ok = isinstance(weights_only, ast.Constant) and weights_only.value is True
            found.append((path.name, node.lineno, "torch.load" + ("" if ok else " without weights_only=True")))
    return found


def test_only_the_allow_listed_readers_unpickle():
    """Plain pickle only in ckpt/dcp_pickles.py (on bytes its allow-list vetted), torch.load only with
    weights_only=True,
    and a DCP load only in readers.py, which guards torch's reader first. The scan can fail: it finds the known ones."""
    repo = REPO
    files = [
        *(repo / "fsdp_recipes").rglob("*.py"),
        *(repo / "tools").rglob("*.py"),
        *(repo / "bench").rglob("*.py"),
        repo / "train_fsdp.py",
    ]
    calls = [c for f in files for c in _unpickling_calls(f)]
    allowed = {
        ("dcp_pickles.py", "pickle.loads"),
        ("dcp_pickles.py", "torch.load"),
        ("readers.py", "torch.load"),
        ("checkpoint_files.py", "torch.load"),
        ("readers.py", "dcp.load"),
    }
    assert [c for c in calls if (c[0], c[2]) not in allowed] == []
    # each allowed reader is still where this test says
    assert {(c[0], c[2]) for c in calls} == allowed
    source = (repo / "fsdp_recipes" / "ckpt" / "readers.py").read_text()
    read = source[source.index("    def read(self, names") :]
    assert read.index("guard_torch_dcp()") < read.index("dcp.load(")
    # the restricted unpicklers, every allow-list, live in that one module too
    unpicklers = [
        (f.name, node.name)
        for f in files
        for node in ast.walk(ast.parse(f.read_text()))
        if isinstance(node, ast.ClassDef) and any(ast.unparse(b) == "pickle.Unpickler" for b in node.bases)
    ]
    assert {f for f, _ in unpicklers} == {"dcp_pickles.py"} and len(unpicklers) == 3, unpicklers
