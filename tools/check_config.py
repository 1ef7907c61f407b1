"""Check an accelerate FSDP config, optionally with a recipe and a model, and report every problem at once.

    python tools/check_config.py accelerate_configs/zero3.yaml
    python tools/check_config.py my_config.yaml --recipe recipes/tiny-llama/pretrain.yaml --model assets/tiny-llama

Exit status 1 when there is an error; warnings (settings that work but cost) are printed and exit 0.
"""

import argparse
import sys

from fsdp_recipes.config.accelerate_config import check_config
from fsdp_recipes.config.problems import errors
from fsdp_recipes.console import RawHelpFormatter


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__.splitlines()[0],
        formatter_class=RawHelpFormatter,
        epilog="Errors: unknown or misspelled keys, wrong values, FSDP1 keys under fsdp_version 2 and the "
        "reverse, settings that cannot work together, a wrap class the model lacks, process counts "
        "that do not fit. Warnings: offload, BACKWARD_POST, FULL_STATE_DICT on large models, fp16, "
        "keys accelerate ignores.",
    )
    parser.add_argument("config", nargs="+", help="accelerate config YAML file(s)")
    parser.add_argument("--recipe", help="training recipe YAML (checked together with the config)")
    parser.add_argument("--model", help="hub id, local folder or config.json: only its config is read (meta device)")
    args = parser.parse_args(argv)
    failed = False
    for config in args.config:
        problems = check_config(config, args.recipe, args.model)
        for problem in problems:
            print(problem, file=sys.stderr if problem.level == "error" else sys.stdout)
        failed |= bool(errors(problems))
        if not problems:
            print(f"ok: {config}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
