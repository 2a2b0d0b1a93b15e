"""`python -m playground.train draft|medusa|eagle|ngrams [options]`: train a draft model for speculative decoding,
Medusa heads or an EAGLE head for a target, or write the target's answers whose n-grams seed lookahead decoding's
pool."""

from __future__ import annotations

import sys

from ..cli import OneLineParser, run_cli
from . import draft, eagle, medusa, ngrams


def main(argv: list[str] | None = None) -> int:
    parser = OneLineParser(prog="python -m playground.train", description="Train small helper models.")
    commands = parser.add_subparsers(dest="command", required=True, parser_class=OneLineParser)
    draft_parser = commands.add_parser("draft", help="distil a draft model for speculative decoding")
    draft.add_args(draft_parser)
    draft_parser.set_defaults(func=draft.main)
    medusa_parser = commands.add_parser("medusa", help="self-distil Medusa heads for a frozen target")
    medusa.add_args(medusa_parser)
    medusa_parser.set_defaults(func=medusa.main)
    eagle_parser = commands.add_parser("eagle", help="self-distil an EAGLE head for a frozen target")
    eagle.add_args(eagle_parser)
    eagle_parser.set_defaults(func=eagle.main)
    ngrams_parser = commands.add_parser("ngrams", help="write the target's answers for lookahead's corpus pool")
    ngrams.add_args(ngrams_parser)
    ngrams_parser.set_defaults(func=ngrams.main)
    return run_cli(parser, argv)


if __name__ == "__main__":
    sys.exit(main())
