"""Checkpoint files may come from anywhere: a pickle in any of them that would run code is refused, in one line,
by every reader (tools/check_checkpoint.py, tools/merge_checkpoint.py with and without --inspect, and the resume
path of train_fsdp.py), and nothing it names ever runs."""

from __future__ import annotations

import io
import os
import pickle
import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from conftest import REPO, cli, one_line_error, run

from fsdp_recipes.ckpt.readers import DCPSource
from fsdp_recipes.ckpt.resume import resolve_resume
from fsdp_recipes.errors import CheckpointError, RecipeError

TOOLS = REPO / "tools"


class Payload:
    """Unpickling this runs a shell command that creates ``marker``: proof that code ran."""

    def __init__(self, marker: Path):
        self.marker = str(marker)

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


def poison_metadata(folder: Path, marker: Path) -> None:
    metadata = dcp.FileSystemReader(str(folder)).read_metadata()
    # an attribute DCP's own pickle.load restores as it comes
    metadata.planner_data = Payload(marker)
    (folder / ".metadata").write_bytes(pickle.dumps(metadata))


@pytest.mark.parametrize("folder", ["pytorch_model_fsdp_0", "optimizer_0"])
def test_metadata_that_runs_code_is_refused_by_every_tool(run_dir, folder, tmp_path, capsys):
    ckpt = run_dir / "checkpoint-12"
    marker = tmp_path / "code-ran"
    poison_metadata(ckpt / folder, marker)
    # the payload is live: a plain unpickler runs it (what DCP's own reader would do)
    pickle.loads((ckpt / folder / ".metadata").read_bytes())
    assert marker.exists()
    marker.unlink()

    assert cli("check_checkpoint", [str(ckpt)]) == 1
    said = capsys.readouterr().out
    assert "refusing to unpickle it" in said and "posix.system" in said and len(said.strip().splitlines()) == 1, said
    # the merge reads only the model's folder
    if folder == "pytorch_model_fsdp_0":
        for argv in (
            [str(ckpt), str(tmp_path / "out")],
            [str(ckpt), "--inspect"],
            [str(run_dir), str(tmp_path / "out")],
        ):
            assert cli("merge_checkpoint", argv) == 1
            err = one_line_error(capsys.readouterr().err, "merge_checkpoint.py: error: ")
            assert "posix.system" in err and ("refusing to unpickle" in err or "no complete checkpoint" in err), err
        assert not (tmp_path / "out").exists()
    with pytest.raises(RecipeError, match="cannot resume from checkpoint-12 .*refusing to unpickle"):
        resolve_resume(str(ckpt), str(run_dir))
    assert not marker.exists()


@pytest.mark.parametrize("name", ["rng_state_1.pth", "scheduler.pt"])
def test_small_pickles_are_loaded_weights_only_before_a_resume(run_dir, name, tmp_path, capsys):
    ckpt = run_dir / "checkpoint-12"
    marker = tmp_path / "code-ran"
    torch.save({"state": Payload(marker)}, ckpt / name)
    assert cli("check_checkpoint", [str(ckpt)]) == 1
    assert f"refused {name}: it holds more than tensors" in capsys.readouterr().out
    with pytest.raises(RecipeError, match=f"refused {name}"):
        resolve_resume(str(ckpt), str(run_dir))
    assert not marker.exists()


def test_tensor_record_and_full_state_dict_that_run_code(tmp_path, capsys):
    """A .distcp record (DCP reads records with torch.load weights_only) and a pytorch_model_fsdp.bin."""
    marker = tmp_path / "code-ran"
    folder = tmp_path / "dcp"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        dcp.save({"model": {"w": torch.ones(4, 4)}}, checkpoint_id=str(folder), no_dist=True)
    metadata = dcp.FileSystemReader(str(folder)).read_metadata()
    record = io.BytesIO()
    torch.save(Payload(marker), record)
    (folder / "__0_0.distcp").write_bytes(record.getvalue())
    for index in metadata.storage_data:
        metadata.storage_data[index].offset, metadata.storage_data[index].length = 0, len(record.getvalue())
    (folder / ".metadata").write_bytes(pickle.dumps(metadata))
    with pytest.raises(
        CheckpointError, match=r"__0_0.distcp: tensor record 'model.w' names posix.system: refusing to unpickle"
    ):
        # every record is vetted before any is read
        DCPSource(folder)

    full = tmp_path / "full"
    full.mkdir()
    torch.save({"model.embed_tokens.weight": Payload(marker)}, full / "pytorch_model_fsdp.bin")
    assert (
        cli("merge_checkpoint", [str(full), str(tmp_path / "out"), "--base-model", str(REPO / "assets" / "tiny-llama")])
        == 1
    )
    err = one_line_error(capsys.readouterr().err, "merge_checkpoint.py: error: ")
    assert "names code (refused" in err, err
    assert not marker.exists() and not (tmp_path / "out").exists()


def test_checkpoint_tools_start_without_torch():
    """Reading names and layouts needs no torch: check_checkpoint.py --help and the modules training imports for
    them."""
    code = (
        "import runpy, sys\nsys.argv = ['check_checkpoint.py', '--help']\n"
        "try:\n    runpy.run_path({!r}, run_name='__main__')\nexcept SystemExit:\n    pass\n"
        "import fsdp_recipes.ckpt.status, fsdp_recipes.ckpt.layout, fsdp_recipes.ckpt.merge\n"
        "print(sorted({{m.split('.')[0] for m in sys.modules}} & {{'torch', 'transformers', 'accelerate'}}))\n"
    ).format(str(TOOLS / "check_checkpoint.py"))
    proc = run(["python", "-c", code])
    assert proc.returncode == 0 and "Report whether FSDP training checkpoints" in proc.stdout, proc.stderr
    assert proc.stdout.strip().splitlines()[-1] == "[]"
