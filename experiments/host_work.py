"""The engine's host work per step: what a step costs beside its forward, which CUDA graphs cannot remove (at
1,000 tok/s a whole step has 1 ms). Measured on any machine with a model whose forward costs almost nothing (one
layer of width 64, random weights), through the static-shape forwards and with the step's draws made ahead as off
the CPU, so that the Python of scheduling, drawing, committing and tracing is what is timed.

    python experiments/host_work.py [--batch 1] [--tokens 300] [--rounds 7] [--no-trace] [--algo lookahead]

Prints the median over rounds of a decode step's time, of its forward (`Runner.run`) and of the rest. With --algo
(prompt-lookup or lookahead, whose proposers need no model of their own) each step proposes as set, every width
costing one forward, so that its proposing, walking and tracing are timed too.
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from playground.config import EngineParams, GenerationParams, ModelSpec, SamplingParams  # noqa: E402
from playground.decoding.costs import ForwardCosts  # noqa: E402
from playground.decoding.lookahead import LookaheadParams  # noqa: E402
from playground.decoding.prompt_lookup import PromptLookupParams  # noqa: E402
from playground.decoding.proposer import Proposer  # noqa: E402
from playground.decoding.registry import build_proposer  # noqa: E402
from playground.engine.engine import Engine  # noqa: E402
from playground.kv import blocks_for  # noqa: E402
from playground.models import LoadedModel, load_model  # noqa: E402
from playground.models.transformer import Transformer  # noqa: E402

PROMPT_TOKENS = 35  # each request's prompt


def tiny_target() -> LoadedModel:
    """The embedded model's tokenizer and config with one layer of width 64 over 1,024 token ids, random weights,
    PyTorch's kernels, static-shape forwards."""
    target = load_model(ModelSpec(device="cpu", dtype="float32"))
    config = dataclasses.replace(target.model.config, hidden_size=64, intermediate_size=128, num_layers=1,
                                 num_heads=1, num_kv_heads=1, head_dim=64, vocab_size=1024)
    torch.manual_seed(0)
    model = Transformer(config, target.model.inv_freq[:32].clone()).eval()
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.normal_(0, 0.2)
    model.native_attention = False
    return dataclasses.replace(target, model=model, forwards="static")


def proposer_of(target: LoadedModel, algo: str | None) -> Proposer | None:
    """None (plain decoding), prompt lookup or lookahead (its pools from the prompt and the text alone)."""
    if algo is None:
        return None
    params = {"prompt-lookup": PromptLookupParams(), "lookahead": LookaheadParams(corpus_pool=False)}[algo]
    return build_proposer(target, algo, params)


def step_times(target: LoadedModel, batch: int, tokens: int, trace: bool,
               algo: str | None = None) -> tuple[float, float]:
    """Seconds per decode step, and of its forward, for `batch` requests of `tokens` new tokens each (the prefill
    steps left out)."""
    prompts = [list(range(5 + i, 5 + i + PROMPT_TOKENS)) * 2 for i in range(batch)]  # a text that repeats
    params = EngineParams(max_running=batch, kv="paged" if batch > 1 else "contiguous", plan="as-set",
                          num_blocks=batch * blocks_for(2 * PROMPT_TOKENS + tokens + 64, EngineParams().block_size))
    engine = Engine(target, params, record_blocks=False, trace=trace, proposer=proposer_of(target, algo),
                    costs=ForwardCosts((1, 2), (1.0, 1.0)))
    engine.draws_ahead = True  # as off the CPU: one transfer of every draw a step
    for prompt in prompts:
        engine.add_request(prompt, SamplingParams(), GenerationParams(max_new_tokens=tokens))
    forward = [0.0]
    run = engine.runner.run

    def timed(plan):
        start = time.perf_counter()
        try:
            return run(plan)
        finally:
            forward[0] += time.perf_counter() - start
    engine.step()  # the prefills
    engine.runner.run = timed
    steps, start = 0, time.perf_counter()
    while engine.has_unfinished():
        engine.step()
        steps += 1
    total = time.perf_counter() - start
    engine.close()
    return total / steps, forward[0] / steps


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch", type=int, default=1, help="requests decoded together")
    parser.add_argument("--tokens", type=int, default=300, help="new tokens per request")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--no-trace", action="store_true", help="no trace events (as the server runs)")
    parser.add_argument("--algo", choices=["prompt-lookup", "lookahead"], default=None,
                        help="a proposer with no model of its own, proposing as set (default: plain decoding)")
    args = parser.parse_args()
    target = tiny_target()
    step_times(target, args.batch, 8, not args.no_trace, args.algo)  # warm-up
    rounds = [step_times(target, args.batch, args.tokens, not args.no_trace, args.algo) for _ in range(args.rounds)]
    step = statistics.median(s for s, _ in rounds)
    forward = statistics.median(f for _, f in rounds)
    beside = statistics.median(s - f for s, f in rounds)
    shown = f"{args.algo or 'plain'}, batch {args.batch}, {'no trace' if args.no_trace else 'traced'}"
    print(f"{shown}: a step {1e3 * step:.3f} ms, its forward {1e3 * forward:.3f} ms, beside it {1e3 * beside:.3f} ms "
          f"(medians of {args.rounds} rounds)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
