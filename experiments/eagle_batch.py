"""What growing EAGLE's trees together saves: for B decoding requests, the time to grow all their trees in one batch
(one head forward per depth) against growing them one request at a time, from the same head states.

    python experiments/eagle_batch.py [--batches 1 4 16] [--depth 4] [--steps 12] [--rounds 7]

For each batch size the suite's first B prompts are served by the engine with EAGLE for `--steps` steps (prefills
and some decoding); the head states of the requests then decoding are saved, and each round restores them before
growing the trees together and again before growing them one at a time (the catch-up on unread features
included, as in a step). Prints the median milliseconds of each, and the ratio.
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from playground.bench.suite import workload  # noqa: E402
from playground.config import EngineParams, GenerationParams, ModelSpec  # noqa: E402
from playground.decoding.eagle import EagleParams  # noqa: E402
from playground.decoding.registry import build_proposer  # noqa: E402
from playground.engine import Engine  # noqa: E402
from playground.models import load_model  # noqa: E402


def timings(target, batch: int, depth: int, steps: int, rounds: int) -> tuple[int, float, float]:
    """(requests timed, median ms together, median ms one at a time)."""
    proposer = build_proposer(target, "eagle")
    engine = Engine(target, EngineParams(max_running=batch), proposer=proposer)
    for prompt, _ in workload(batch, 64):
        engine.add_request(prompt, generation=GenerationParams(max_new_tokens=64))
    for _ in range(steps):
        engine.step()
    live = [r for r in engine.requests.values() if r.id in proposer.states and proposer._ready(r)]
    saved = {r.id: dataclasses.replace(proposer.states[r.id]) for r in live}  # `grow` assigns, never mutates

    def timed(groups: list[list]) -> float:
        proposer.states.update({rid: dataclasses.replace(state) for rid, state in saved.items()})
        start = time.perf_counter()
        for group in groups:
            proposer._proposals(proposer.grow(group, [depth] * len(group)), [depth] * len(group))
        return 1e3 * (time.perf_counter() - start)

    together, alone = [], []
    for _ in range(rounds):
        together.append(timed([live]))
        alone.append(timed([[r] for r in live]))
    engine.close()
    return len(live), statistics.median(together), statistics.median(alone)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 4, 16])
    parser.add_argument("--depth", type=int, default=4, choices=range(1, EagleParams().depth + 1))
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args()
    target = load_model(ModelSpec(device=args.device))
    print(f"EAGLE trees {args.depth} deep, median of {args.rounds} rounds ({args.device})\n")
    print("| requests | together ms | one at a time ms | one at a time / together |\n|---|---|---|---|")
    for batch in args.batches:
        n, together, alone = timings(target, batch, args.depth, args.steps, args.rounds)
        print(f"| {n} | {together:.1f} | {alone:.1f} | {alone / together:.2f} |")


if __name__ == "__main__":
    main()
