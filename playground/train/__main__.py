"""`python -m playground.train draft [options]`: train a draft model for speculative decoding."""

from __future__ import annotations

import argparse
import sys

from ..__main__ import USER_ERRORS, OneLineParser
from . import draft


def main(argv: list[str] | None = None) -> int:
    parser = OneLineParser(prog="python -m playground.train", description="Train small helper models.")
    commands = parser.add_subparsers(dest="command", required=True, parser_class=OneLineParser)
    draft_parser = commands.add_parser("draft", help="distil a draft model for speculative decoding")
    draft.add_args(draft_parser)
    draft_parser.set_defaults(func=draft.main)
    args = parser.parse_args(argv)
    try:
        return args.func(args)
    except USER_ERRORS as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
