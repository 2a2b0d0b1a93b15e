"""`python -m playground.train datastore`: build the REST datastore of a corpus for a target (`decoding.rest`): the
file tokenised with the target's tokenizer and its suffix array, cached where the proposer finds it. Nothing is
trained; a proposer whose datastore is not built yet builds it on first use the same way."""

from __future__ import annotations

import argparse

from ..config import ModelSpec
from . import log


def add_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="embedded", help="target model spec whose tokenizer reads the corpus "
                                                            "(default: embedded)")
    parser.add_argument("--corpus", default=None,
                        help="a text file, or a JSONL file of rows with a \"text\" field (default: the embedded "
                             "target's answers to the training prompts)")
    parser.add_argument("--rebuild", action="store_true", help="build it again even where it is cached")


def main(args: argparse.Namespace) -> int:
    from ..decoding.rest import datastore_for
    from ..models import load_model

    target = load_model(ModelSpec(source=args.model, device="cpu"))
    store = datastore_for(target, args.corpus, lambda message: log("datastore", message), args.rebuild)
    log("datastore", f"ready: {len(store):,} tokens of {store.meta.get('source')}")
    return 0
