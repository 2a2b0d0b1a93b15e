"""Greedy exactness on any device: every algorithm at batch 1 on both KV caches, and the batching engine (plain and with
prompt lookup, Medusa heads, the draft, EAGLE or lookahead in the batch), against plain decoding on the contiguous
cache in the same dtype and with the same decode forwards, over the test suite's 20 prompts.

The unit tests check this on the CPU; this script is how to check it on a GPU (or any other device/dtype):

    python scripts/check_exact.py --device cuda [--dtype bfloat16] [--forwards graphs] [--new-tokens 48]

Exits 1 and names the prompt and setting of every mismatch. `scripts/gpu_check.py` runs it per dtype.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from playground.config import DEVICES, DTYPES, FORWARDS, EngineParams, GenerationParams, ModelSpec, SamplingParams  # noqa: E402
from playground.decoding.lookahead import LookaheadParams  # noqa: E402
from playground.decoding.medusa import MedusaParams  # noqa: E402
from playground.decoding.prompt_lookup import PromptLookupParams  # noqa: E402
from playground.decoding.registry import build_proposer  # noqa: E402
from playground.decoding.speculative import SpeculativeParams  # noqa: E402
from playground.engine import Engine, generate  # noqa: E402
from playground.models import LoadedModel, load_model  # noqa: E402
from playground.models.loader import load_draft  # noqa: E402
from tests.prompts import PROMPTS  # noqa: E402


def check(target: LoadedModel, draft: LoadedModel, new_tokens: int) -> dict[str, tuple[int, int]]:
    """Every setting's (prompts exact, prompts), printing each as it is checked and every mismatch."""
    greedy = SamplingParams()
    copies = PromptLookupParams(max_ngram=3, branches=1)
    proposers = {
        "ar": None,
        "speculative-g5": build_proposer(target, "speculative", SpeculativeParams(gamma=5), draft=draft),
        "speculative-copy": build_proposer(target, "speculative", SpeculativeParams(gamma=4), copies, draft=draft),
        "prompt-lookup": build_proposer(target, "prompt-lookup"),
        "prompt-lookup-branches": build_proposer(target, "prompt-lookup", PromptLookupParams(num_draft=5, branches=2)),
        "lookahead": build_proposer(target, "lookahead"),
        "lookahead-text6": build_proposer(target, "lookahead", LookaheadParams(text_ngram=6)),
        "lookahead-context1": build_proposer(target, "lookahead", LookaheadParams(context=1)),
        **{f"medusa-{tree}": build_proposer(target, "medusa", MedusaParams(tree=tree))
           for tree in ("dynamic", "small", "wide")},
        "medusa-copy": build_proposer(target, "medusa", MedusaParams(), copies),
        "eagle": build_proposer(target, "eagle"),
        "eagle-copy": build_proposer(target, "eagle", None, copies),
    }

    reference = {prompt: generate(target, prompt, None, greedy, GenerationParams(max_new_tokens=new_tokens))[0]
                 .token_ids for prompt in PROMPTS}
    results: dict[str, tuple[int, int]] = {}

    def report(name: str, bad: list[str], note: str = "") -> None:
        results[name] = (len(PROMPTS) - len(bad), len(PROMPTS))
        print(f"{name}: {len(PROMPTS) - len(bad)}/{len(PROMPTS)} prompts exact{note}"
              + "".join(f"\n  MISMATCH {p!r}" for p in bad), flush=True)

    for kv in ("contiguous", "paged"):
        generation = GenerationParams(max_new_tokens=new_tokens, kv=kv, block_size=4)
        for name, proposer in proposers.items():
            report(f"{name}/{kv}", [p for p in PROMPTS
                                    if generate(target, p, proposer, greedy, generation)[0].token_ids != reference[p]])

    lookup, draft_copy = build_proposer(target, "prompt-lookup"), PromptLookupParams()
    many = EngineParams().max_running  # the engine's default batch
    batches = {  # name -> (requests run together, proposer)
        f"engine batch of {len(PROMPTS)}": (many, None),
        f"engine batch of {len(PROMPTS)}, prompt lookup": (many, lookup),
        "engine batch of 2, prompt lookup": (2, lookup),
        f"engine batch of {len(PROMPTS)}, Medusa": (many, proposers["medusa-dynamic"]),
        "engine batch of 2, Medusa and prompt lookup": (
            2, build_proposer(target, "medusa", MedusaParams(), draft_copy)),
        f"engine batch of {len(PROMPTS)}, draft": (many, build_proposer(target, "speculative", draft=draft)),
        "engine batch of 2, draft and prompt lookup": (
            2, build_proposer(target, "speculative", SpeculativeParams(), draft_copy, draft=draft)),
        f"engine batch of {len(PROMPTS)}, EAGLE": (many, proposers["eagle"]),
        "engine batch of 1, lookahead": (1, proposers["lookahead"]),
        "engine batch of 1, lookahead W 2 N 3 G 3": (
            1, build_proposer(target, "lookahead", LookaheadParams(window=2, ngram=3, guesses=3))),
    }
    for name, (running, proposer) in batches.items():
        engine = Engine(target, EngineParams(max_running=running), proposer=proposer)
        ids = {engine.add_request(p, greedy, GenerationParams(max_new_tokens=new_tokens)): p for p in PROMPTS}
        batched = {i: out.token_ids for i, out in engine.run_all().items()}
        counts = [f"{c.accepted} of {c.proposed} {source} tokens accepted" for source, c in engine.counts.items()]
        report(name, [p for i, p in ids.items() if batched[i] != reference[p]],
               f" ({'; '.join(counts)})" if counts else "")
    return results


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="auto", choices=DEVICES)
    parser.add_argument("--dtype", default="float32", choices=DTYPES)
    parser.add_argument("--forwards", default="auto", choices=FORWARDS, help="how decode forwards run (see the CLI)")
    parser.add_argument("--new-tokens", type=int, default=32)
    args = parser.parse_args()

    target = load_model(ModelSpec(device=args.device, dtype=args.dtype, forwards=args.forwards))
    draft = load_draft(None, target)
    results = check(target, draft, args.new_tokens)
    failures = sum(total - exact for exact, total in results.values())
    print(f"device {target.model.device}, {args.dtype}, {target.forwards} forwards: "
          f"{'all exact' if not failures else f'{failures} mismatches'}")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
