"""What a proposer costs on steps it does not draft: plain decoding and each named algorithm on one suite prompt,
interleaved over rounds, under the measured plan on this machine's live costs; each algorithm's median engine time
over plain decoding's in the same round. Where drafting does not pay (the plan declines, or `Payoff` rests it), the
ratio is the proposer's host work per step (asking, declining, reading the kept rows).

    python experiments/declining_proposers.py [--algos eagle,speculative,medusa] [--prompt 5] [--rounds 8]
"""

from __future__ import annotations

import argparse
import statistics

from playground.bench.suite import SUITE
from playground.config import GenerationParams, ModelSpec
from playground.decoding.registry import build_proposer
from playground.engine import generate
from playground.metrics import compute
from playground.models import load_model


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--algos", default="eagle,speculative,medusa")
    parser.add_argument("--prompt", type=int, default=5, help=f"suite prompt 0..{len(SUITE) - 1}")
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    args = parser.parse_args()
    target = load_model(ModelSpec(source="embedded"))
    proposers = {"ar": None, **{algo: build_proposer(target, algo) for algo in args.algos.split(",")}}
    generation = GenerationParams(max_new_tokens=args.max_new_tokens)
    prompt = SUITE[args.prompt][1]
    walls: dict[str, list[float]] = {name: [] for name in proposers}
    for round_ in range(args.rounds + 1):  # the first round warms up (and teaches the guessers), uncounted
        for name, proposer in proposers.items():
            wall = compute(generate(target, prompt, proposer, None, generation)[1]).wall_s
            if round_:
                walls[name].append(wall)
    for name, times in walls.items():
        ratio = statistics.median(t / p for t, p in zip(times, walls["ar"]))
        print(f"{name:12s} median engine time {1e3 * statistics.median(times):7.1f} ms, "
              f"over plain decoding's {ratio:.3f}")


if __name__ == "__main__":
    main()
