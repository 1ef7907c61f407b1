"""The files a training run writes beside a checkpoint's shards (config.json, generation config, tokenizer, chat
template; model_description.json records each one's hash when the save completes) are part of the checkpoint as the
run left it. One deleted, cut short or changed since is a problem for check_checkpoint and the resume, and the merge
refuses it, each naming the file and the fix (taken as it was, a deleted config.json would let a resume build the
model from whatever config it was given, a truncated chat_template.jinja be copied into the merged folder); generated
over every recorded file and four ways of changing it."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from conftest import REPO, cli, one_line_error, run_dir  # noqa: F401 (run_dir: the fixture)

from fsdp_recipes.ckpt.resume import resolve_resume
from fsdp_recipes.errors import RecipeError

# the config the run was built from
TINY_DIR = REPO / "assets" / "tiny-llama"
RECORDED = ["chat_template.jinja", "config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json"]


def deleted(path: Path) -> None:
    path.unlink()


def cut_short(path: Path) -> None:
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])


def one_byte_changed(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x01
    path.write_bytes(bytes(data))


def made_a_folder(path: Path) -> None:
    path.unlink()
    path.mkdir()


CHANGES = [deleted, cut_short, one_byte_changed, made_a_folder]


def test_the_run_records_these_files_as_it_left_them(run_dir):  # noqa: F811
    manifest = json.loads((run_dir / "checkpoint-12" / "model_description.json").read_text())
    assert sorted(manifest["files"]) == RECORDED
    assert cli("check_checkpoint", [str(run_dir / "checkpoint-12")]) == 0


@pytest.mark.parametrize("change", CHANGES, ids=lambda f: f.__name__)
@pytest.mark.parametrize("name", RECORDED)
def test_a_recorded_file_changed_since_is_named_by_the_check_the_resume_and_the_merge(
    run_dir,  # noqa: F811 (the fixture)
    name,
    change,
    tmp_path,
    capsys,  # noqa: F811 (the fixture)
):
    ckpt = run_dir / "checkpoint-12"
    change(ckpt / name)
    said = (
        f"{name} is {'missing' if change is deleted else 'not as the run wrote it'} "
        "(checkpoint-12/model_description.json records the hash"
    )

    assert cli("check_checkpoint", [str(ckpt)]) == 1
    out = capsys.readouterr().out
    assert said in out and len(out.strip().splitlines()) == 1, out
    with pytest.raises(RecipeError, match=f"cannot resume from checkpoint-12 .*{name}"):
        resolve_resume(str(ckpt), str(run_dir))
    # the merge's own check of its description files names it first
    if change is made_a_folder:
        assert cli("merge_checkpoint", [str(ckpt), str(tmp_path / "out")]) == 1
        assert "is not a regular file" in one_line_error(capsys.readouterr().err, "merge_checkpoint.py: error: ")
        return
    # a file gone is no tampering: the merge goes on, and names it
    if change is deleted and name != "config.json":
        code = cli("merge_checkpoint", [str(ckpt), str(tmp_path / "out")])
        captured = capsys.readouterr()
        assert f"lacks {name}, which the run wrote there" in captured.out, captured
        # the rest of the tokenizer does not load without it: one line
        if name == "tokenizer.json":
            assert code == 1 and "cannot load the tokenizer" in captured.err.splitlines()[-1], captured.err
        else:
            assert code == 0 and (tmp_path / "out" / "model.safetensors").is_file(), captured.err
        return
    assert cli("merge_checkpoint", [str(ckpt), str(tmp_path / "out")]) == 1
    err = one_line_error(capsys.readouterr().err, "merge_checkpoint.py: error: ")
    assert said in err and "remove model_description.json from it" in err, err
    assert not (tmp_path / "out").exists()


@pytest.mark.slow
def test_config_from_base_model_and_a_removed_record_let_the_merge_go_on(run_dir, tmp_path, capsys):  # noqa: F811
    """The two ways past it the message names or implies: --base-model gives config.json and generation config (a
    changed one in the checkpoint no longer matters; a changed tokenizer file still does), and without
    model_description.json the checkpoint is taken as it is."""
    ckpt = run_dir / "checkpoint-12"
    config = json.loads((ckpt / "config.json").read_text())
    # edited (transformers reads it for the tokenizer too)
    (ckpt / "config.json").write_text(json.dumps({**config, "rms_norm_eps": 0.1}))
    assert cli("merge_checkpoint", [str(ckpt), str(tmp_path / "a"), "--base-model", str(TINY_DIR)]) == 0, (
        capsys.readouterr().err
    )
    # the base's
    assert json.loads((tmp_path / "a" / "config.json").read_text())["rms_norm_eps"] == config["rms_norm_eps"]
    cut_short(ckpt / "chat_template.jinja")
    assert cli("merge_checkpoint", [str(ckpt), str(tmp_path / "b"), "--base-model", str(TINY_DIR)]) == 1
    assert "chat_template.jinja is not as the run wrote it" in capsys.readouterr().err
    shutil.copy(TINY_DIR / "config.json", ckpt / "config.json")
    (ckpt / "model_description.json").unlink()
    assert cli("merge_checkpoint", [str(ckpt), str(tmp_path / "c")]) == 0, capsys.readouterr().err


@pytest.mark.parametrize("how", ["a fifo", "a folder", "cut short", "no files list"])
def test_a_record_that_is_itself_damaged_is_named_too(run_dir, how, capsys):  # noqa: F811
    """model_description.json itself damaged (a FIFO, ...) is named: the check never skips the seal and says
    resumable."""
    import os

    manifest = run_dir / "checkpoint-12" / "model_description.json"
    data = manifest.read_bytes()
    manifest.unlink()
    if how == "a fifo":
        os.mkfifo(manifest)
    elif how == "a folder":
        manifest.mkdir()
    elif how == "cut short":
        manifest.write_bytes(data[: len(data) // 2])
    else:
        manifest.write_text(json.dumps({**json.loads(data), "files": None}))
    assert cli("check_checkpoint", [str(run_dir / "checkpoint-12")]) == 1
    out = capsys.readouterr().out
    assert "checkpoint-12/model_description.json is unreadable" in out and len(out.strip().splitlines()) == 1, out


# model_description.json's "files" (file name -> SHA-256) of another shape: (its value, the words naming what it is)
WRONG_FILES = {
    "null": (None, 'its "files" is null'),
    "a list": (["config.json"], 'its "files" is a list'),
    "an empty list": ([], 'its "files" is a list'),
    "a string": ("config.json", 'its "files" is a string'),
    "a number": (3, 'its "files" is a number'),
    "true": (True, 'its "files" is true/false'),
    "a number for a digest": ({"config.json": 3}, "its \"files\" gives 'config.json' a number"),
    "null for a digest": ({"config.json": None}, "its \"files\" gives 'config.json' null"),
    "a list for a digest": ({"config.json": ["ab"]}, "its \"files\" gives 'config.json' a list"),
    "no files key": (KeyError, 'it has no "files"'),
    **{
        f"a path for a name: {name}": ({"config.json": "ab", name: "cd"}, f'its "files" names {name!r}')
        for name in ("../config.json", "/etc/passwd", "sub/config.json", "..", ".", "", "a\\b", "x\0y")
    },
}


@pytest.mark.parametrize("case", WRONG_FILES)
def test_a_record_whose_files_are_of_another_type_names_the_key_and_the_type(tmp_path, case):
    """Not "unreadable (TypeError)": the line names the key, what it holds, and what it should."""
    from fsdp_recipes.ckpt.description import read_files, recorded_changes

    ckpt = tmp_path / "checkpoint-2"
    ckpt.mkdir()
    shutil.copy(TINY_DIR / "config.json", ckpt / "config.json")
    value, said = WRONG_FILES[case]
    record = {"format": 1, "model_class": "LlamaForCausalLM", "tied": [], "weights": {}}
    if value is not KeyError:
        record["files"] = value
    (ckpt / "model_description.json").write_text(json.dumps(record))
    line = recorded_changes(read_files(ckpt, (ckpt,)))
    assert line is not None and "\n" not in line and said in line, line
    assert "Error)" not in line and "mapping of file names to SHA-256 digests" in line, line
    assert "remove model_description.json" in line, line
