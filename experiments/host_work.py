"""The engine's host work per step: what a step costs beside its forward, which CUDA graphs cannot remove (at
1,000 tok/s a whole step has 1 ms). Measured on any machine with a model whose forward costs almost nothing (one
layer of width 64, random weights), through the static-shape forwards and with the step's draws made ahead as off
the CPU, so that the Python of scheduling, drawing, committing and tracing is what is timed.

    python experiments/host_work.py [--batch 1] [--tokens 300] [--rounds 7] [--no-trace]

Prints the median over rounds of a decode step's time, of its forward (`Runner.run`) and of the rest.
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


def step_times(target: LoadedModel, batch: int, tokens: int, trace: bool) -> tuple[float, float]:
    """Seconds per decode step, and of its forward, for `batch` requests of `tokens` new tokens each (the prefill
    steps left out)."""
    prompts = [list(range(5 + i, 5 + i + PROMPT_TOKENS)) for i in range(batch)]
    params = EngineParams(max_running=batch, kv="paged" if batch > 1 else "contiguous",
                          num_blocks=batch * blocks_for(PROMPT_TOKENS + tokens, EngineParams().block_size))
    engine = Engine(target, params, record_blocks=False, trace=trace)
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
    args = parser.parse_args()
    target = tiny_target()
    step_times(target, args.batch, 8, not args.no_trace)  # warm-up
    rounds = [step_times(target, args.batch, args.tokens, not args.no_trace) for _ in range(args.rounds)]
    step = statistics.median(s for s, _ in rounds)
    forward = statistics.median(f for _, f in rounds)
    beside = statistics.median(s - f for s, f in rounds)
    print(f"batch {args.batch}, {'no trace' if args.no_trace else 'traced'}: a step {1e3 * step:.3f} ms, its forward "
          f"{1e3 * forward:.3f} ms, beside it {1e3 * beside:.3f} ms (medians of {args.rounds} rounds)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
