"""Batch-1 generation through the engine (`playground.engine.generate`, the serving step with one request) against
the single-sequence decoders it replaces, interleaved on the benchmark suite: on every prompt, for each algorithm,
the decoder then the engine with that algorithm's proposer, so that a drifting host slows both alike. Greedy: the
two must give the same tokens. Prints per algorithm the median tokens/s of each, the median ratio engine / decoder
and each one's median speedup over plain decoding's decoder.

    python scripts/compare_engine.py [--limit N] [--max-new-tokens 96] [--kv contiguous|paged] [--rounds 2]

Times are each path's own engine clock: neither counts loading or the prompt's tokenisation.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from playground.bench_suite import SUITE, spread  # noqa: E402
from playground.config import (SpeculativeParams, MedusaParams, GenerationParams,  # noqa: E402
                               LookaheadParams, ModelSpec, PromptLookupParams, SamplingParams)
from playground.decoding import (AutoregressiveDecoder, LookaheadDecoder, MedusaDecoder,  # noqa: E402
                                 PromptLookupDecoder, SpeculativeDecoder, generate)
from playground.decoding.registry import PROPOSERS  # noqa: E402
from playground.engine.generate import generate as engine_generate  # noqa: E402
from playground.models import load_model  # noqa: E402
from playground.models.loader import load_draft  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--limit", type=int, default=8, help=f"prompts of the suite, 1..{len(SUITE)} (default 8)")
    parser.add_argument("--max-new-tokens", type=int, default=96)
    parser.add_argument("--kv", default="contiguous", choices=("contiguous", "paged"))
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    args = parser.parse_args()
    if not 1 <= args.limit <= len(SUITE):
        parser.error(f"--limit must be in [1, {len(SUITE)}], got {args.limit}")
    target = load_model(ModelSpec(device=args.device, dtype="float32"))
    draft = load_draft(None, target)
    greedy, generation = SamplingParams(), GenerationParams(max_new_tokens=args.max_new_tokens, kv=args.kv)
    decoders = {"ar": AutoregressiveDecoder(target, greedy, generation),
                "prompt-lookup": PromptLookupDecoder(target, greedy, generation),
                "lookahead": LookaheadDecoder(target, greedy, generation),
                "medusa": MedusaDecoder(target, greedy, generation),
                "speculative": SpeculativeDecoder(target, draft, greedy, generation)}
    proposers = {"ar": None, "prompt-lookup": PROPOSERS["prompt-lookup"](target, PromptLookupParams()),
                 "lookahead": PROPOSERS["lookahead"](target, LookaheadParams()),
                 "medusa": PROPOSERS["medusa"](target, MedusaParams()),
                 "speculative": PROPOSERS["speculative"](target, SpeculativeParams(), draft)}
    generate(decoders["ar"], "Hello")  # unmeasured warm-up: first-call allocations and kernel choices
    rates = {algo: {"decoder": [], "engine": []} for algo in decoders}
    for _ in range(args.rounds):
        for _, prompt in (SUITE[i] for i in spread(args.limit)):
            for algo, decoder in decoders.items():
                ours, _ = generate(decoder, prompt)
                theirs, _ = engine_generate(target, prompt, proposers[algo], greedy, generation, algo)
                if ours.token_ids != theirs.token_ids:
                    print(f"MISMATCH: {algo} on {prompt!r}", file=sys.stderr)
                    return 1
                rates[algo]["decoder"].append(len(ours.token_ids) / ours.wall_s)
                rates[algo]["engine"].append(len(theirs.token_ids) / theirs.wall_s)
    plain = statistics.median(rates["ar"]["decoder"])
    print(f"| algorithm ({args.kv} cache) | decoder tok/s | engine tok/s | engine / decoder | decoder vs plain | "
          "engine vs plain |\n|---|---|---|---|---|---|")
    for algo, r in rates.items():
        decoder, engine = statistics.median(r["decoder"]), statistics.median(r["engine"])
        ratio = statistics.median(e / d for e, d in zip(r["engine"], r["decoder"]))
        print(f"| {algo} | {decoder:.1f} | {engine:.1f} | {ratio:.2f} | {decoder / plain:.2f}x | "
              f"{engine / plain:.2f}x |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
