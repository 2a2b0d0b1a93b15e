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
from collections.abc import Sequence
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from playground.config import EngineParams, GenerationParams, ModelSpec, SamplingParams  # noqa: E402
from playground.decoding.planning import OwnCost  # noqa: E402
from playground.decoding.registry import algorithms, build_proposer  # noqa: E402
from playground.engine import Engine  # noqa: E402
from playground.engine.scheduler import Request  # noqa: E402
from playground.models import LoadedModel, load_model  # noqa: E402
from playground.waits import Waits  # noqa: E402
from tests.prompts import PROMPTS  # noqa: E402

ALGOS = tuple(algorithms())


def step_waits(target: LoadedModel, algo: str, requests: Sequence[tuple[str, SamplingParams | None]],
               generation: GenerationParams, trace: bool = True,
               ahead: bool = True) -> tuple[list[Counter], list[Request]]:
    """The waits of each engine step by call site (the first step is the prompts' prefill) of `requests` (prompt,
    sampling) decoded together by `algo` ("ar": plain decoding), with the step's draws made ahead as off the CPU
    (`ahead`, else row by row as on it); and the requests as they ended (tokens, trace events)."""
    proposer = None if algo == "ar" else build_proposer(target, algo)
    engine = Engine(target, EngineParams(max_running=len(requests), kv=generation.kv), proposer=proposer, trace=trace)
    engine.draws_ahead = ahead
    ids = [engine.add_request(prompt, sampling, generation) for prompt, sampling in requests]
    steps = []
    while engine.has_unfinished():
        with Waits() as counted:
            failed = [out.error for out in engine.step() if out.error is not None]
        if failed:
            raise RuntimeError(f"generation failed: {failed[0]}")
        steps.append(counted.sites)
    return steps, [engine.requests[i] for i in ids]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--kv", choices=("contiguous", "paged"), default="contiguous")
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--batch", type=int, default=1, help="requests decoded together")
    parser.add_argument("--no-trace", action="store_true", help="steps without their trace events (a server's)")
    args = parser.parse_args()
    if args.batch > 1 and args.kv == "contiguous":
        parser.error("--batch above 1 needs --kv paged (the contiguous cache holds one request)")
    OwnCost.MEASURED = math.inf  # proposers priced at their estimates, so that they propose on a busy machine too
    target = load_model(ModelSpec(device="cpu", dtype="float32", forwards="static"))
    generation = GenerationParams(max_new_tokens=args.new_tokens, kv=args.kv)
    print(f"{'algorithm':<14} {'steps':>5} {'waits/step':>10} {'most':>4}  sites (waits a step)")
    for algo in ALGOS:
        requests = [(PROMPTS[i], SamplingParams(temperature=args.temperature, seed=i)) for i in range(args.batch)]
        decode = step_waits(target, algo, requests, generation, not args.no_trace)[0][1:]  # after the prefill
        waits, sites = [sum(step.values()) for step in decode], sum(decode, Counter())
        shown = ", ".join(f"{Path(file).name}:{line} {n / len(waits):.2f}" for (file, line), n in sites.most_common())
        print(f"{algo:<14} {len(waits):>5} {sum(waits) / len(waits):>10.2f} {max(waits):>4}  {shown}")


if __name__ == "__main__":
    main()
