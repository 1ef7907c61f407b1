"""One-line messages from the training script's checks, printed once per launch, and the help formatter of every
tool's ``--help``. Standard library only.

Every rank parses the same arguments and runs the same checks before any process group exists, so a warning
would otherwise appear once per process: it is printed by global rank 0 alone (``RANK``, set by every launcher).
"""

from __future__ import annotations

import argparse
import os
import sys

from fsdp_recipes.errors import bounded


def rank0() -> bool:
    return os.environ.get("RANK", "0") == "0"


def say(message: str) -> None:
    """``train_fsdp.py: message`` on stderr, on global rank 0."""
    if rank0():
        print(f"train_fsdp.py: {message}", file=sys.stderr, flush=True)


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """``--help`` of every tool: each option's default shown once. argparse's ArgumentDefaultsHelpFormatter appends
    "(default: X)" to every help text, also to one that states its default in words: "(default: keep the saved
    dtype) (default: None)". A help text that says "(default ...)" itself keeps only that."""

    def _get_help_string(self, action):
        text = action.help or ""
        return text if "(default" in text else super()._get_help_string(action)


class RawHelpFormatter(argparse.RawDescriptionHelpFormatter, HelpFormatter):
    """HelpFormatter keeping the description and epilog as written (a docstring's formula, a table)."""


class OneLineParser(argparse.ArgumentParser):
    """A tool's parser whose usage errors are one line (argparse prints its usage first), within errors.bounded,
    with exit code 2 as argparse's."""

    def error(self, message):
        self.exit(2, bounded(f"{self.prog}: error: {message}: see {self.prog} --help") + "\n")
