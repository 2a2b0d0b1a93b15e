"""`python -m playground.train draft|medusa [options]`: train a draft model for speculative decoding, or Medusa
heads for a target."""

from __future__ import annotations

import sys

from ..__main__ import OneLineParser, run_cli
from . import draft, medusa


def main(argv: list[str] | None = None) -> int:
    parser = OneLineParser(prog="python -m playground.train", description="Train small helper models.")
    commands = parser.add_subparsers(dest="command", required=True, parser_class=OneLineParser)
    draft_parser = commands.add_parser("draft", help="distil a draft model for speculative decoding")
    draft.add_args(draft_parser)
    draft_parser.set_defaults(func=draft.main)
    medusa_parser = commands.add_parser("medusa", help="self-distil Medusa heads for a frozen target")
    medusa.add_args(medusa_parser)
    medusa_parser.set_defaults(func=medusa.main)
    return run_cli(parser, argv)


if __name__ == "__main__":
    sys.exit(main())
