"""Reproducible training of the small models the accelerated decoders need (`python -m playground.train`)."""

import sys


def log(part: str, message: str) -> None:
    """A progress line on stderr, tagged with what runs: a trainer, or the corpus every trainer shares."""
    print(f"[train {part}] {message}", file=sys.stderr, flush=True)
