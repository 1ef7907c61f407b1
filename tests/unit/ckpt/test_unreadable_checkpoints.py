"""A checkpoint another torch version wrote (a cluster filesystem shared by jobs of several versions) is "unreadable by
this version", never
"incomplete". A ``.metadata`` naming a dtype or DCP class the installed torch does not have is not passed over by
``--resume_from_checkpoint true``, not set aside, and no message offers ``--overwrite_output_dir`` for it; a dtype
torch has but the merge does not convert is resumable, and the merge refuses it in one line.

Checkpoints are written in this process (torch.distributed.checkpoint without a process group, torch.save) in the
layout train_fsdp.py writes; other versions' metadata is a real ``.metadata`` with one name changed in its pickle.
"""

from __future__ import annotations

import json
import pickle
import pickletools
import re
import shutil
import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from conftest import cli

from fsdp_recipes.ckpt.dcp_layout import UnsafeCheckpointError
from fsdp_recipes.ckpt.dcp_pickles import guard_torch_dcp, read_layout
from fsdp_recipes.ckpt.readers import DCPSource
from fsdp_recipes.ckpt.resolve import resolve_input
from fsdp_recipes.ckpt.resume import check_output_dir, resolve_resume
from fsdp_recipes.ckpt.rotation import set_aside
from fsdp_recipes.ckpt.safetensors_writer import write_weights
from fsdp_recipes.ckpt.status import checkpoint_status
from fsdp_recipes.ckpt.torch_names import TORCH_DTYPE_NAMES, torch_version
from fsdp_recipes.config.plan import Plan
from fsdp_recipes.errors import CheckpointError, RecipeError, UnknownToThisVersion
from fsdp_recipes.train import preflight

MODEL, OPTIMIZER = "pytorch_model_fsdp_0", "optimizer_0"


@pytest.fixture(autouse=True)
def launched_like_accelerate(monkeypatch):
    """Resume resolution reads the launcher's environment: an FSDP launch, seen from rank 0."""
    for key, value in {"ACCELERATE_USE_FSDP": "true", "WORLD_SIZE": "1", "RANK": "0"}.items():
        monkeypatch.setenv(key, value)


def _save(state: dict, folder: Path) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        dcp.save(state, checkpoint_id=str(folder), no_dist=True)


def make_checkpoint(run: Path, step: int, dtype: torch.dtype = torch.float32) -> Path:
    """checkpoint-<step> as train_fsdp.py lays it out on one process: model and optimizer shards (DCP, the optimizer
    with byte records), scheduler, RNG state, trainer state. The weight ``w`` has ``dtype``."""
    ckpt = run / f"checkpoint-{step}"
    ckpt.mkdir(parents=True)
    w = torch.arange(12, dtype=torch.float32).reshape(4, 3)
    _save({"model": {"w": w.to(dtype), "b": torch.ones(3)}}, ckpt / MODEL)
    _save(
        {
            "optimizer": {
                "state": {"w": {"exp_avg": torch.zeros(4, 3), "step": torch.tensor(float(step))}},
                "param_groups": [{"lr": 0.001, "params": ["w"]}],
            }
        },
        ckpt / OPTIMIZER,
    )
    torch.save({"last_epoch": step}, ckpt / "scheduler.pt")
    # the keys the Trainer reads
    torch.save({"python": [1], "numpy": [2], "cpu": torch.get_rng_state()}, ckpt / "rng_state.pth")
    (ckpt / "trainer_state.json").write_text(json.dumps({"global_step": step}))
    return ckpt


def rename_in_pickle(path: Path, old: str, new: str) -> None:
    """Change a name (a module or class a global is looked up by, a dtype) in a real pickle's bytes, as another
    torch version would have written it; the frames are rebuilt so any length fits."""
    data = path.read_bytes()
    short = b"\x8c" + bytes([len(old)]) + old.encode()
    assert short in data, f"{old} is not in {path}"
    path.write_bytes(pickletools.optimize(data.replace(short, b"\x8c" + bytes([len(new)]) + new.encode())))


def snapshot(folder: Path) -> list[tuple[str, bytes]]:
    return sorted((str(p.relative_to(folder)), p.read_bytes() if p.is_file() else b"") for p in folder.rglob("*"))


# what another torch version writes into .metadata that torch 2.13 does not have: case -> (folder, the names changed
# in the pickle, the name reported, whether our torch-free reader still reads the layout)
UNKNOWN_DTYPES = ["float9_e9m9", "uint128", "complex256", "float6_e3m2fn_x4", "int128", "bits32"]
CASES = {
    f"dtype {d} in {f}": (f, [("float32", d)], f"torch.{d}", False)
    for d in UNKNOWN_DTYPES
    for f in (MODEL, OPTIMIZER)
    if f == MODEL or d == "float9_e9m9"
}
DCP = "torch.distributed.checkpoint"
CASES |= {
    f"DCP {k} in {f}": (f, renames, named, reads)
    for f in (MODEL, OPTIMIZER)
    for k, (renames, named, reads) in {
        "class": (
            [("TensorStorageMetadata", "ShardedTensorStorageMetadata")],
            f"{DCP}.metadata.ShardedTensorStorageMetadata",
            False,
        ),
        "private class": ([("_StorageInfo", "_StorageInfoV2")], f"{DCP}.filesystem._StorageInfoV2", False),
        "class in a new module": (
            [(f"{DCP}.filesystem", f"{DCP}._fs_v3"), ("_StorageInfo", "_StorageInfoV3")],
            f"{DCP}._fs_v3._StorageInfoV3",
            False,
        ),
        # a class we know, moved: the layout reads (a merge copies it without torch), torch's reader, a resume's, cannot
        "class moved to a new module": ([(f"{DCP}.filesystem", f"{DCP}._fs_v3")], f"{DCP}._fs_v3._StorageInfo", True),
    }.items()
    if f == MODEL or k == "class"
}


@pytest.fixture
def run_dir(tmp_path) -> Path:
    """checkpoint-6 (good) and checkpoint-12 (to be changed)."""
    run = tmp_path / "run"
    make_checkpoint(run, 6)
    make_checkpoint(run, 12)
    assert checkpoint_status(run / "checkpoint-12").resumable, checkpoint_status(run / "checkpoint-12").problems
    return run


def test_the_dtype_list_is_this_torchs():
    """TORCH_DTYPE_NAMES is written out (torch_names.py imports no torch); it must not drift from the installed
    torch."""
    assert TORCH_DTYPE_NAMES == {n for n in dir(torch) if isinstance(getattr(torch, n), torch.dtype)}


def test_the_dcp_classes_are_where_this_torch_has_them():
    """_DCP_NAMES_OF_THIS_TORCH spares the checks importing torch.distributed.checkpoint; each must be where it says."""
    import importlib

    from fsdp_recipes.ckpt.torch_names import _DCP_NAMES_OF_THIS_TORCH

    assert all(hasattr(importlib.import_module(module), name) for module, name in _DCP_NAMES_OF_THIS_TORCH)


@pytest.mark.parametrize("case", CASES)
def test_another_versions_metadata_is_unreadable_by_this_version_not_incomplete(run_dir, case, capsys):
    folder, renames, named, layout_reads = CASES[case]
    ckpt = run_dir / "checkpoint-12"
    for old, new in renames:
        rename_in_pickle(ckpt / folder / ".metadata", old, new)
    before = snapshot(run_dir)

    status = checkpoint_status(ckpt)
    assert not status.resumable and status.may_be_complete and status.problems == [], status
    assert (
        status.unreadable == f"{folder}/.metadata names {named}, a {'dtype' if 'dtype' in case else 'DCP class'} torch "
        f"{torch_version()} does not know"
    )
    assert "UNREADABLE BY THIS VERSION" in status.summary() and "INCOMPLETE" not in status.summary()
    assert status.to_dict()["may_be_complete"] is True

    # the readers' own exception: a CheckpointError of its own type, not UnsafeCheckpointError
    version = (
        f"unreadable by this version: .*{named}, a .* torch {re.escape(torch_version())} does not know; "
        "another torch version wrote it"
    )
    if layout_reads:
        assert read_layout(ckpt / folder).tensors
    else:
        with pytest.raises(UnknownToThisVersion, match=version):
            read_layout(ckpt / folder)
    # the resume's own load: torch's reader, guarded
    guard_torch_dcp()
    with pytest.raises(UnknownToThisVersion, match=version):
        dcp.FileSystemReader(str(ckpt / folder)).read_metadata()

    # --resume_from_checkpoint true stops at it, names it, the problem and the fix; nothing is moved
    with pytest.raises(RecipeError) as caught:
        resolve_resume("true", str(run_dir))
    said = str(caught.value)
    assert (
        said.startswith("--resume_from_checkpoint true: checkpoint-12 in ") and "unreadable by this version" in said
    ), said
    assert named in said and "the torch version that wrote it" in said and str(run_dir / "checkpoint-6") in said, said
    assert "skipping" not in capsys.readouterr().err
    # asked for by path: the same kind of line, offering the newest checkpoint this version reads
    with pytest.raises(
        RecipeError,
        match=f"cannot resume from checkpoint-12 .*UNREADABLE BY THIS VERSION .*{named}.* or resume from "
        f"{run_dir / 'checkpoint-6'}",
    ):
        resolve_resume(str(ckpt), str(run_dir))

    # a new run into this output_dir: resume it or choose another folder, never the flag that deletes it
    with pytest.raises(RecipeError) as caught:
        check_output_dir(str(run_dir), resuming=False, overwrite=False)
    said = str(caught.value)
    assert (
        "--overwrite_output_dir" not in said
        and "checkpoint-12 may be complete but is unreadable by this version" in said
    ), said
    assert "choose a new --output_dir" in said

    # the tool says so, for the checkpoint and for the run (whose `resume true` stops at it)
    assert cli("check_checkpoint", [str(ckpt)]) == 1
    line = capsys.readouterr().out.strip()
    assert (
        line.startswith("checkpoint-12 (step 12, SHARDED_STATE_DICT, 1 rank(s)): UNREADABLE BY THIS VERSION (")
        and named in line
    ), line
    assert "INCOMPLETE" not in line
    assert cli("check_checkpoint", [str(run_dir)]) == 1
    lines = capsys.readouterr().out.strip().splitlines()
    assert lines[1].endswith(": resumable") and lines[2].startswith(
        "resume: --resume_from_checkpoint true stops at checkpoint-12"
    ), lines

    # a merge of the run does not pass over it either (only the model folder's metadata matters to a merge; one
    # whose classes only moved is copied without torch, or refused in the same line where torch reads it)
    if folder == MODEL and layout_reads:
        source = resolve_input(run_dir).source
        with pytest.raises(CheckpointError, match=version):
            source.read(["model.w"])
    elif folder == MODEL:
        with pytest.raises(
            CheckpointError,
            match=f"checkpoint-12 in {run_dir} is unreadable by this version: .*{named}.*or merge an earlier "
            "checkpoint-N",
        ):
            resolve_input(run_dir)
    else:
        assert resolve_input(run_dir).checkpoint_dir == ckpt
    # nothing was moved, set aside or deleted
    assert snapshot(run_dir) == before


def test_the_only_checkpoint_unreadable_by_this_version(tmp_path):
    run = tmp_path / "run"
    rename_in_pickle(make_checkpoint(run, 4) / MODEL / ".metadata", "float32", "float9_e9m9")
    with pytest.raises(
        RecipeError,
        match="checkpoint-4 in .* is unreadable by this version \\(.*resume with the torch version that wrote it$",
    ) as err:
        resolve_resume("true", str(run))
    # no earlier checkpoint to offer: none is named
    assert "--resume_from_checkpoint <" not in str(err.value)
    assert (run / "checkpoint-4").is_dir()


@pytest.mark.parametrize(
    "renames,missing",
    [
        ([("float32", "float9_e9m9")], "rng_state.pth"),
        # the layout reads: its shards are checked
        ([(f"{DCP}.filesystem", f"{DCP}._fs_v3")], f"{MODEL}/__0_0.distcp"),
    ],
)
def test_an_incomplete_checkpoint_that_is_also_unreadable_is_incomplete(run_dir, renames, missing):
    ckpt = run_dir / "checkpoint-12"
    for old, new in renames:
        rename_in_pickle(ckpt / MODEL / ".metadata", old, new)
    (ckpt / missing).unlink()
    status = checkpoint_status(ckpt)
    assert not status.may_be_complete and status.problems == [f"missing {missing}"] and status.unreadable, status
    assert status.summary().endswith(
        f"INCOMPLETE: missing {missing}; and unreadable by this version: " + status.unreadable
    )
    # a missing file is a problem in any version: set aside (moved)
    resume = resolve_resume("true", str(run_dir))
    assert resume.path == str(run_dir / "checkpoint-6") and [a.path.name for a in resume.set_aside] == ["checkpoint-12"]


# names this torch has that are not DCP data, and names outside torch: refused as unsafe, as before
STILL_UNSAFE = {
    "a torch function": ([("float32", "load")], "torch.load"),
    "a DCP class that is not data": ([("_StorageInfo", "FileSystemReader")], f"{DCP}.filesystem.FileSystemReader"),
    "os.system": ([("torch", "os"), ("float32", "system")], "os.system"),
    "builtins.eval": ([("torch.serialization", "builtins"), ("_get_layout", "eval")], "builtins.eval"),
    "a dtype-like name outside torch": ([("torch", "numpy")], "numpy.float32"),
}


@pytest.mark.parametrize("case", STILL_UNSAFE)
def test_names_this_torch_has_stay_unsafe(tmp_path, case):
    renames, named = STILL_UNSAFE[case]
    ckpt = make_checkpoint(tmp_path / "run", 3)
    for old, new in renames:
        rename_in_pickle(ckpt / MODEL / ".metadata", old, new)
    with pytest.raises(UnsafeCheckpointError, match=named):
        read_layout(ckpt / MODEL)
    status = checkpoint_status(ckpt)
    assert (
        status.unreadable is None and "refusing to unpickle it" in status.summary() and "INCOMPLETE" in status.summary()
    )


# dtypes torch 2.13 has: every one is read and resumable (float8 and uint16 records are torch.save's
# _rebuild_tensor_v3 over an UntypedStorage; complex ones name ComplexFloatStorage); the merge converts some
KNOWN = [
    "uint16",
    "uint32",
    "uint64",
    "complex64",
    "complex128",
    "float8_e8m0fnu",
    "float8_e4m3fnuz",
    "float8_e4m3fn",
    "float8_e5m2",
    "bfloat16",
]


@pytest.mark.parametrize("name", KNOWN)
def test_dtypes_this_torch_has_are_resumable(run_dir, name, tmp_path, capsys):
    dtype = getattr(torch, name)
    shutil.rmtree(run_dir / "checkpoint-12")
    ckpt = make_checkpoint(run_dir, 12, dtype)
    status = checkpoint_status(ckpt)
    assert status.resumable and status.unreadable is None, status.problems
    assert read_layout(ckpt / MODEL).tensors["model.w"].dtype == name
    assert resolve_resume("true", str(run_dir)) == (str(ckpt), [])
    with pytest.raises(RecipeError) as caught:
        check_output_dir(str(run_dir), resuming=False, overwrite=False)
    assert "--overwrite_output_dir" not in str(caught.value) and "--resume_from_checkpoint true" in str(caught.value)
    assert cli("check_checkpoint", [str(ckpt)]) == 0
    assert capsys.readouterr().out.strip().endswith(": resumable")

    source = DCPSource(ckpt / MODEL)
    expected = torch.arange(12, dtype=torch.float32).reshape(4, 3).to(dtype)
    # converted: read (through torch's guarded reader)
    if name in ("float8_e4m3fn", "float8_e5m2", "bfloat16"):
        got = source.read(["model.w"])["model.w"]
        assert got.dtype == dtype and torch.equal(got.view(torch.uint8), expected.view(torch.uint8))
        return
    with pytest.raises(CheckpointError, match=f"a tensor is {name}, which this tool does not convert to safetensors"):
        source.tensors["model.w"].nbytes()
    with pytest.raises(CheckpointError, match=f"is {name}, which this tool does not convert"):
        write_weights(source, ["model.w"], tmp_path)
    assert not list(tmp_path.glob("*.safetensors"))


def test_an_explicit_earlier_resume_sets_it_aside_and_deletes_nothing(run_dir):
    """The fix the stop offers: resuming an earlier checkpoint by its path moves the later one aside, byte for byte."""
    ckpt = run_dir / "checkpoint-12"
    rename_in_pickle(ckpt / MODEL / ".metadata", "float32", "float9_e9m9")
    kept = snapshot(ckpt)
    resume = resolve_resume(str(run_dir / "checkpoint-6"), str(run_dir))
    preflight.carry_out(Plan(set_aside=resume.set_aside))
    assert not ckpt.exists() and snapshot(run_dir / "replaced-checkpoint-12") == kept
    # set_aside itself only moves: a second one for the same step lands beside the first
    again = make_checkpoint(run_dir, 12)
    second = set_aside(again, prefix="replaced-")
    assert second.name == "replaced-checkpoint-12.1" and snapshot(run_dir / "replaced-checkpoint-12") == kept


def test_only_incomplete_checkpoints_may_be_offered_for_deletion(run_dir, tmp_path):
    """--overwrite_output_dir is offered only when no checkpoint in output_dir may be good."""
    for step in (6, 12):
        (run_dir / f"checkpoint-{step}" / "trainer_state.json").unlink()
    with pytest.raises(RecipeError, match="none of them complete.*--overwrite_output_dir true to delete them"):
        check_output_dir(str(run_dir), resuming=False, overwrite=False)
    # a good checkpoint set aside earlier (another branch of the run) is resumed by its path, never offered for deletion
    make_checkpoint(tmp_path / "elsewhere", 3).rename(run_dir / "replaced-checkpoint-3")
    with pytest.raises(RecipeError) as caught:
        check_output_dir(str(run_dir), resuming=False, overwrite=False)
    assert "--overwrite_output_dir" not in str(caught.value)
    assert f"--resume_from_checkpoint {run_dir / 'replaced-checkpoint-3'}" in str(caught.value)


def test_unknown_dtype_in_a_byte_record(tmp_path):
    """A tensor of a dtype this torch lacks inside an optimizer's byte record: unreadable by this version too."""
    ckpt = make_checkpoint(tmp_path / "run", 3)
    folder = ckpt / OPTIMIZER
    metadata = dcp.FileSystemReader(str(folder)).read_metadata()
    key = next(k for k in metadata.state_dict_metadata if "param_groups" in k and k.endswith("lr"))
    info = next(v for i, v in metadata.storage_data.items() if i.fqn == key)
    import io
    import zipfile

    record = io.BytesIO()
    torch.save(torch.zeros(2, dtype=torch.uint16), record)
    with zipfile.ZipFile(io.BytesIO(record.getvalue())) as z:
        entries = {n: z.read(n) for n in z.namelist()}
    pkl = next(n for n in entries if n.endswith("data.pkl"))
    entries[pkl] = entries[pkl].replace(b"ctorch\nuint16\n", b"ctorch\nfloat9_e9m9\n")
    assert b"float9_e9m9" in entries[pkl]
    patched = io.BytesIO()
    with zipfile.ZipFile(patched, "w", zipfile.ZIP_STORED) as z:
        for n, data in entries.items():
            z.writestr(n, data)
    with open(folder / info.relative_path, "ab") as f:
        offset = f.tell()
        f.write(patched.getvalue())
    info.offset, info.length = offset, len(patched.getvalue())
    (folder / ".metadata").write_bytes(pickle.dumps(metadata))
    status = checkpoint_status(ckpt)
    assert (
        status.may_be_complete
        and "torch.float9_e9m9" in status.unreadable
        and f"byte record '{key}'" in status.unreadable
    ), status


def test_a_metadata_file_claiming_more_than_the_limit_is_not_read(tmp_path):
    """An 8 KB sparse .metadata claiming 3 GB (a pickle opcode's length, then a hole) is refused unread by the checker
    and the merge: over the limit nothing is read into memory."""
    import resource

    from fsdp_recipes.ckpt.dcp_check import check_folder
    from fsdp_recipes.ckpt.dcp_pickles import METADATA_LIMIT

    folder = tmp_path / "pytorch_model_fsdp_0"
    folder.mkdir()
    with open(folder / ".metadata", "wb") as f:
        # BINBYTES8 of the claimed length
        f.write(b"\x80\x04\x8e" + (METADATA_LIMIT + 1).to_bytes(8, "little"))
        # a hole: nothing on disk
        f.truncate(METADATA_LIMIT + 64)
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    layout, problems = check_folder(folder)
    assert layout is None and problems == [
        f"unreadable {folder / '.metadata'} (1.0 GiB, over the 1 GiB this reader takes)"
    ]
    # KiB: nothing near the claim was read
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before < 200 << 10


@pytest.mark.parametrize("kind", ["oversized", "missing keys", "not a mapping", "as the Trainer writes"])
def test_rng_state_files_are_bounded_and_shaped_before_a_resume_uses_them(tmp_path, kind):
    """A sparse 3 GB rng_state_1.pth is not read whole nor called resumable, and one without the Trainer's keys is not
    chosen for the resume (rank 1 would die in the Trainer with KeyError: 'python')."""
    import random

    import numpy as np

    from fsdp_recipes.ckpt.checkpoint_files import LOADED_LIMIT, torch_file_problem

    path = tmp_path / "rng_state_1.pth"
    trainer_like = {"python": random.getstate(), "numpy": np.random.get_state(), "cpu": torch.get_rng_state()}
    if kind == "oversized":
        torch.save({**trainer_like, "pad": torch.zeros(LOADED_LIMIT + 1, dtype=torch.uint8)}, path)
    elif kind == "missing keys":
        torch.save({"cpu": torch.get_rng_state()}, path)
    elif kind == "not a mapping":
        torch.save([torch.get_rng_state()], path)
    else:
        torch.save(trainer_like, path)
    problem = torch_file_problem(path, load=True, keys=("python", "numpy", "cpu"))
    expected = {
        "oversized": "refused rng_state_1.pth: 16 MiB, where the Trainer writes a few KB",
        "missing keys": "refused rng_state_1.pth: not an RNG state the Trainer wrote (it needs python, numpy, cpu)",
        "not a mapping": "refused rng_state_1.pth: not an RNG state the Trainer wrote",
        "as the Trainer writes": None,
    }[kind]
    assert (problem is None) if expected is None else problem.startswith(expected), problem
