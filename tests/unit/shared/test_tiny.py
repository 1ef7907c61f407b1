"""The embedded default's files are what tools/make_tiny_assets.py generates, byte for byte; a folder it cannot
write is one line and exit 1."""

from __future__ import annotations

import pytest
from conftest import REPO, cli, one_line_error


def test_regenerating_assets_gives_the_committed_bytes(tmp_path):
    assert cli("make_tiny_assets", ["--out", str(tmp_path)]) == 0
    generated = sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*") if p.is_file())
    committed = sorted(p.relative_to(REPO / "assets") for p in (REPO / "assets").rglob("*") if p.is_file())
    assert generated == committed
    for rel in committed:
        assert (tmp_path / rel).read_bytes() == (REPO / "assets" / rel).read_bytes(), rel


@pytest.mark.parametrize("where", ["a file", "under a file", "/proc"])
def test_an_out_folder_that_cannot_be_written_is_one_line(tmp_path, capsys, where):
    blocker = tmp_path / "file"
    blocker.write_text("kept\n")
    out = {"a file": blocker, "under a file": blocker / "deeper", "/proc": "/proc/no-such-folder"}[where]
    assert cli("make_tiny_assets", ["--out", str(out)]) == 1
    one_line_error(capsys.readouterr().err, f"make_tiny_assets.py: error: cannot write to --out {out}: ")
    assert blocker.read_text() == "kept\n"
