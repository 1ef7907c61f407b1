"""tests/helpers/argv_sequence.py under tests/helpers/train_with_fault.py's injections: the FSDP_* variables it reads,
set for the whole launch, act on every run of the sequence (FSDP_DUMP_EVAL: each evaluation's metrics, per rank).

    FSDP_DUMP_EVAL=DIR accelerate launch --config_file C tests/helpers/fault_sequence.py RUN.json...

Used through tests/helpers/launch_sequence.py."""

from __future__ import annotations

import runpy
import sys

# beside this file, which is first on sys.path when run as a script
import argv_sequence
import trl_recipe_sequence as sequence

# train_with_fault.py makes its injections as it is imported, then runs train_fsdp.py: here the sequence runs instead
run_path, runpy.run_path = runpy.run_path, lambda *args, **kwargs: {}
import train_with_fault  # noqa: E402, F401 (imported for its injections)

runpy.run_path = run_path

if __name__ == "__main__":
    sequence.parse_args = argv_sequence.parse_command_line
    sequence.leave(sys.argv[1:])
