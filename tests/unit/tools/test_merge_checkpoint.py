"""tools/merge_checkpoint.py's size options (--max-shard-size, --memory-budget): a value that is no size, not
positive or below the option's minimum is argparse's one-line error before anything is read; sizes from the minimum
up, in any spelling huggingface_hub reads, are taken. A --base-model that can only be a local path and is not there
is said not to exist, before anything is read or asked of the hub."""

from __future__ import annotations

import pytest
from conftest import REPO, cli, one_line_error

NOT_SIZES = [
    "0",
    "1",
    "-5",
    "5",
    "",
    "  ",
    "nanGB",
    "NaNMB",
    "infGB",
    "-infMB",
    "1e400GB",
    "fiveGB",
    "5XB",
    "GB",
    "5 G B",
]
# 0.0001KB is 0 bytes as huggingface_hub reads it
NOT_POSITIVE = ["0KB", "-5GB", "-0.1MB", "0.0001KB"]
SIZE_OPTIONS = {"--max-shard-size": ("100KB", "99.999KB", "5GB"), "--memory-budget": ("64MB", "63.9MB", "512MB")}


@pytest.mark.parametrize("option", sorted(SIZE_OPTIONS))
@pytest.mark.parametrize("value", [*NOT_SIZES, *NOT_POSITIVE, "below the minimum"])
def test_merge_sizes_that_are_not_sizes(option, value, tmp_path, capsys):
    """argparse's exit 2, in one line naming the option and the value, before anything is read: neither a traceback
    nor a size taken (0KB would write a shard per tensor; -5GB would read every tensor alone)."""
    minimum, below, _ = SIZE_OPTIONS[option]
    value = below if value == "below the minimum" else value
    out = tmp_path / "out"
    assert cli("merge_checkpoint", [str(tmp_path / "ckpt"), str(out), f"{option}={value}"]) == 2
    line = one_line_error(capsys.readouterr().err, f"merge_checkpoint.py: error: argument {option}: {value!r} ")
    if value in NOT_POSITIVE:
        assert "is not positive: give at least" in line, line
    elif value == below:
        assert f"is below {minimum}: give at least {minimum}" in line, line
    else:
        assert "has no unit" in line or "is not a finite size" in line, line
    assert not out.exists()


@pytest.mark.parametrize("option", sorted(SIZE_OPTIONS))
def test_merge_sizes_from_the_minimum_up_are_taken(option, tmp_path, capsys):
    """The minimum, the default and a few spellings pass the parser: the run goes on to the input (missing here)."""
    minimum, _, default = SIZE_OPTIONS[option]
    for value in (minimum, default, default.lower(), f" {default} ", "1.5TB", "1e3GB"):
        assert cli("merge_checkpoint", [str(tmp_path / "missing"), str(tmp_path / "out"), f"{option}={value}"]) == 1
        assert "does not exist" in one_line_error(capsys.readouterr().err, "merge_checkpoint.py: error: ")


@pytest.fixture(scope="module")
def weights_only(tmp_path_factory):
    """A checkpoint of the tiny model's weights alone (no config.json): the merge takes its config from --base-model."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    folder = tmp_path_factory.mktemp("weights-only")
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(REPO / "assets" / "tiny-llama")).save_pretrained(folder)
    for name in ("config.json", "generation_config.json"):
        (folder / name).unlink()
    return folder


# names that can only be local paths (no hub id starts so, or has two slashes, or is under a folder that is here)
MISSING_PATHS = [
    "./missing",
    "../missing/model",
    "/no/such/model",
    "~/no-such-model-folder",
    "here/missing",
    "a/b/c",
    ".//x",
    "missing/",
    "org/name/",
]


@pytest.mark.parametrize("path", MISSING_PATHS)
def test_a_base_model_path_that_does_not_exist_is_said_so(weights_only, path, tmp_path, monkeypatch, capsys):
    """Exit 1, one line naming --base-model and "does not exist", not the hub's rule for repository ids."""
    work = tmp_path / "work" / "in"
    (work / "here").mkdir(parents=True)
    monkeypatch.chdir(work)
    out = tmp_path / "out"
    assert cli("merge_checkpoint", [str(weights_only), str(out), "--base-model", path]) == 1
    line = one_line_error(capsys.readouterr().err, "merge_checkpoint.py: error: ")
    assert f"--base-model {path} does not exist" in line and "Repo id" not in line, line
    assert not out.exists()


@pytest.mark.parametrize("name", ["", " ", "\t"])
def test_an_empty_base_model_is_named_as_empty(weights_only, name, tmp_path, capsys):
    out = tmp_path / "out"
    assert cli("merge_checkpoint", [str(weights_only), str(out), "--base-model", name]) == 1
    line = one_line_error(capsys.readouterr().err, "merge_checkpoint.py: error: ")
    assert "--base-model is empty" in line and "Repo id" not in line, line
    assert not out.exists()
