"""The JSON a merge reads beside the shards (config.json, the manifest, a safetensors index, the tokenizer's) may be
anything: a
FIFO, /dev/zero, a 64 MB file, a list, a cut-off file, a bomb of nesting. Generated: each file x each kind, the
merge ends within seconds, with a merged folder or one line, never a hang, a traceback or a memory blow-up."""

from __future__ import annotations

import os
import shutil
import signal
from pathlib import Path

import pytest
from conftest import cli

from fsdp_recipes.bounded import JSON_LIMIT


def _fifo(p: Path):
    os.mkfifo(p)


def _zero(p: Path):
    p.symlink_to("/dev/zero")


def _oversize(p: Path):
    with open(p, "wb") as f:
        f.write(b'{"a": "' + b"x" * (JSON_LIMIT + 10) + b'"}')


KINDS = {
    "fifo": _fifo,
    "/dev/zero": _zero,
    "oversize": _oversize,
    "folder": lambda p: p.mkdir(),
    "list": lambda p: p.write_text("[1, 2, 3]"),
    "truncated": lambda p: p.write_text('{"model_type": "lla'),
    "nesting": lambda p: p.write_text("[" * 100_000 + "]" * 100_000),
    "huge int": lambda p: p.write_text('{"a": ' + "9" * 5000 + "}"),
    "binary": lambda p: p.write_bytes(b"\x00\xff" * 100),
    "null": lambda p: p.write_text("null"),
}


@pytest.fixture
def checkpoint(trained, tmp_path) -> Path:
    copy = tmp_path / "run" / "checkpoint-12"
    shutil.copytree(trained("accelerate_configs/zero3.yaml").output_dir / "checkpoint-12", copy)
    return copy


def _timed_cli(argv: list[str], seconds: int = 60) -> int:
    def too_slow(*_):
        raise TimeoutError(f"merge_checkpoint {argv} took over {seconds} s")

    old = signal.signal(signal.SIGALRM, too_slow)
    signal.alarm(seconds)
    try:
        return cli("merge_checkpoint", argv)
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)


@pytest.mark.parametrize("kind", sorted(KINDS))
@pytest.mark.parametrize(
    "name", ["config.json", "model_description.json", "model.safetensors.index.json", "tokenizer_config.json"]
)
def test_any_json_beside_the_weights_merges_or_is_one_line(checkpoint, tmp_path, name, kind, capsys):
    # a full (safetensors) checkpoint: the index names the shards
    if name == "model.safetensors.index.json":
        full = tmp_path / "full"
        assert _timed_cli([str(checkpoint), str(full)]) == 0
        (full / "model.safetensors").rename(full / "model-00001-of-00001.safetensors")
        checkpoint = full
    capsys.readouterr()
    target = checkpoint / name
    if target.exists():
        target.unlink()
    KINDS[kind](target)
    code = _timed_cli([str(checkpoint), str(tmp_path / "out")])
    captured = capsys.readouterr()
    assert "Traceback" not in captured.err
    # the manifest is optional: without a usable one, transformers checks the weights instead
    if code == 0:
        assert name == "model_description.json" and (tmp_path / "out" / "model.safetensors").is_file()
    else:
        lines = [line for line in captured.err.splitlines() if line.strip() and not line.startswith(("Writing", "\r"))]
        assert code == 1 and len(lines) == 1 and lines[0].startswith("merge_checkpoint.py: error: "), captured.err
        assert not (tmp_path / "out").exists()
