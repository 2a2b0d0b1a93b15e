"""`python -m playground.train corpus|draft|medusa|eagle|ngrams|datastore|layerskip [options]`: write the target's
answers that proposers learn from, train a draft model for speculative decoding, Medusa heads or an EAGLE head for a
target, write the target's answers whose n-grams seed lookahead decoding's pool, build a REST datastore, or search
the layers a target drafts with for self-speculative decoding."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from pathlib import Path

from ..cli import OneLineParser, check_folder, run_cli
from . import corpus, datastore, draft, eagle, layerskip, medusa, ngrams


def writing_out(run: Callable[[argparse.Namespace], int]) -> Callable[[argparse.Namespace], int]:
    """`run`, once its --out folder is known to be one it can write in: before minutes of work, not after."""
    def checked(args: argparse.Namespace) -> int:
        if getattr(args, "out", None) is not None:
            check_folder("out", Path(args.out))
        return run(args)
    return checked


def main(argv: list[str] | None = None) -> int:
    parser = OneLineParser(prog="python -m playground.train", description="Train small helper models.")
    commands = parser.add_subparsers(dest="command", required=True, parser_class=OneLineParser)
    corpus_parser = commands.add_parser("corpus", help="write the target's answers to many varied prompts, in "
                                                       "shards that a rerun resumes")
    corpus.add_args(corpus_parser)
    corpus_parser.set_defaults(func=writing_out(corpus.main))
    draft_parser = commands.add_parser("draft", help="distil a draft model for speculative decoding")
    draft.add_args(draft_parser)
    draft_parser.set_defaults(func=writing_out(draft.main))
    medusa_parser = commands.add_parser("medusa", help="self-distil Medusa heads for a frozen target")
    medusa.add_args(medusa_parser)
    medusa_parser.set_defaults(func=writing_out(medusa.main))
    eagle_parser = commands.add_parser("eagle", help="self-distil an EAGLE head for a frozen target")
    eagle.add_args(eagle_parser)
    eagle_parser.set_defaults(func=writing_out(eagle.main))
    ngrams_parser = commands.add_parser("ngrams", help="write the target's answers for lookahead's corpus pool")
    ngrams.add_args(ngrams_parser)
    ngrams_parser.set_defaults(func=writing_out(ngrams.main))
    datastore_parser = commands.add_parser("datastore", help="build the REST datastore of a text or JSONL file")
    datastore.add_args(datastore_parser)
    datastore_parser.set_defaults(func=writing_out(datastore.main))
    layerskip_parser = commands.add_parser("layerskip", help="search the layers a target drafts with for "
                                                            "self-speculative decoding")
    layerskip.add_args(layerskip_parser)
    layerskip_parser.set_defaults(func=writing_out(layerskip.main))
    return run_cli(parser, argv)


if __name__ == "__main__":
    sys.exit(main())
