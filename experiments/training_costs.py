"""Where an EAGLE head's training time goes on this machine, measured on a few sequences of a corpus shard: the
target's forward that gives the features (transformers in bfloat16, as the trainer runs it by default; and the
engine's own forward on the model's GGUF blocks, one sequence a forward, as `--corpus-dir` runs it), and the head's
optimiser steps at unroll 1 and 2. Each as positions a second, and the hours one pass over a corpus of N positions
would take at that rate.

    python experiments/training_costs.py [--shard data/corpus/train-00000.safetensors] [--sequences 64]
        [--batch 16] [--positions 8000000]
"""

from __future__ import annotations

import argparse
import sys
import time
from argparse import Namespace
from pathlib import Path

import torch
from safetensors.torch import load_file

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from playground.config import GenerationParams, ModelSpec  # noqa: E402
from playground.decoding.base import new_cache  # noqa: E402
from playground.models import load_model  # noqa: E402
from playground.models.eagle import EagleHead, head_config  # noqa: E402
from playground.models.vocab import rows_of  # noqa: E402
from playground.train.draft import Corpus, frequent_vocabulary  # noqa: E402
from playground.train.eagle import train  # noqa: E402
from playground.train.medusa import sequence_states  # noqa: E402


def shard_corpus(path: Path, count: int) -> Corpus:
    """The first `count` sequences of a shard, with no soft labels (the head's vocabulary ranks the answers alone)."""
    data = load_file(str(path))
    tokens, sequences, first = data["tokens"].to(torch.int64).tolist(), [], 0
    for length in data["lengths"].tolist()[:count]:
        sequences.append(tokens[first : first + length])
        first += length
    empty = torch.zeros(0, 1, dtype=torch.int64)
    return Corpus(sequences, data["answer_starts"].tolist()[:count], empty, empty.float())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shard", type=Path, default=Path("data/corpus/train-00000.safetensors"))
    parser.add_argument("--sequences", type=int, default=64)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--positions", type=int, default=8_000_000, help="a corpus's positions, for the hours")
    args = parser.parse_args()
    torch.manual_seed(0)
    target = load_model(ModelSpec(source="embedded", device="cpu"))
    corpus = shard_corpus(args.shard, args.sequences)
    positions = sum(len(s) for s in corpus.sequences)
    start = time.perf_counter()
    states = sequence_states(target, corpus, "bfloat16", keep=torch.bfloat16)
    features_s = time.perf_counter() - start
    engine_model = load_model(ModelSpec()).model  # the default weights: the GGUF blocks in integer products
    start = time.perf_counter()
    with torch.inference_mode():
        for sequence in corpus.sequences:
            cache = new_cache(engine_model, len(sequence), GenerationParams())
            ids = torch.tensor([sequence])  # (1, T)
            engine_model(ids, torch.arange(len(sequence)).unsqueeze(0), cache, (0,), num_logits=0)
    engine_s = time.perf_counter() - start
    vocab = frequent_vocabulary(corpus, 8192, target.model.config.vocab_size)
    output = rows_of(target.model.output_weight.detach().float(), vocab)  # (V', E)
    target.model.requires_grad_(False)
    rows = [("features (transformers, bfloat16)", features_s), ("features (the engine's forward)", engine_s)]
    for unroll in (1, 2):
        head = EagleHead(head_config(target.model), ())
        options = Namespace(device="cpu", seed=0, batch=args.batch, epochs=1, lr=1e-3, dtype="bfloat16", noise=0.1,
                            unroll=unroll, token_weight=0.5)
        start = time.perf_counter()
        train(target, head, corpus, states, output, options)
        rows.append((f"head training, unroll {unroll}", time.perf_counter() - start))
    print(f"{len(corpus.sequences)} sequences, {positions} positions; a pass over {args.positions:,} positions:")
    for name, seconds in rows:
        rate = positions / seconds
        print(f"  {name:38s} {rate:8.0f} positions/s  {args.positions / rate / 3600:6.1f} h")


if __name__ == "__main__":
    main()
