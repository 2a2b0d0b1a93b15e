"""Where a decode step would make the host wait for a GPU, counted on any machine (`playground.waits.Waits`): for
plain decoding and each algorithm, the waits of each decode step (each step after the prompts' prefill) with the
step's draws made ahead as off the CPU (`Engine.draws_ahead`), through the static-shape forwards, and the call sites
they come from.

    python scripts/count_waits.py [--kv contiguous|paged] [--temperature 0.8] [--new-tokens 32] [--batch 1]
                                  [--no-trace]

Prints per algorithm the decode steps, the mean and most waits a step, and each call site's waits a step. On a GPU,
`scripts/gpu_check.py` counts the waits themselves (PyTorch's sync debug mode).
"""

from __future__ import annotations

import argparse
import math
import sys
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from playground.config import EngineParams, GenerationParams, ModelSpec, SamplingParams  # noqa: E402
from playground.decoding.planning import OwnCost  # noqa: E402
from playground.decoding.registry import build_proposer  # noqa: E402
from playground.engine import Engine  # noqa: E402
from playground.models import LoadedModel, load_model  # noqa: E402
from playground.waits import Waits  # noqa: E402
from tests.prompts import PROMPTS  # noqa: E402

ALGOS = ("ar", "prompt-lookup", "lookahead", "speculative", "medusa", "eagle")


def step_waits(target: LoadedModel, algo: str, batch: int, temperature: float, generation: GenerationParams,
               trace: bool = True) -> tuple[list[int], Counter]:
    """The waits of each decode step (each step after the prompts' prefill) of `batch` requests decoded together by
    `algo`, with the draws made ahead as off the CPU, and the waits by call site over those steps."""
    proposer = None if algo == "ar" else build_proposer(target, algo)
    engine = Engine(target, EngineParams(max_running=batch, kv=generation.kv), proposer=proposer, trace=trace)
    engine.draws_ahead = True  # as off the CPU
    for i in range(batch):
        engine.add_request(PROMPTS[i], SamplingParams(temperature=temperature, seed=i), generation)
    waits, sites = [], Counter()
    while engine.has_unfinished():
        with Waits() as counted:
            engine.step()
        if engine.step_count > 1:  # after the prefill
            waits.append(counted.total)
            sites += counted.sites
    return waits, sites


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--kv", choices=("contiguous", "paged"), default="contiguous")
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--batch", type=int, default=1, help="requests decoded together")
    parser.add_argument("--no-trace", action="store_true", help="steps without their trace events (a server's)")
    args = parser.parse_args()
    OwnCost.MEASURED = math.inf  # proposers priced at their estimates, so that they propose on a busy machine too
    target = load_model(ModelSpec(device="cpu", dtype="float32", forwards="static"))
    generation = GenerationParams(max_new_tokens=args.new_tokens, kv=args.kv)
    print(f"{'algorithm':<14} {'steps':>5} {'waits/step':>10} {'most':>4}  sites (waits a step)")
    for algo in ALGOS:
        waits, sites = step_waits(target, algo, args.batch, args.temperature, generation, not args.no_trace)
        shown = ", ".join(f"{Path(file).name}:{line} {n / len(waits):.2f}" for (file, line), n in sites.most_common())
        print(f"{algo:<14} {len(waits):>5} {sum(waits) / len(waits):>10.2f} {max(waits):>4}  {shown}")


if __name__ == "__main__":
    main()
