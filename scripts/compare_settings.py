"""Settings of the algorithms against each other and plain decoding, interleaved on the benchmark suite: on every
prompt plain decoding runs, then each setting right after it, so that a machine whose speed drifts (these 2-core
hosts do, by 10-25% within minutes) slows every setting of a prompt alike. `--limit N` runs N of the prompts,
spread over the suite's categories as the benchmark's `--limit` does.

    python scripts/compare_settings.py "lookahead:guesses=2" "lookahead:guesses=1,text_ngram=4"
        [--limit N] [--max-new-tokens 128] [--model embedded] [--draft SPEC] [--device cpu]

A setting is an algorithm (lookahead, prompt-lookup, medusa, speculative) and its parameters' fields as in
`LookaheadParams`, `PromptLookupParams`, `MedusaParams` or `SpeculativeParams` (whole numbers, decimals,
true/false or text); speculative settings share one draft (`--draft`, default the target's shipped one). Greedy:
every output must equal plain decoding's. Prints each prompt's speedup over plain decoding and tokens per target
forward, then per setting the medians over prompts and over the input-grounded ones.
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from playground.bench import GROUNDED  # noqa: E402
from playground.bench_suite import SUITE, spread  # noqa: E402
from playground.config import (ConfigError, GenerationParams, LookaheadParams, MedusaParams,  # noqa: E402
                               ModelSpec, PromptLookupParams, SamplingParams, SpeculativeParams)
from playground.decoding import (AutoregressiveDecoder, LookaheadDecoder, MedusaDecoder,  # noqa: E402
                                 PromptLookupDecoder, SpeculativeDecoder, generate)
from playground.metrics import compute  # noqa: E402
from playground.models import load_model  # noqa: E402
from playground.models.loader import default_draft  # noqa: E402

ALGOS = {"lookahead": (LookaheadParams, LookaheadDecoder), "prompt-lookup": (PromptLookupParams, PromptLookupDecoder),
         "medusa": (MedusaParams, MedusaDecoder), "speculative": (SpeculativeParams, SpeculativeDecoder)}


def value(text: str) -> Any:
    """A field's value as written: true/false, a whole number, a decimal, else the text itself."""
    if text.lower() in ("true", "false"):
        return text.lower() == "true"
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    return text


def parse_setting(text: str) -> tuple[str, Any]:
    """"algo:field=value,..." -> (algo, its params dataclass); errors name the setting and what is allowed."""
    algo, _, fields = text.partition(":")
    if algo not in ALGOS:
        raise argparse.ArgumentTypeError(f"setting {text!r}: algorithm must be one of {', '.join(ALGOS)}")
    params_type = ALGOS[algo][0]
    known = {f.name for f in dataclasses.fields(params_type)}
    changes = {}
    for item in filter(None, fields.split(",")):
        name, equals, raw = item.partition("=")
        if not equals or name not in known:
            raise argparse.ArgumentTypeError(f"setting {text!r}: {item!r} must be field=value with a field of "
                                             f"{params_type.__name__}: {', '.join(sorted(known))}")
        changes[name] = value(raw)
    try:
        return algo, params_type(**changes)
    except ConfigError as exc:
        raise argparse.ArgumentTypeError(f"setting {text!r}: {exc}") from exc


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("settings", nargs="+", type=parse_setting, metavar="ALGO:FIELD=VALUE,...")
    parser.add_argument("--limit", type=int, default=len(SUITE),
                        help=f"N suite prompts spread over its categories, 1..{len(SUITE)}")
    parser.add_argument("--max-new-tokens", type=int, default=128, help="1..4096 (default 128)")
    parser.add_argument("--model", default="embedded")
    parser.add_argument("--draft", default=None,
                        help="draft model for speculative settings (default: the target's shipped draft)")
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    args = parser.parse_args()
    if not 1 <= args.limit <= len(SUITE):
        parser.error(f"--limit must be in 1..{len(SUITE)}, got {args.limit}")
    if not 1 <= args.max_new_tokens <= 4096:
        parser.error(f"--max-new-tokens must be in 1..4096, got {args.max_new_tokens}")
    draft_source = None
    if any(algo == "speculative" for algo, _ in args.settings):
        draft_source = args.draft or default_draft(args.model)
        if not draft_source:
            parser.error("--draft: speculative settings need a draft model with the target's tokenizer (a default "
                         "ships only for the embedded model)")
    target = load_model(ModelSpec(source=args.model, device=args.device))
    draft = load_model(ModelSpec(source=draft_source, device=args.device)) if draft_source else None
    greedy, generation = SamplingParams(), GenerationParams(max_new_tokens=args.max_new_tokens)
    names = [f"{i}:{algo}" for i, (algo, _) in enumerate(args.settings)]
    decoders = [SpeculativeDecoder(target, draft, greedy, generation, params) if algo == "speculative"
                else ALGOS[algo][1](target, greedy, generation, params) for algo, params in args.settings]
    for name, decoder in zip(names, decoders):
        print(f"{name} = {decoder.params()}")
    plain = AutoregressiveDecoder(target, greedy, generation)
    generate(plain, "Warm up.")  # the first run of a process pays one-off costs
    results: dict[str, list[tuple[str, float, float]]] = {name: [] for name in names}
    for index in spread(args.limit):
        category, prompt = SUITE[index]
        reference, plain_trace = generate(plain, prompt)
        plain_speed = compute(plain_trace).tokens_per_s
        cells = []
        for name, decoder in zip(names, decoders):
            output, trace = generate(decoder, prompt)
            if output.token_ids != reference.token_ids:
                print(f"{name} gave other tokens than plain decoding on prompt {index}", file=sys.stderr)
                return 1
            metrics = compute(trace)
            results[name].append((category, metrics.tokens_per_s / plain_speed, metrics.mean_accepted_tokens))
            cells.append(f"{name} {results[name][-1][1]:.2f}x / {results[name][-1][2]:.2f}")
        print(f"[{index}] {category}: " + ", ".join(cells), flush=True)
    print("medians over prompts: speedup vs plain / tokens per target forward (input-grounded prompts: speedup)")
    for name, rows in results.items():
        grounded = [speedup for category, speedup, _ in rows if category in GROUNDED]
        print(f"{name}: {statistics.median(r[1] for r in rows):.3f}x / {statistics.median(r[2] for r in rows):.2f}"
              + (f" (grounded {statistics.median(grounded):.3f}x)" if grounded else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
