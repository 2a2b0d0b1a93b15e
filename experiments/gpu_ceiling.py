"""What the proposers can buy where a forward over a few tokens costs about one, as on a GPU (the issue's goal: 8
tokens <= 1.15x one), measured on any machine: every prompt of the suite decoded greedily by each proposer with the
engine planning from a flat forward-cost curve (`--verify-cost` per extra token) and the GPU's tree sizes, each
proposer pricing its own forwards as a GPU's estimate does before it has measured any (`planning.weights_estimate`:
where each layer's kernels bound a forward, its layers over the target's).

    python experiments/gpu_ceiling.py [--limit 14] [--new-tokens 96] [--verify-cost 0.005]
                                  [--algos speculative medusa eagle] [--eagle-head DIR]

Per algorithm, summed over the prompts: tokens per target forward (TPF), the proposer's own forwards per step and
their price (in one-token target forwards), the nodes verified a step, the TPF of an oracle that always
keeps the same trees' deepest path, and the speedup over plain decoding those allow when the host, the draws and
the waits cost nothing: TPF / (verify + own forwards x price), the verify priced by the curve. A bound, not a
measurement of speed: on a GPU, `scripts/gpu_check.sh` measures the speed itself.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from playground.bench.suite import SUITE  # noqa: E402
from playground.config import GenerationParams, ModelSpec, SamplingParams  # noqa: E402
from playground.decoding.costs import FLAT_TOKEN_COST, flat  # noqa: E402
from playground.decoding.eagle import EAGLE_GPU_NODES, EagleParams  # noqa: E402
from playground.decoding.medusa import MedusaParams, dynamic_nodes  # noqa: E402
from playground.decoding.prompt_lookup import PromptLookupParams  # noqa: E402
from playground.decoding.registry import build_proposer  # noqa: E402
from playground.engine import generate  # noqa: E402
from playground.events import DraftEvent, VerifyEvent  # noqa: E402
from playground.metrics import compute, depth_profile  # noqa: E402
from playground.models import load_model  # noqa: E402

GOAL = 1.8  # the speedup goal for speculative decoding, Medusa and EAGLE on a GPU
ROWS = (("speculative", "speculative", None, False), ("speculative + copies", "speculative", None, True),
        ("medusa", "medusa", MedusaParams(nodes=dynamic_nodes(True)), False),
        ("medusa + copies", "medusa", MedusaParams(nodes=dynamic_nodes(True)), True),
        ("eagle", "eagle", EagleParams(nodes=EAGLE_GPU_NODES), False),
        ("eagle + copies", "eagle", EagleParams(nodes=EAGLE_GPU_NODES), True))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--limit", type=int, default=len(SUITE), help="the suite's first N prompts")
    parser.add_argument("--new-tokens", type=int, default=96)
    parser.add_argument("--verify-cost", type=float, default=FLAT_TOKEN_COST,
                        help="what each token of a forward beyond the first adds, in one-token forwards")
    algos = sorted({row[1] for row in ROWS})
    parser.add_argument("--algos", nargs="+", choices=algos, default=algos,
                        help="the proposers whose rows run, alone and with copies (default: all)")
    parser.add_argument("--eagle-head", help="an EAGLE head's folder for the eagle rows (default: the shipped head)")
    args = parser.parse_args()
    target = load_model(ModelSpec(device="cpu", dtype="float32"))
    curve = flat(args.verify_cost)
    prompts = [prompt for _, prompt in SUITE[: args.limit]]
    generation = GenerationParams(max_new_tokens=args.new_tokens)
    print(f"flat forward costs: 8 tokens {curve.time(8):.3f}, 32 tokens {curve.time(32):.3f} one-token forwards; "
          f"{len(prompts)} prompts x {args.new_tokens} tokens, greedy")
    print("| row | tokens per target forward | own forwards a step | own forward's price | nodes verified a step | "
          f"oracle TPF (same trees) | speedup bound | >= {GOAL}x |")
    print("|---|---|---|---|---|---|---|---|")
    for name, algo, params, copies in (row for row in ROWS if row[1] in args.algos):
        if algo == "eagle" and args.eagle_head:
            params = replace(params, head=args.eagle_head)
        proposer = build_proposer(target, algo, params, copies=PromptLookupParams() if copies else None)
        price = gpu_price(getattr(proposer, "inner", proposer), target.model.config.num_layers)
        tokens = forwards = steps = own = 0
        widths_verified, oracle = [], []
        for prompt in prompts:
            _, trace = generate(target, prompt, proposer, SamplingParams(), generation, costs=curve)
            metrics = compute(trace)
            tokens, forwards = tokens + metrics.tokens, forwards + metrics.target_forwards
            verifies = [e for e in trace.events if isinstance(e, VerifyEvent)]
            steps += len(verifies)
            # a proposal's own forwards (Medusa's heads: one run, which its trace does not count as a forward)
            own += sum(max(e.draft_forwards, 1) for e in trace.events if isinstance(e, DraftEvent) and e.tokens)
            widths_verified += [e.num_tokens - 1 for e in verifies]
            oracle.append(depth_profile(trace).get("oracle_tokens_per_forward", 1.0))
        tpf, own_per_step = tokens / forwards, own / steps
        verify = statistics.mean(curve.time(w + 1) for w in widths_verified)
        bound = tpf / (verify + own_per_step * price)
        print(f"| {name} | {tpf:.2f} | {own_per_step:.2f} | {price:.3f} | {statistics.mean(widths_verified):.1f} | "
              f"{statistics.mean(oracle):.2f} | {bound:.2f}x | {'yes' if bound >= GOAL else 'no'} |", flush=True)


def gpu_price(proposer, layers: int) -> float:
    """Fix a proposer's price for its own forward at a GPU's estimate: its layers (a draft model's; one for the EAGLE
    head and the Medusa heads) over the target's `layers`."""
    draft = getattr(proposer, "draft", None)
    proposer.own.fixed = (draft.model.config.num_layers if draft is not None else 1) / layers
    return proposer.own.fixed


if __name__ == "__main__":
    main()
