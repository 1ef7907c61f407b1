"""A problem of an accelerate config (``Problem``: level, file, key, what is wrong, the fix), the ``Checker`` that
collects them, and the small readers every rule shares: a YAML true/false (``as_bool``), a close match for a
misspelt key (``suggest``).
"""

from __future__ import annotations

import difflib
from dataclasses import dataclass

from fsdp_recipes.errors import bounded


@dataclass
class Problem:
    # "error" or "warning"
    level: str
    file: str
    # "" for a problem of the whole file
    key: str
    message: str
    fix: str

    def __str__(self) -> str:
        where = f"{self.file}: {self.key}" if self.key else self.file
        return bounded(f"{self.level}: {where}: {self.message}; fix: {self.fix}")


def suggest(key: str, valid, what: str = "keys") -> str:
    close = (
        difflib.get_close_matches(key, sorted(valid), n=1, cutoff=0.6)
        or sorted(v for v in valid if v.startswith(key))[:1]
    )
    return f"did you mean {close[0]}?" if close else f"valid {what}: {', '.join(sorted(valid))}"


def as_bool(value) -> bool | None:
    if isinstance(value, bool):
        return value
    if isinstance(value, str) and value.lower() in ("true", "false"):
        return value.lower() == "true"
    return None


class Checker:
    def __init__(self, path: str):
        self.path, self.problems = path, []

    def error(self, key, message, fix, file=None):
        self.problems.append(Problem("error", file or self.path, key, message, fix))

    def warn(self, key, message, fix, file=None):
        self.problems.append(Problem("warning", file or self.path, key, message, fix))


def errors(problems: list[Problem]) -> list[Problem]:
    return [p for p in problems if p.level == "error"]
