"""Tokens per target forward against the nodes a step verifies, 1 to 64, for each proposer: what a bigger tree or a
longer chain buys in kept tokens alone, whatever a forward costs on the machine. Every prompt of the suite decoded
greedily under the as-set plan (every node a proposer offers is verified), on a flat forward-cost curve, so the
figures are the proposers' and not the host's.

    python experiments/node_ceilings.py [--limit 14] [--new-tokens 64] [--budgets 1 2 4 8 16 32 64]
        [--algos eagle medusa speculative prompt-lookup rest]

Per proposer and budget: tokens per target forward (TPF, bonus included) summed over the prompts, and the mean nodes
a step verified (a chain's proposer may offer fewer than its budget). The draft model's budget is its chain plus
the runner-up beside its first token (gamma = budget - 1, at most 16); prompt lookup's, one copy of that many tokens
(at most 16).
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from playground.bench.suite import SUITE  # noqa: E402
from playground.config import MAX_GAMMA, GenerationParams, ModelSpec, SamplingParams  # noqa: E402
from playground.decoding.costs import flat  # noqa: E402
from playground.decoding.eagle import EagleParams  # noqa: E402
from playground.decoding.medusa import MedusaParams  # noqa: E402
from playground.decoding.prompt_lookup import PromptLookupParams  # noqa: E402
from playground.decoding.registry import build_proposer  # noqa: E402
from playground.decoding.rest import RestParams  # noqa: E402
from playground.decoding.speculative import SpeculativeParams  # noqa: E402
from playground.engine import generate  # noqa: E402
from playground.events import VerifyEvent  # noqa: E402
from playground.metrics import compute  # noqa: E402
from playground.models import load_model  # noqa: E402


def params(algo: str, budget: int):
    """The settings that offer `budget` nodes a step, or None where the proposer cannot."""
    if algo == "eagle":  # wide and deep enough that the budget, not the shape, is the limit
        return EagleParams(nodes=budget, depth=8, top_k=8)
    if algo == "medusa":
        return MedusaParams(nodes=budget)
    if algo == "rest":
        return RestParams(nodes=budget)
    if algo == "speculative":
        return SpeculativeParams(gamma=budget - 1) if 2 <= budget <= MAX_GAMMA + 1 else None
    return PromptLookupParams(num_draft=budget, branches=1) if budget <= MAX_GAMMA else None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--limit", type=int, default=len(SUITE), help="the suite's first N prompts")
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--budgets", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32, 64])
    algos = ["eagle", "medusa", "speculative", "prompt-lookup", "rest"]
    parser.add_argument("--algos", nargs="+", choices=algos, default=algos)
    args = parser.parse_args()
    target = load_model(ModelSpec(device="cpu"))
    prompts = [prompt for _, prompt in SUITE[: args.limit]]
    generation = GenerationParams(max_new_tokens=args.new_tokens, plan="as-set")
    print(f"{len(prompts)} prompts x {args.new_tokens} tokens, greedy, as-set, weights {target.weights}")
    print("| proposer | " + " | ".join(f"{b} nodes" for b in args.budgets) + " |")
    print("|---|" + "---|" * len(args.budgets))
    for algo in args.algos:
        cells = []
        for budget in args.budgets:
            settings = params(algo, budget)
            if settings is None:
                cells.append("-")
                continue
            proposer = build_proposer(target, algo, settings)
            tokens = forwards = 0
            widths: list[int] = []
            for prompt in prompts:
                _, trace = generate(target, prompt, proposer, SamplingParams(), generation, costs=flat())
                metrics = compute(trace)
                # decode steps only: the prefill's forward and its token are every proposer's alike
                tokens, forwards = tokens + metrics.tokens - 1, forwards + metrics.target_forwards - 1
                widths += [e.num_tokens - 1 for e in trace.events if isinstance(e, VerifyEvent) and e.step > 0]
            cells.append(f"{tokens / forwards:.2f} ({statistics.mean(widths):.1f})")
        print(f"| {algo} | " + " | ".join(cells) + " |", flush=True)


if __name__ == "__main__":
    main()
