"""The final model in a folder of its own (output_dir/model/): only what from_pretrained and an upload need, put
there in one rename; what is already at that name is replaced only when it is a model folder; runs written
before (model files beside the checkpoints) still check, resume and merge."""

from __future__ import annotations

import shutil
import subprocess
import sys

import pytest

from conftest import QUICK, REPO, launch, read_json
from fsdp_recipes.ckpt.layout import final_model_folder, foreign_entries
from fsdp_recipes.ckpt.resume import check_output_dir
from fsdp_recipes.errors import RecipeError, RefusedRemoval
from fsdp_recipes.removal import MARKER, is_ours, make_folder
from fsdp_recipes.train.export import EXPORT_STAGING, publish
from test_removal import FOREIGN, _model_folder, _snapshot

MODEL_FILES = ["config.json", "generation_config.json", "model.safetensors", "tokenizer.json"]


def _staging(out):
    staging = make_folder(out / ".export-tmp", EXPORT_STAGING)
    for name in MODEL_FILES:
        (staging / name).write_text("new")
    (staging / ".part-0.done").write_text("{}")  # what the parallel writers leave beside the model
    (staging / "training_args.bin").write_text("pickle")  # what the Trainer's save_model leaves
    return staging


@pytest.mark.parametrize("earlier", [None, "model folder"])
def test_publish_makes_a_model_folder_holding_only_the_model(tmp_path, earlier):
    out = tmp_path / "run"
    out.mkdir()
    if earlier:  # an earlier export of this run, differently sharded: none of its files may linger
        _model_folder(out / "model")
        (out / "model" / "model-00001-of-00002.safetensors").write_text("old")
    final = publish(_staging(out), out, MODEL_FILES)
    assert final == out / "model" and sorted(p.name for p in final.iterdir()) == MODEL_FILES
    assert all((final / n).read_text() == "new" for n in MODEL_FILES)
    assert not (out / ".export-tmp").exists() and not is_ours(final, EXPORT_STAGING)


@pytest.mark.parametrize("kind", sorted(FOREIGN))
def test_a_model_name_holding_anything_else_is_refused_before_the_run_and_at_the_export(tmp_path, kind):
    """Every kind of folder that is not a model folder (a home, notes beside weights, a link, a forged marker), found
    at output_dir/model: the run stops before it starts, and the export itself would refuse it, leaving it as it was."""
    out = tmp_path / "run"
    out.mkdir()
    FOREIGN[kind](out / "model")
    before = _snapshot(out / "model")
    assert "model" in foreign_entries(out)
    with pytest.raises(RecipeError, match=r"holds files a training run does not write \(model"):
        check_output_dir(str(out), resuming=False, overwrite=False)
    staging = _staging(out)
    with pytest.raises(RefusedRemoval, match=str(out / "model")):
        publish(staging, out, MODEL_FILES)
    assert _snapshot(out / "model") == before
    assert (staging / "model.safetensors").is_file()  # the new model is still there, in its marked staging folder


def test_check_checkpoint_names_the_final_model_in_either_layout(tmp_path):
    new, old, unfinished = tmp_path / "new", tmp_path / "old", tmp_path / "unfinished"
    for run in (new, old, unfinished):
        (run / "checkpoint-4").mkdir(parents=True)
    _model_folder(new / "model")
    for name in MODEL_FILES:  # as an earlier version left it: model files beside the checkpoints
        (old / name).write_text("{}")
    assert final_model_folder(new) == new / "model" and final_model_folder(old) == old and final_model_folder(unfinished) is None
    lines = {}
    for run in (new, old, unfinished):
        proc = subprocess.run([sys.executable, "tools/check_checkpoint.py", str(run)], cwd=REPO, capture_output=True, text=True, timeout=120)
        lines[run.name] = proc.stdout.strip().splitlines()[-1]
    assert lines == {
        "new": f"final model: {new / 'model'}",
        "old": f"final model: {old} (written by an earlier version, beside the checkpoints)",
        "unfinished": "final model: none yet (the run has not finished; tools/merge_checkpoint.py makes one from a checkpoint)",
    }


@pytest.mark.slow
def test_a_run_folder_of_the_earlier_layout_resumes_and_gets_its_model_folder(trained, tmp_path):
    """An earlier version's run (model files at the top of output_dir, a .run.lock file): resumed at its last
    checkpoint, it exports into model/ the same weights, leaves the old files as they were, and adds no lock file."""
    from safetensors.torch import load_file

    config = "accelerate_configs/zero3.yaml"
    reference = trained(config)
    out = tmp_path / "run"
    shutil.copytree(reference.output_dir, out, ignore=shutil.ignore_patterns("model"))
    for entry in reference.model_dir.iterdir():
        shutil.copy(entry, out / entry.name)
    (out / ".run.lock").write_text("host old, pid 1, since 2026-01-01 00:00:00\n")
    old = _snapshot(out)
    resumed = launch(config, *QUICK, "--output_dir", str(out), "--resume_from_checkpoint", "true")
    assert f"model saved to {out / 'model'} (only the model" in resumed.stdout
    assert sorted(set(_snapshot(out)) - set(old)) == sorted(["model", *(f"model/{p.name}" for p in reference.model_dir.iterdir())])
    assert (out / ".run.lock").read_text().startswith("host old")  # not ours to delete
    final, expected = load_file(out / "model" / "model.safetensors"), load_file(reference.model_dir / "model.safetensors")
    assert set(final) == set(expected) and all(final[k].equal(expected[k]) for k in expected)
    assert read_json(out / "model" / "config.json") == read_json(reference.model_dir / "config.json")
    assert MARKER not in {p.name for p in (out / "model").iterdir()}
    # the merge tool and the checker read either layout's run folder by its checkpoints
    merged = subprocess.run([sys.executable, "tools/merge_checkpoint.py", str(out), str(tmp_path / "merged")], cwd=REPO,
                            capture_output=True, text=True, timeout=300)
    assert merged.returncode == 0 and "using checkpoint-12" in merged.stdout + merged.stderr, merged.stderr[-2000:]
    again = load_file(tmp_path / "merged" / "model.safetensors")
    assert all(again[k].equal(final[k]) for k in final)
    checked = subprocess.run([sys.executable, "tools/check_checkpoint.py", str(out)], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert checked.returncode == 0 and checked.stdout.strip().endswith(f"final model: {out / 'model'}")
