"""One-line messages from the training script's checks, printed once per launch. Standard library only.

Every rank parses the same arguments and runs the same checks before any process group exists, so a warning
would otherwise appear once per process: it is printed by global rank 0 alone (``RANK``, set by every launcher).
"""

from __future__ import annotations

import os
import sys


def rank0() -> bool:
    return os.environ.get("RANK", "0") == "0"


def say(message: str) -> None:
    """``train_fsdp.py: message`` on stderr, on global rank 0."""
    if rank0():
        print(f"train_fsdp.py: {message}", file=sys.stderr, flush=True)
