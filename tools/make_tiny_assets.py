"""Regenerate the embedded default's files under assets/: corpus, chat data, tokenizer, model config.

    python tools/make_tiny_assets.py            # rewrites assets/
    python tools/make_tiny_assets.py --out DIR  # writes elsewhere (tests compare it with assets/)

Deterministic: the same versions give the same bytes. Takes a few seconds; nothing is downloaded.
"""

import argparse
from pathlib import Path

from fsdp_recipes.console import HelpFormatter
from fsdp_recipes.tiny import ASSETS, build_all


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0], formatter_class=HelpFormatter)
    parser.add_argument("--out", type=Path, default=ASSETS, help=f"folder to write into (default: {ASSETS})")
    args = parser.parse_args(argv)
    for path in build_all(args.out):
        print(path)


if __name__ == "__main__":
    main()
