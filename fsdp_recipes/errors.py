"""The exception types every part of the package raises, in one place, so each product can name another's
errors without importing it. Standard library only.

Every one of them carries a whole one-line message: the problem and the fix. ``train_fsdp.py`` and the tools print
that line and exit non-zero (2 for bad input); none of them is a traceback a user should have to read.
``one_line`` makes outside text (a file name, a lock file's line) fit such a message; ``bounded`` keeps it short
enough to read whatever value it quotes.
"""

from __future__ import annotations

import os

# The longest line: a value quoted from a flag or a file can be any length (100,000 characters echoed in full
# buried the fix); an honest message, with its choices or a list of names, fits well within this. An error's own
# message leaves room for the name of the tool that prints it, so that the line needs no second cut.
MESSAGE_LIMIT = 2000
PREFIX_ROOM = 100


def bounded(message: str, limit: int = MESSAGE_LIMIT) -> str:
    """``message`` within ``limit``: past it, the middle is left out and says how much, so that the start (what is
    wrong) and the end (the fix) are both kept."""
    if len(message) <= limit:
        return message
    keep = (limit - 40) // 2
    return f"{message[:keep]} [... {len(message) - 2 * keep} characters ...] {message[-keep:]}"


class _Bounded:
    """Every error type below: its message is ``bounded``, with room for a tool's prefix, wherever it is printed."""

    # One message, no further arguments: an exception's str() of several arguments is their tuple, unbounded.
    def __init__(self, message=""):
        super().__init__(bounded(str(message), MESSAGE_LIMIT - PREFIX_ROOM))


class RecipeError(_Bounded, ValueError):
    """A recipe, flag or input that cannot work; raised before any process group or model is set up."""


class CheckpointError(_Bounded, ValueError):
    """A checkpoint or model folder that cannot be read or written as asked: the message names the problem and the
    fix."""


class RefusedRemoval(_Bounded, ValueError):
    """A path this project did not make, or not in a shape it may replace: left as it is (fsdp_recipes.removal)."""


class NotShardedError(_Bounded, RuntimeError):
    """The accelerate config asked for FSDP but the prepared model is not FSDP-wrapped as configured."""


class InternalsChanged(_Bounded, RuntimeError):
    """A private symbol this repository relies on is not in the installed library (fsdp_recipes.compat.internals)."""


class UnreadableFile(_Bounded, ValueError):
    """A file refused before or while reading it. ``str()`` is the whole one-line message (the file, the problem,
    the fix); ``reason`` and ``fix`` are its parts, for callers that name the file their own way. Callers with an
    error type of their own (RecipeError, a checker's problem list) catch this and pass the message on."""

    def __init__(self, path: str | os.PathLike, what: str, reason: str, fix: str):
        super().__init__(f"{what} {str(path)!r} {reason}: {fix}")
        self.path, self.what, self.reason, self.fix = str(path), what, reason, fix

    # pickle and copy (a worker process's error) call __init__ with these, not the message
    def __reduce__(self):
        return type(self), (self.path, self.what, self.reason, self.fix)


class UnknownToThisVersion(CheckpointError):
    """A checkpoint file names a dtype or class the installed torch does not know: another torch version wrote it,
    and the checkpoint may well be complete. It is never called incomplete, passed over, set aside or deleted for
    that; what reads it stops with this one line instead. ``reason`` is the line without its verdict and fix."""

    FIX = "use the torch version that wrote it"

    def __init__(self, path: str | os.PathLike, what: str, kind: str, version: str):
        self.path, self.what, self.kind, self.version = str(path), what, kind, version
        self.reason = f"{self.path} names {what}, a {kind} torch {version} does not know"
        super().__init__(
            f"unreadable by this version: {self.reason}; another torch version wrote it, and it may be "
            f"complete: {self.FIX}"
        )

    def __reduce__(self):
        return type(self), (self.path, self.what, self.kind, self.version)

    def at(self, path: str | os.PathLike) -> UnknownToThisVersion:
        """The same error, naming the file it was found in."""
        return UnknownToThisVersion(path, self.what, self.kind, self.version)


def one_line(text: str) -> str:
    """``text`` fit for a one-line message: control characters and non-ASCII escaped (a file name, a lock file's
    text)."""
    return "".join(c if c.isprintable() and c.isascii() else ascii(c)[1:-1] for c in text)
