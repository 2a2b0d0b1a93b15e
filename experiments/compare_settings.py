"""Settings of the algorithms against each other and plain decoding, interleaved on the benchmark suite: on every
prompt plain decoding runs, then each setting right after it, so that a machine whose speed drifts (these 2-core
hosts do, by 10-25% within minutes) slows every setting of a prompt alike. `--limit N` runs N of the prompts,
spread over the suite's categories as the benchmark's `--limit` does.

    python experiments/compare_settings.py "lookahead:guesses=2" "lookahead:guesses=1,text_ngram=4"
        [--limit N] [--rounds R] [--max-new-tokens 128] [--model embedded] [--draft SPEC] [--device cpu]

A setting is an algorithm (lookahead, prompt-lookup, medusa, speculative) and its parameters' fields as in
`LookaheadParams`, `PromptLookupParams`, `MedusaParams` or `SpeculativeParams` (whole numbers, decimals,
true/false or text); speculative settings share one draft (`--draft`, default the target's shipped one). Greedy:
every output must equal plain decoding's. Prints each prompt's speedup over plain decoding and tokens per target
forward, then per setting the medians over prompt runs and over the input-grounded ones, the speedup in all (every
run's tokens over every run's time, against plain decoding's), and the medians over every step of the time spent
proposing and in the verifying forward. `--rounds R` repeats the pass over the prompts: on a noisy host (the GPU
machines here: plain decoding between 49 and 103 tokens/s from prompt to prompt) single rounds disagree by more
than settings differ, while the per-step medians hold.
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from playground.bench.suite import GROUNDED, SUITE, spread  # noqa: E402
from playground.config import ConfigError, GenerationParams, ModelSpec, SamplingParams  # noqa: E402
from playground.decoding.registry import ALGORITHMS, build_proposer  # noqa: E402
from playground.engine import generate  # noqa: E402
from playground.metrics import compute  # noqa: E402
from playground.models import load_model  # noqa: E402
from playground.models.loader import default_draft  # noqa: E402
from playground.trace import DraftEvent, Trace, VerifyEvent  # noqa: E402

ALGOS = {name: spec.params for name, spec in ALGORITHMS.items() if spec.params is not None}  # -> its parameters


@dataclasses.dataclass(frozen=True)
class Run:
    """One generation of a prompt: its speed and, against plain decoding's run of the same prompt, its speedup;
    tokens per target forward; the engine seconds of each step's proposing (draft events) and verifying forward."""

    category: str
    tokens: int
    wall_s: float
    speedup: float
    per_forward: float
    propose_s: list[float]
    verify_s: list[float]

    @classmethod
    def of(cls, category: str, trace: Trace, plain: Run | None = None) -> Run:
        metrics = compute(trace)
        speedup = metrics.tokens_per_s / total_speed([plain]) if plain else 1.0
        return cls(category, metrics.tokens, metrics.wall_s, speedup, metrics.mean_accepted_tokens or 1.0,
                   [e.wall_s for e in trace.events if isinstance(e, DraftEvent)],
                   [e.wall_s for e in trace.events if isinstance(e, VerifyEvent)])


def total_speed(runs: list[Run]) -> float:
    """Tokens per second over every run together: long runs weigh more, and one slow moment of the host less."""
    return sum(run.tokens for run in runs) / sum(run.wall_s for run in runs)


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
    params_type = ALGOS[algo]
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
    parser.add_argument("--rounds", type=int, default=1, help="passes over the prompts, 1..20 (default 1)")
    parser.add_argument("--model", default="embedded")
    parser.add_argument("--draft", default=None,
                        help="draft model for speculative settings (default: the target's shipped draft)")
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    args = parser.parse_args()
    if not 1 <= args.limit <= len(SUITE):
        parser.error(f"--limit must be in 1..{len(SUITE)}, got {args.limit}")
    if not 1 <= args.max_new_tokens <= 4096:
        parser.error(f"--max-new-tokens must be in 1..4096, got {args.max_new_tokens}")
    if not 1 <= args.rounds <= 20:
        parser.error(f"--rounds must be in 1..20, got {args.rounds}")
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
    proposers = [build_proposer(target, algo, params, draft=draft if algo == "speculative" else None)
                 for algo, params in args.settings]
    for name, proposer in zip(names, proposers):
        print(f"{name} = {proposer.describe()}")
    generate(target, "Warm up.", None, greedy, generation)  # the first run of a process pays one-off costs
    runs: dict[str, list[Run]] = {name: [] for name in ["plain", *names]}
    indices = spread(args.limit)
    for round_ in range(1, args.rounds + 1):
        for index in indices:
            category, prompt = SUITE[index]
            reference, plain_trace = generate(target, prompt, None, greedy, generation)
            base = Run.of(category, plain_trace)
            runs["plain"].append(base)
            cells = []
            for name, proposer in zip(names, proposers):
                output, trace = generate(target, prompt, proposer, greedy, generation)
                if output.token_ids != reference.token_ids:
                    print(f"{name} gave other tokens than plain decoding on prompt {index}", file=sys.stderr)
                    return 1
                run = Run.of(category, trace, base)
                runs[name].append(run)
                cells.append(f"{name} {run.speedup:.2f}x / {run.per_forward:.2f}")
            label = f"round {round_} [{index}]" if args.rounds > 1 else f"[{index}]"
            print(f"{label} {category}: " + ", ".join(cells), flush=True)
    plain_runs = runs.pop("plain")
    plain_step = statistics.median(step for run in plain_runs for step in run.verify_s)
    print(f"plain decoding: a step's forward {plain_step * 1e3:.2f} ms (median over every step)")
    print("medians over prompt runs: speedup vs plain / tokens per target forward (input-grounded prompts: speedup);\n"
          "in all: every run's tokens per second against plain decoding's; per step, medians over every step: "
          "proposing, the verifying forward (in plain steps)")
    for name, rows in runs.items():
        grounded = [run.speedup for run in rows if run.category in GROUNDED]
        in_all = total_speed(rows) / total_speed(plain_runs)
        verify = statistics.median(step for run in rows for step in run.verify_s)
        proposing = [step for run in rows for step in run.propose_s]
        print(f"{name}: {statistics.median(r.speedup for r in rows):.3f}x / "
              f"{statistics.median(r.per_forward for r in rows):.2f}"
              + (f" (grounded {statistics.median(grounded):.3f}x)" if grounded else "")
              + f"; in all {in_all:.3f}x; per step "
              + (f"proposing {statistics.median(proposing) * 1e3:.2f} ms, " if proposing else "")
              + f"verifying {verify * 1e3:.2f} ms ({verify / plain_step:.2f})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
