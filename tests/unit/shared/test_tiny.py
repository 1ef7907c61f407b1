"""The embedded default's files are what tools/make_tiny_assets.py generates, byte for byte."""

from __future__ import annotations

from conftest import REPO, cli


def test_regenerating_assets_gives_the_committed_bytes(tmp_path):
    assert cli("make_tiny_assets", ["--out", str(tmp_path)]) is None
    generated = sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*") if p.is_file())
    committed = sorted(p.relative_to(REPO / "assets") for p in (REPO / "assets").rglob("*") if p.is_file())
    assert generated == committed
    for rel in committed:
        assert (tmp_path / rel).read_bytes() == (REPO / "assets" / rel).read_bytes(), rel
