"""A run folder an earlier version wrote (the model's files at the top of output_dir, a .run.lock file) resumes in a
real launch: the export goes into model/, the old files stay as they were, and the merge tool and the checker read
the folder by its checkpoints."""

from __future__ import annotations

import shutil
import subprocess
import sys

import pytest
from conftest import QUICK, REPO, _snapshot, launch, read_json

from fsdp_recipes.removal import MARKER


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
    assert (
        f"{out} still holds the model an earlier version of this repository wrote at its top level"
        in resumed.stdout + resumed.stderr
    )
    assert sorted(set(_snapshot(out)) - set(old)) == sorted(
        ["model", *(f"model/{p.name}" for p in reference.model_dir.iterdir())]
    )
    # not ours to delete
    assert (out / ".run.lock").read_text().startswith("host old")
    final, expected = (
        load_file(out / "model" / "model.safetensors"),
        load_file(reference.model_dir / "model.safetensors"),
    )
    assert set(final) == set(expected) and all(final[k].equal(expected[k]) for k in expected)
    assert read_json(out / "model" / "config.json") == read_json(reference.model_dir / "config.json")
    assert MARKER not in {p.name for p in (out / "model").iterdir()}
    # the merge tool and the checker read either layout's run folder by its checkpoints
    merged = subprocess.run(
        [sys.executable, "tools/merge_checkpoint.py", str(out), str(tmp_path / "merged")],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert merged.returncode == 0 and "using checkpoint-12" in merged.stdout + merged.stderr, merged.stderr[-2000:]
    again = load_file(tmp_path / "merged" / "model.safetensors")
    assert all(again[k].equal(final[k]) for k in final)
    checked = subprocess.run(
        [sys.executable, "tools/check_checkpoint.py", str(out)], cwd=REPO, capture_output=True, text=True, timeout=120
    )
    assert checked.returncode == 0 and checked.stdout.strip().endswith(f"final model: {out / 'model'}")
