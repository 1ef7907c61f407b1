"""Every tool's and benchmark's ``--help`` (all tools/*.py and bench/*.py found, not a list): every option has a
help text, and no option shows its default twice ("(default: keep the saved dtype) (default: None)")."""

from __future__ import annotations

import argparse
import re
import runpy
import sys

import pytest
from conftest import REPO

# Every script that runs as a command (bench/step_times.py and synthetic.py are modules the others import).
SCRIPTS = sorted(
    p
    for p in [*(REPO / "tools").glob("*.py"), *(REPO / "bench").glob("*.py")]
    if '__name__ == "__main__"' in p.read_text()
)


def parser_of(script, monkeypatch, capsys) -> argparse.ArgumentParser:
    """The parser the script builds, as ``python script --help`` runs it (in this process: no interpreter start)."""
    seen = []
    real = argparse.ArgumentParser.print_help
    monkeypatch.setattr(
        argparse.ArgumentParser, "print_help", lambda self, file=None: (seen.append(self), real(self, file))
    )
    monkeypatch.setattr(sys, "argv", [str(script), "--help"])
    monkeypatch.syspath_prepend(str(script.parent))
    with pytest.raises(SystemExit) as stop:
        runpy.run_path(str(script), run_name="__main__")
    assert stop.value.code in (0, None) and seen, f"{script.name} --help did not print its help"
    capsys.readouterr()
    return seen[-1]


def test_finds_the_tools():
    assert {"merge_checkpoint.py", "estimate_memory.py", "scaling.py"} <= {p.name for p in SCRIPTS}


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: f"{p.parent.name}/{p.name}")
def test_every_option_has_help_and_one_default(script, monkeypatch, capsys):
    parser = parser_of(script, monkeypatch, capsys)
    silent = [
        a.option_strings[0] if a.option_strings else a.dest
        for a in parser._actions
        if a.help != argparse.SUPPRESS and not (a.help or "").strip()
    ]
    assert silent == [], f"{script.name}: options without a help text: {silent}"
    formatter = parser._get_formatter()
    hidden = [
        a.option_strings[0]
        for a in parser._actions
        if a.option_strings
        and a.help != argparse.SUPPRESS
        and a.default not in (None, False, argparse.SUPPRESS)
        and a.nargs != 0
        and "(default" not in formatter._expand_help(a)
        if a.help
    ]
    assert hidden == [], f"{script.name}: options whose default is not shown: {hidden}"
    text = " ".join(parser.format_help().split())
    assert not re.search(r"\(default[^()]*(\([^()]*\)[^()]*)*\)\s*\(default", text), (
        f"{script.name}: a default shown twice"
    )
