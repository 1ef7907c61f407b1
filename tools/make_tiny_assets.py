"""Regenerate the embedded default's files under assets/: corpus, chat data, tokenizer, model config.

    python tools/make_tiny_assets.py            # rewrites assets/
    python tools/make_tiny_assets.py --out DIR  # writes elsewhere (tests compare it with assets/)

Deterministic: the same versions give the same bytes. Takes a few seconds; nothing is downloaded.
"""

import sys
from pathlib import Path

from fsdp_recipes.console import HelpFormatter, OneLineParser
from fsdp_recipes.errors import bounded
from fsdp_recipes.tiny import ASSETS, build_all


def main(argv: list[str] | None = None) -> int:
    """Write the files and print each path: 0; a folder that cannot be written is one line on stderr: 1."""
    parser = OneLineParser(description=__doc__.splitlines()[0], formatter_class=HelpFormatter)
    parser.add_argument("--out", type=Path, default=ASSETS, help=f"folder to write into (default: {ASSETS})")
    args = parser.parse_args(argv)
    try:
        for path in build_all(args.out):
            print(path)
    # a file where the folder should be, no permission, a full disk
    except OSError as err:
        print(bounded(f"make_tiny_assets.py: error: cannot write to --out {args.out}: {err}"), file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
