"""Train several runs one after another in the same processes, each given by its train_fsdp.py command line: one
launch for several runs on one accelerate config, where one launch each would pay the start-up of torch,
transformers and the process group every time.

    accelerate launch --config_file accelerate_configs/zero3.yaml tests/helpers/argv_sequence.py RUN.json...

Each RUN.json holds the arguments train_fsdp.py would have been given, as a JSON list of strings: they are parsed as
that command line is (flags over the embedded default recipe when no recipe comes first), so a run here is the run
of that command. Everything else is tests/helpers/trl_recipe_sequence.py's: accelerate's state reset between runs,
rank 0's ``=== RECIPE RUN.json`` line before each run's output and its ``RUN.json.result.json``. Used through
tests/helpers/launch_sequence.py (SEQUENCE)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

# beside this file, which is first on sys.path when run as a script
import trl_recipe_sequence as sequence

from fsdp_recipes.config.parse import parse_args


def parse_command_line(argv: list[str]):
    """``[RUN.json]`` -> parse_args of the command line it holds."""
    [path] = argv
    return parse_args(json.loads(Path(path).read_text()))


if __name__ == "__main__":
    # its loop, its reset and its results; only the parsing is ours
    sequence.parse_args = parse_command_line
    sequence.leave(sys.argv[1:])
