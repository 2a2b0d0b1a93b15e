"""The serving engine one request at a time against the single-sequence decoders, interleaved on the benchmark
suite: on every prompt plain decoding runs, then Medusa with prompt copies (`generate --algo medusa --copy-ngram 3`),
speculative decoding with the shipped draft (`generate --algo speculative`) and lookahead (`generate --algo
lookahead`), then the engine at max_running 1 plain, with Medusa heads in the batch, with Medusa heads and prompt
lookup (the copy grafted onto the tree), with the draft, with the draft and prompt lookup, and with lookahead, each
right after the other so that a drifting host slows a prompt's runs alike.
Greedy: every output must equal plain decoding's. Prints each prompt's tokens/s, then per mode the median tokens/s
and the median speedup over plain decoding.

    python scripts/compare_engine.py [--limit N] [--max-new-tokens 128] [--device cpu]

The decoders' time is their own measured generation time, the engine's its clock inside `step()`: neither counts
loading or the prompt's tokenisation.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from playground.bench_suite import SUITE, spread  # noqa: E402
from playground.config import (EngineDraftParams, EngineMedusaParams, EngineParams,  # noqa: E402
                               GenerationParams, LookaheadParams, MedusaParams, ModelSpec, PromptLookupParams,
                               SamplingParams)
from playground.decoding import (AutoregressiveDecoder, Decoder, LookaheadDecoder, MedusaDecoder,  # noqa: E402
                                 SpeculativeDecoder, generate)
from playground.decoding.registry import engine_proposer  # noqa: E402
from playground.engine import Engine  # noqa: E402
from playground.models import LoadedModel, load_model  # noqa: E402
from playground.models.loader import load_draft  # noqa: E402

GREEDY = SamplingParams()


def decoder_run(decoder: Decoder) -> Callable[[str], tuple[tuple[int, ...], float]]:
    def run(prompt: str) -> tuple[tuple[int, ...], float]:
        output, _ = generate(decoder, prompt)
        return output.token_ids, output.wall_s
    return run


def engine_run(target: LoadedModel, generation: GenerationParams, draft_model: LoadedModel | None = None,
               **proposers: object) -> Callable[[str], tuple[tuple[int, ...], float]]:
    def run(prompt: str) -> tuple[tuple[int, ...], float]:
        params = EngineParams(max_running=1, **proposers)
        engine = Engine(target, params, record_blocks=False,
                        proposer=engine_proposer(target, params, draft=draft_model))
        request = engine.add_request(prompt, GREEDY, generation)
        return engine.run_all()[request].token_ids, engine.busy_s
    return run


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--limit", type=int, default=len(SUITE), help=f"prompts of the suite, 1..{len(SUITE)}")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    args = parser.parse_args()
    if not 1 <= args.limit <= len(SUITE):
        parser.error(f"--limit must be in [1, {len(SUITE)}], got {args.limit}")
    target = load_model(ModelSpec(device=args.device, dtype="float32"))
    generation = GenerationParams(max_new_tokens=args.max_new_tokens)
    draft = load_draft(None, target)
    modes = {
        "plain decoding": decoder_run(AutoregressiveDecoder(target, GREEDY, generation)),
        "Medusa + copies": decoder_run(MedusaDecoder(target, GREEDY, generation, MedusaParams(copy_ngram=3))),
        "speculative": decoder_run(SpeculativeDecoder(target, draft, GREEDY, generation)),
        "lookahead": decoder_run(LookaheadDecoder(target, GREEDY, generation)),
        "engine, plain": engine_run(target, generation),
        "engine, Medusa": engine_run(target, generation, medusa=EngineMedusaParams()),
        "engine, Medusa + lookup": engine_run(target, generation, medusa=EngineMedusaParams(),
                                              lookup=PromptLookupParams()),
        "engine, draft": engine_run(target, generation, draft, draft=EngineDraftParams()),
        "engine, draft + lookup": engine_run(target, generation, draft, draft=EngineDraftParams(),
                                             lookup=PromptLookupParams()),
        "engine, lookahead": engine_run(target, generation, lookahead=LookaheadParams()),
    }
    prompts = [SUITE[i] for i in spread(args.limit)]
    for run in modes.values():  # unmeasured warm-up: first-call allocations and kernel choices
        run(prompts[0][1])
    rates: dict[str, list[float]] = {name: [] for name in modes}
    for category, prompt in prompts:
        reference = None
        for name, run in modes.items():
            tokens, seconds = run(prompt)
            reference = reference or tokens
            if tokens != reference:
                print(f"MISMATCH: {name} on {prompt!r}", file=sys.stderr)
                return 1
            rates[name].append(len(tokens) / seconds)
        print(category, "  ".join(f"{name} {r[-1]:.1f}" for name, r in rates.items()), flush=True)
    plain = rates["plain decoding"]
    for name, rate in rates.items():
        speedup = statistics.median(r / p for r, p in zip(rate, plain))
        print(f"{name}: median {statistics.median(rate):.1f} tok/s, median speedup {speedup:.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
