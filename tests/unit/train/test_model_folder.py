"""The final model in a folder of its own (output_dir/model/): only what from_pretrained and an upload need, put
there in one rename; what is already at that name is replaced only when it is a model folder; runs written
before (model files beside the checkpoints) still check, resume and merge."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time

import pytest
from conftest import FOREIGN, REPO, _model_folder, _snapshot, read_json

from fsdp_recipes.ckpt.layout import final_model_folder, foreign_entries
from fsdp_recipes.ckpt.resume import check_output_dir
from fsdp_recipes.config.model_source import model_source_problem
from fsdp_recipes.errors import RecipeError, RefusedRemoval
from fsdp_recipes.removal import is_ours, make_folder
from fsdp_recipes.train import model_folder
from fsdp_recipes.train.model_folder import EXPORT_STAGING, publish, publish_adapter

MODEL_FILES = ["config.json", "generation_config.json", "model.safetensors", "tokenizer.json"]


def _staging(out):
    staging = make_folder(out / ".export-tmp", EXPORT_STAGING)
    for name in MODEL_FILES:
        (staging / name).write_text("new")
    # what the parallel writers leave beside the model
    (staging / ".part-0.done").write_text("{}")
    # what the Trainer's save_model leaves
    (staging / "training_args.bin").write_text("pickle")
    return staging


@pytest.mark.parametrize("earlier", [None, "earlier export", "a model of the user's"])
def test_publish_makes_a_model_folder_holding_only_the_model(tmp_path, earlier):
    """An earlier export of this output_dir (its identity in fsdp_report.json, kept across runs) is replaced, none
    of its files lingering; a model folder of the user's put there (shaped the same, another folder) is moved aside."""
    out = tmp_path / "run"
    out.mkdir()
    (out / "fsdp_report.json").write_text("{}")
    # differently sharded
    if earlier == "earlier export":
        sharded = _staging(out)
        (sharded / "model.safetensors").rename(sharded / "model-00002-of-00002.safetensors")
        (sharded / "model-00001-of-00002.safetensors").write_text("old")
        publish(
            sharded,
            out,
            [*MODEL_FILES[:2], "model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors", MODEL_FILES[3]],
        )
    elif earlier:
        _model_folder(out / "model")
    final = publish(_staging(out), out, MODEL_FILES)
    assert final == out / "model" and sorted(p.name for p in final.iterdir()) == MODEL_FILES
    assert all((final / n).read_text() == "new" for n in MODEL_FILES)
    assert not (out / ".export-tmp").exists() and not is_ours(final, EXPORT_STAGING)
    kept = sorted(p.name for p in out.iterdir() if "kept" in p.name)
    assert kept == (["model.kept-2"] if earlier == "a model of the user's" else [])
    assert read_json(out / "fsdp_report.json")["published"]["model"][1] == final.stat().st_ino


def _recreated(model):
    """rm -rf model, then folders made until one gets the freed inode number (ext4 hands out the lowest free one in
    its group: a few mkdirs later), and that one, holding the same files, becomes model/."""
    files, freed = {p.name: p.read_bytes() for p in model.iterdir()}, model.stat().st_ino
    shutil.rmtree(model)
    made = []
    while len(made) < 1000 and not (made and made[-1].stat().st_ino == freed):
        made.append(model.with_name(f"mine-{len(made)}"))
        made[-1].mkdir()
    if made[-1].stat().st_ino != freed:
        pytest.skip("this filesystem did not hand the freed inode number to any of 1000 new folders")
    made.pop().rename(model)
    for folder in made:
        folder.rmdir()
    for name, data in files.items():
        (model / name).write_bytes(data)


def _same_size(file):
    file.write_text("m" * len(file.read_bytes()))


def _rewritten_in_place(file):
    """Other bytes of the same size written into the file, and its modification time put back (touch -d)."""
    st = file.stat()
    file.write_bytes(bytes(255 - b for b in file.read_bytes()))
    os.utime(file, ns=(st.st_atime_ns, st.st_mtime_ns))


# Ways a user's folder comes to stand where the export published one, and is theirs from then on. Each is moved
# aside whole by the next export, never deleted, though it holds nothing but model files.
TAKEN_OVER = {
    "deleted and made again (inode number reused)": _recreated,
    "a model file added": lambda m: (m / "model-00001-of-00002.safetensors").write_text("mine"),
    "a file rewritten, same size": lambda m: _same_size(m / "config.json"),
    "a file removed": lambda m: (m / "tokenizer.json").unlink(),
    "a file rewritten, its modification time set back": lambda m: _rewritten_in_place(m / "model.safetensors"),
    "the folder touched": lambda m: os.utime(m),
    "the folder chmod-ed": lambda m: os.chmod(m, 0o700),
}


@pytest.mark.parametrize("change", sorted(TAKEN_OVER))
def test_a_published_folder_changed_or_made_again_since_is_kept(tmp_path, change, caplog):
    """What the export may replace without asking is the very folder it published, untouched since: its (device,
    inode) alone would take a folder made after ours was deleted, which gets our freed inode number."""
    out = tmp_path / "run"
    out.mkdir()
    (out / "fsdp_report.json").write_text("{}")
    publish(_staging(out), out, MODEL_FILES)
    # a later change time than the publish's, on a filesystem that keeps them to the 10 ms
    time.sleep(0.01)
    inode = (out / "model").stat().st_ino
    TAKEN_OVER[change](out / "model")
    # what (device, inode) alone took for the published folder
    assert (out / "model").stat().st_ino == inode
    before = _snapshot(out / "model")
    assert publish(_staging(out), out, MODEL_FILES) == out / "model"
    # whole, nothing deleted
    assert _snapshot(out / "model.kept-2") == before
    assert "moved to model.kept-2 (nothing deleted)" in caplog.text
    # not "does not write"
    assert "is not the folder an export of this run published, as it left it" in caplog.text


# What someone can write into a folder just published, before its fingerprint is taken: content, for each folder kind
# (a chmod or touch of the folder itself holds nothing of theirs, and unmarking changes the folder anyway).
CONTENT_CHANGES = {
    "a file added": {
        "model": lambda m: (m / "model-00001-of-00002.safetensors").write_text("mine"),
        "adapter": lambda m: (m / "adapter_model-00001-of-00002.safetensors").write_text("mine"),
    },
    "a file rewritten, same size": {
        "model": lambda m: _same_size(m / "config.json"),
        "adapter": lambda m: _same_size(m / "adapter_config.json"),
    },
    "a file rewritten, its modification time set back": {
        "model": lambda m: _rewritten_in_place(m / "model.safetensors"),
        "adapter": lambda m: _rewritten_in_place(m / "adapter_model.safetensors"),
    },
    "a file removed": {
        "model": lambda m: (m / "tokenizer.json").unlink(),
        "adapter": lambda m: (m / "base_identity.json").unlink(),
    },
}


@pytest.mark.parametrize("change", sorted(CONTENT_CHANGES))
@pytest.mark.parametrize("kind", ["model", "adapter"])
def test_a_change_in_the_moment_after_the_rename_is_never_recorded_as_the_export_s(
    tmp_path, monkeypatch, kind, change, caplog
):
    """The fingerprint is taken before the rename into place and the unmarking: a file someone writes into model/ in
    those milliseconds (inotify sees the rename) is not recorded as the export's, and the next export does not delete
    it. Generated: each change made at that moment, for the model and the adapter folder; the next export keeps
    the folder aside whole."""
    out = tmp_path / "run"
    out.mkdir()
    (out / "fsdp_report.json").write_text("{}")
    real_unmark = model_folder.unmark

    def unmark_after_a_change(folder, purpose):
        CONTENT_CHANGES[change][kind](folder)
        real_unmark(folder, purpose)

    publish_one = (
        (lambda: publish(_staging(out), out, MODEL_FILES))
        if kind == "model"
        else (lambda: publish_adapter(_adapter_staging(out), out))
    )
    monkeypatch.setattr(model_folder, "unmark", unmark_after_a_change)
    publish_one()
    monkeypatch.setattr(model_folder, "unmark", real_unmark)
    assert kind not in read_json(out / "fsdp_report.json")["published"]
    before = _snapshot(out / kind)
    publish_one()
    assert _snapshot(out / f"{kind}.kept-2") == before and f"moved to {kind}.kept-2 (nothing deleted)" in caplog.text
    # and the export that published it untouched is replaced by the next
    publish_one()
    assert not (out / f"{kind}.kept-3").exists()


def _adapter_staging(out):
    staging = make_folder(out / ".adapter-tmp", EXPORT_STAGING)
    for name in ("adapter_config.json", "adapter_model.safetensors", "base_identity.json"):
        (staging / name).write_text("new")
    return staging


def test_a_published_folder_of_an_earlier_record_form_is_kept(tmp_path):
    """An fsdp_report.json written before the fingerprint (device and inode only) proves nothing: kept, not deleted."""
    out = tmp_path / "run"
    out.mkdir()
    _model_folder(out / "model")
    st = (out / "model").stat()
    (out / "fsdp_report.json").write_text(json.dumps({"published": {"model": [st.st_dev, st.st_ino]}}))
    before = _snapshot(out / "model")
    publish(_staging(out), out, MODEL_FILES)
    assert _snapshot(out / "model.kept-2") == before


@pytest.mark.parametrize("kind", sorted(FOREIGN))
def test_a_model_name_holding_anything_else_is_refused_before_the_run_and_moved_aside_at_the_export(
    tmp_path, kind, caplog
):
    """Every kind of folder that is not a model folder (a home, notes beside weights, a link, a forged marker), found
    at output_dir/model: the run stops before it starts; put there while the run trains, the export moves it to
    model.kept-2 (then model.kept-3) whole, said in one warning, and the model lands in model/, where everything
    looks: a finished run is never lost over it, nor a user's file."""
    out = tmp_path / "run"
    out.mkdir()
    FOREIGN[kind](out / "model")
    before = _snapshot(out / "model")
    assert any(e == "model" or e.startswith("model/") for e in foreign_entries(out))
    with pytest.raises(RecipeError, match=r"holds files a training run does not write \(model"):
        check_output_dir(str(out), resuming=False, overwrite=False)
    # (that kind's target beside it exists once)
    for n in (2, 3) if kind != "link to a model" else (2,):
        # again, where the model just published was
        if n == 3:
            (out / "model").rename(out / "published")
            FOREIGN[kind](out / "model")
            before = _snapshot(out / "model")
        final = publish(_staging(out), out, MODEL_FILES)
        assert final == out / "model" and sorted(p.name for p in final.iterdir()) == MODEL_FILES
        assert _snapshot(out / f"model.kept-{n}") == before
        warning = [r.getMessage() for r in caplog.records if f"model.kept-{n}" in r.getMessage()]
        assert len(warning) == 1 and "\n" not in warning[0] and f"{out / 'model'} held " in warning[0]
        assert f"moved to model.kept-{n} (nothing deleted); this export is in {out / 'model'}" in warning[0]
    assert not (out / ".export-tmp").exists()
    # a requeued or resumed run accepts the folder the export moved (a link it names: no link is part of a run)
    assert [e for e in foreign_entries(out) if "kept" in e] == (["model.kept-2"] if kind == "link to a model" else [])


def test_the_aside_name_is_never_one_that_exists_and_names_are_one_line(tmp_path, caplog):
    out = tmp_path / "run"
    out.mkdir()
    (out / "model").mkdir()
    # an escape sequence and a newline in a file name
    (out / "model" / "n\x1b[31m\nx.txt").write_text("mine")
    (out / "model.kept-2").mkdir()
    (out / "model.kept-3").symlink_to(tmp_path)
    (out / "model.kept-4").write_text("a file")
    assert publish(_staging(out), out, MODEL_FILES) == out / "model"
    assert (out / "model.kept-5" / "n\x1b[31m\nx.txt").read_text() == "mine"
    [warning] = [r.getMessage() for r in caplog.records if "kept-5" in r.getMessage()]
    assert "\x1b" not in warning and "\n" not in warning and "n\\x1b[31m\\nx.txt" in warning


def test_an_earlier_export_that_will_not_go_is_moved_aside_as_what_is_left(tmp_path, monkeypatch, caplog):
    import errno
    import shutil as shutil_module

    out = tmp_path / "run"
    out.mkdir()
    (out / "fsdp_report.json").write_text("{}")
    # an earlier export
    publish(_staging(out), out, MODEL_FILES)

    def fails(path, *args, **kwargs):
        raise OSError(errno.EPERM, "Operation not permitted", str(path))

    monkeypatch.setattr(shutil_module, "rmtree", fails)
    assert publish(_staging(out), out, MODEL_FILES) == out / "model"
    assert (out / "model.kept-2" / "config.json").read_text() == "new"
    assert "could not be removed (Operation not permitted), what is left of it: moved to model.kept-2" in caplog.text


# What a merge or the export never writes into model/: each one makes the folder someone's (a resume would delete it)
NOT_EXPORTED = {
    "notes.txt": lambda m: (m / "notes.txt").write_text("mine"),
    "adapter/": lambda m: ((m / "adapter").mkdir(), (m / "adapter" / "adapter_config.json").write_text("{}")),
    "trainer_state.json": lambda m: (m / "trainer_state.json").write_text("{}"),
    "adapter_config.json": lambda m: (m / "adapter_config.json").write_text("{}"),
    "adapter_model.safetensors": lambda m: (m / "adapter_model.safetensors").write_text("x"),
    "base_identity.json": lambda m: (m / "base_identity.json").write_text("{}"),
    "training_args.bin": lambda m: (m / "training_args.bin").write_text("pickle"),
    "README.md": lambda m: (m / "README.md").write_text("# my card"),
    "eval/": lambda m: ((m / "eval").mkdir(), (m / "eval" / "config.json").write_text("{}")),
}


@pytest.mark.parametrize("entry", sorted(NOT_EXPORTED))
def test_model_folder_shape_is_exactly_what_the_export_writes(tmp_path, entry):
    out = tmp_path / "run"
    _model_folder(out / "model")
    # the export's own folder: replaced by the next export
    assert foreign_entries(out) == []
    NOT_EXPORTED[entry](out / "model")
    before = _snapshot(out / "model")
    # named, so the user knows what to move
    assert foreign_entries(out) == [f"model/{entry}"]
    with pytest.raises(
        RecipeError,
        match=f"holds files a training run does not write \\(model/{entry}\\): .* move them out of output_dir",
    ):
        check_output_dir(str(out), resuming=True, overwrite=False)
    assert publish(_staging(out), out, MODEL_FILES) == out / "model"
    # moved aside, whole
    assert _snapshot(out / "model.kept-2") == before


def _exported_adapter(path):
    path.mkdir(parents=True)
    (path / "adapter_config.json").write_text("{}")
    (path / "adapter_model.safetensors").write_text("old")
    return path


ADAPTER_KINDS = {
    **FOREIGN,
    "a file": lambda p: p.write_text("not a folder"),
    "adapter+README.md": lambda p: (_exported_adapter(p), (p / "README.md").write_text("# my card")),
    "empty": lambda p: p.mkdir(),
}


@pytest.mark.parametrize("kind", sorted(ADAPTER_KINDS))
def test_an_adapter_name_holding_anything_else_is_refused_before_the_run_and_at_the_export(tmp_path, kind):
    out = tmp_path / "run"
    out.mkdir()
    ADAPTER_KINDS[kind](out / "adapter")
    before = _snapshot(out / "adapter") if (out / "adapter").is_dir() else (out / "adapter").read_text()
    # (a link's target lies beside it, as adapter-target)
    found = foreign_entries(out)
    assert len([e for e in found if e == "adapter" or e.startswith("adapter/")]) == 1, found
    with pytest.raises(RecipeError, match=r"holds files a training run does not write \(adapter"):
        check_output_dir(str(out), resuming=True, overwrite=False)
    staging = make_folder(out / ".adapter-tmp", EXPORT_STAGING)
    (staging / "adapter_config.json").write_text("{}")
    # and what was there moved aside, whole
    assert publish_adapter(staging, out) == out / "adapter"
    kept = out / "adapter.kept-2"
    assert (
        _snapshot(kept)
        if kept.is_dir() and not kept.is_symlink()
        else kept.read_text()
        if not kept.is_symlink()
        else _snapshot(kept)
    ) == before


def test_publish_adapter_replaces_an_earlier_export_and_keeps_only_adapter_files(tmp_path):
    out = tmp_path / "run"
    out.mkdir()
    (out / "fsdp_report.json").write_text("{}")
    # every run of ours writes it first
    (out / "run_args.json").write_text("{}")
    earlier = make_folder(out / ".adapter-tmp", EXPORT_STAGING)
    (earlier / "adapter_config.json").write_text("{}")
    # differently sharded
    (earlier / "adapter_model-00001-of-00002.safetensors").write_text("old")
    # an earlier export (its identity recorded)
    publish_adapter(earlier, out)
    assert foreign_entries(out) == []
    staging = make_folder(out / ".adapter-tmp", EXPORT_STAGING)
    for name in ("adapter_config.json", "adapter_model.safetensors", "README.md", "base_identity.json"):
        # README.md: the model card peft's save_pretrained writes
        (staging / name).write_text("new")
    adapter = publish_adapter(staging, out)
    assert sorted(p.name for p in adapter.iterdir()) == [
        "adapter_config.json",
        "adapter_model.safetensors",
        "base_identity.json",
    ]
    assert (adapter / "adapter_model.safetensors").read_text() == "new" and not (out / ".adapter-tmp").exists()
    # replaced, not moved aside
    assert not [p for p in out.iterdir() if "kept" in p.name]


def test_a_run_folder_given_as_the_model_points_at_its_model_folder_in_either_layout(tmp_path):
    import torch
    from safetensors.torch import save_file

    for name, old_layout in (("new", False), ("old", True)):
        run = tmp_path / name
        _model_folder(run / "model")
        # weights with a header: read as such now
        save_file({"w": torch.zeros(1)}, run / "model" / "model.safetensors")
        (run / "checkpoint-4").mkdir()
        # an earlier version's model at the top, resumed since: model/ is the newer one
        if old_layout:
            for file in MODEL_FILES:
                (run / file).write_text("{}")
        assert (
            model_source_problem(str(run), weights=True)
            == f"is a training run's folder: its final model is {run / 'model'}; give that"
        )
        assert model_source_problem(str(run / "model"), weights=True) is None


def test_check_checkpoint_on_a_finished_run_that_kept_no_checkpoint(tmp_path):
    done, started = tmp_path / "done", tmp_path / "started"
    _model_folder(done / "model")
    (done / "run_args.json").write_text("{}")
    started.mkdir()
    (started / "run_args.json").write_text("{}")
    results = {}
    for run in (done, started):
        proc = subprocess.run(
            [sys.executable, "tools/check_checkpoint.py", str(run)],
            cwd=REPO,
            capture_output=True,
            text=True,
            timeout=120,
        )
        results[run.name] = (proc.returncode, proc.stdout.strip().splitlines())
    assert results["done"] == (
        0,
        [
            f"{done}: no checkpoint-N folders (saved with save_strategy no, or none written yet): nothing to resume",
            f"final model: {done / 'model'}",
        ],
    )
    assert results["started"][0] == 1 and results["started"][1][-1] == "final model: none (the run has not finished)"
    proc = subprocess.run(
        [sys.executable, "tools/check_checkpoint.py", str(done), "--json"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0 and read_json_text(proc.stdout) == {
        "checkpoints": [],
        "resume_uses": None,
        "final_model": str(done / "model"),
        "training_now": None,
    }


def read_json_text(text):
    import json

    return json.loads(text)


def test_check_checkpoint_names_the_final_model_in_either_layout(tmp_path):
    new, old, unfinished = tmp_path / "new", tmp_path / "old", tmp_path / "unfinished"
    for run in (new, old, unfinished):
        (run / "checkpoint-4").mkdir(parents=True)
    _model_folder(new / "model")
    # as an earlier version left it: model files beside the checkpoints
    for name in MODEL_FILES:
        (old / name).write_text("{}")
    assert (
        final_model_folder(new) == new / "model"
        and final_model_folder(old) == old
        and final_model_folder(unfinished) is None
    )
    lines = {}
    for run in (new, old, unfinished):
        proc = subprocess.run(
            [sys.executable, "tools/check_checkpoint.py", str(run)],
            cwd=REPO,
            capture_output=True,
            text=True,
            timeout=120,
        )
        lines[run.name] = proc.stdout.strip().splitlines()[-1]
    assert lines == {
        "new": f"final model: {new / 'model'}",
        "old": f"final model: {old} (written by an earlier version, beside the checkpoints)",
        "unfinished": "final model: none yet (the run has not finished; tools/merge_checkpoint.py makes one "
        "from a checkpoint)",
    }


def test_a_run_folder_as_the_model_is_one_error_naming_its_model_folder(tmp_path):
    """The config checker says what the run's own check says, as its one error: the folder to give (not a warning
    that it "could not read the config" of the run folder's missing top-level config.json, nor "ok" for a folder
    that is no model)."""
    import yaml

    from fsdp_recipes.config.accelerate_config import check_settings

    run = tmp_path / "run"
    _model_folder(run / "model")
    (run / "run_args.json").write_text("{}")
    (run / "checkpoint-4").mkdir()
    raw = yaml.safe_load((REPO / "accelerate_configs" / "zero3.yaml").read_text())
    [said] = [p for p in check_settings(raw, "zero3.yaml", model=str(run)) if p.key == "model"]
    assert (
        said.level == "error"
        and "is a training run's folder" in said.message
        and f"its final model is {run / 'model'}" in said.fix
    )
    assert model_source_problem(str(run), weights=True).startswith("is a training run's folder")
    missing = [p for p in check_settings(raw, "zero3.yaml", model=str(tmp_path / "nothing-here")) if p.key == "model"]
    # a path that is nothing at all still warns
    assert missing and "could not read the config" in str(missing[0])


def test_a_folder_that_cannot_be_moved_aside_is_one_line(tmp_path, monkeypatch):
    """A mount point at output_dir/model (EBUSY): one line, the model left in its staging folder, nothing deleted."""
    import errno
    import os

    out = tmp_path / "run"
    out.mkdir()
    (out / "model").mkdir()
    (out / "model" / "notes.txt").write_text("mine")
    rename = os.rename

    def busy(src, dst):
        if str(src) == str(out / "model"):
            raise OSError(errno.EBUSY, os.strerror(errno.EBUSY), str(src))
        return rename(src, dst)

    monkeypatch.setattr(os, "rename", busy)
    staging = _staging(out)
    with pytest.raises(RefusedRemoval) as refused:
        publish(staging, out, MODEL_FILES)
    assert "\n" not in str(refused.value) and "cannot be moved aside (Device or resource busy)" in str(refused.value)
    assert (out / "model" / "notes.txt").read_text() == "mine" and (staging / "model.safetensors").is_file()


def test_the_files_a_run_without_fsdp_writes_are_a_runs_files(tmp_path):
    """The Trainer's save_model (DDP, ZeRO-1, --allow_no_fsdp) writes training_args.bin beside the model: a resume into
    that output_dir must not call it someone else's file."""
    for name in (
        "training_args.bin",
        "model.safetensors",
        "config.json",
        "run_args.json",
        ".run.lock",
        ".run.lock.owner",
    ):
        (tmp_path / name).write_text("x")
    assert foreign_entries(tmp_path) == []
    (tmp_path / "notes.txt").write_text("mine")
    assert foreign_entries(tmp_path) == ["notes.txt"]


def test_an_entry_of_a_run_s_name_that_is_not_a_file_or_folder_is_foreign(tmp_path):
    """Every name a run writes, as a FIFO, is named before anything opens it (rank 0 opening a FIFO named
    run_args.json would hang the resume for good); as a folder where a run writes a file, or the reverse, too."""
    import os

    names = ["run_args.json", "fsdp_report.json", "trainer_state.json", "loss.png", "checkpoint-4", "runs"]
    for name in names:
        folder = tmp_path / name.replace(".", "_")
        folder.mkdir()
        os.mkfifo(folder / name)
        assert foreign_entries(folder) == [f"{name} (not a regular file or folder)"], name
    # a folder named run_args.json would crash the run when it writes the file
    for name in names:
        folder = tmp_path / f"dir-{name}"
        (folder / name).mkdir(parents=True)
        want = (
            "a file where a run writes a folder"
            if name in ("checkpoint-4", "runs")
            else "a folder where a run writes a file"
        )
        if name in ("checkpoint-4", "runs"):
            (folder / name).rmdir()
            (folder / name).write_text("x")
        assert foreign_entries(folder) == [f"{name} ({want})"], (name, foreign_entries(folder))
    fine = tmp_path / "fine"
    (fine / "checkpoint-4").mkdir(parents=True)
    (fine / "run_args.json").write_text("{}")
    assert foreign_entries(fine) == []


def test_a_hard_linked_record_is_foreign_and_the_run_refused_before_it_writes(tmp_path):
    """A hard link named run_args.json (`cp -al run run.bak`, or one to any file) is never written through (a run
    rewriting its records would rewrite the other name's file). Generated over every file name a run writes at the top
    of
    output_dir: each, hard-linked, is named, and check_output_dir refuses the folder with that name and touches
    neither file. The same names as files of their own pass."""
    import os
    import re

    from fsdp_recipes.ckpt import layout
    from fsdp_recipes.ckpt.resume import check_output_dir
    from fsdp_recipes.errors import RecipeError

    # a name the pattern matches: its regex syntax made concrete
    def example(pattern: str) -> str:
        # first alternative
        name = re.sub(r"\(([^()|]*)\|[^()]*\)", r"\1", pattern)
        name = re.sub(r"\([^()]*\)\?", "", name).replace(r"\d+", "3").replace("\\", "")
        assert re.fullmatch(pattern, name), (pattern, name)
        return name

    names = sorted({example(r) for r in layout._RUN_FILES})
    assert "run_args.json" in names and "fsdp_report.json" in names and len(names) >= 8
    for name in names:
        elsewhere = tmp_path / f"backup-{name}"
        elsewhere.write_text("the other file")
        out = tmp_path / f"run-{name}"
        out.mkdir()
        if name != "run_args.json":
            (out / "run_args.json").write_text("{}")
        os.link(elsewhere, out / name)
        found = foreign_entries(out)
        assert [e for e in found if e.startswith(name + " ")] == [
            f"{name} (a hard link: writing it would change the other name's file too)"
        ], (name, found)
        with pytest.raises(RecipeError, match=re.escape(name)) as refused:
            check_output_dir(str(out), resuming=True, overwrite=False)
        assert (
            "\n" not in str(refused.value)
            and "hard link" in str(refused.value)
            and "file of its own" in str(refused.value)
        )
        # its own record, not named as if foreign
        assert "does not write" not in str(refused.value)
        assert elsewhere.read_text() == "the other file"
        os.unlink(out / name)
        (out / name).write_text("a file of its own")
        assert foreign_entries(out) == [], (name, foreign_entries(out))


@pytest.mark.parametrize("name", [".final-sharded", ".export-tmp", ".adapter-tmp", ".base-tmp"])
@pytest.mark.parametrize("kind", ["a user's folder", "an empty folder", "marked for another purpose", "ours"])
def test_a_folder_named_like_a_staging_folder_is_someones_unless_a_run_made_it(tmp_path, name, kind):
    """A staging name is a run's only with a run's marker for it: a user's own .export-tmp is refused by the
    output_dir check before training, not left for the export to find after it."""
    from fsdp_recipes.ckpt.layout import CHECKPOINT_PURPOSE, STAGING_FOLDERS
    from fsdp_recipes.removal import make_folder

    out = tmp_path / "run"
    out.mkdir()
    folder = out / name
    if kind == "ours":
        make_folder(folder, STAGING_FOLDERS[name])
    # a checkpoint-N of ours, renamed
    elif kind == "marked for another purpose":
        make_folder(folder, CHECKPOINT_PURPOSE)
    else:
        folder.mkdir()
        if kind == "a user's folder":
            (folder / "notes.txt").write_text("mine")
    found = foreign_entries(out)
    assert found == (
        [] if kind == "ours" else [f"{name} (named like a run's staging folder, but not one a run made)"]
    ), found
