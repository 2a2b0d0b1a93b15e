"""Tokens per target forward of the copying proposers, replayed over plain decoding's greedy tokens.

Under greedy acceptance a step commits the longest agreement between a proposal and the target's own output, plus
one token from the target. Given plain decoding's tokens for a prompt, how many forwards a proposer that reads
only the text needs therefore follows without running the model per step: a proposer idea is measured in seconds
and free of the machine's timing noise. Replayed over the benchmark suite: prompt lookup (`--max-ngram`,
`--num-draft`, with its gate at `--verify-overhead` and ungated) and lookahead's prompt and output pools for
n-gram sizes M (`--text-ngrams`, G = `--guesses`) and longest keys K (`--contexts`), without and with its corpus
pool (`--corpus`), without the Jacobi window, whose guesses need the model.

    python experiments/replay_proposers.py [--new-tokens 128] [--text-ngrams 3,4,5,6] [--outputs FILE.json]

`--outputs` keeps plain decoding's tokens in a JSON file (written when missing, read when present), so later
replays skip the model. Speed is not replayed: a wider verification costs more (docs/results.md).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from playground.bench.suite import GROUNDED, SUITE  # noqa: E402
from playground.config import ConfigError, GenerationParams, ModelSpec, SamplingParams  # noqa: E402
from playground.decoding import encode_prompt  # noqa: E402
from playground.decoding.copies import agreement, find_continuation  # noqa: E402
from playground.decoding.lookahead import LookaheadParams  # noqa: E402
from playground.decoding.planning import NgramAcceptance  # noqa: E402
from playground.decoding.pools import TextPools  # noqa: E402
from playground.decoding.prompt_lookup import PromptLookupParams  # noqa: E402
from playground.engine import generate  # noqa: E402
from playground.models import LoadedModel, ModelLoadError, load_model  # noqa: E402
from playground.models.answers import default_answers, read_answers  # noqa: E402


class LookupProposer:
    """Prompt lookup's proposal: the copy after the latest occurrence of the longest matching suffix, let
    through where its n-gram length's running acceptance says the copy's expected tokens exceed 1 + `overhead`
    one-token steps (`overhead` None: every match, as classic prompt lookup does)."""

    def __init__(self, max_ngram: int, num_draft: int, overhead: float | None) -> None:
        self.max_ngram, self.num_draft = max_ngram, num_draft
        self.overhead = overhead
        self.gate = None if overhead is None else NgramAcceptance(max_ngram)
        self.ngram = 0

    def propose(self, sequence: list[int], budget: int) -> list[list[int]]:
        lookup = find_continuation(sequence, self.max_ngram, min(self.num_draft, budget))
        if self.gate is not None:
            self.gate.decay()
            if lookup and self.gate.expected_tokens(lookup.ngram, len(lookup.tokens)) <= 1.0 + self.overhead:
                lookup = None
        self.ngram = lookup.ngram if lookup else 0
        return [lookup.tokens] if lookup else []

    def judged(self, proposal: list[int], agreed: int) -> None:
        if self.gate is not None:
            self.gate.record(self.ngram, agreed, min(agreed + 1, len(proposal)))


class TextPoolProposer:
    """Lookahead's verification branch fed by the prompt's and the committed text's n-grams only (and the corpus
    pool's `seeds`, when given): up to G continuations of the last 1..K tokens, as `TextPools` keeps them."""

    def __init__(self, prompt_ids: list[int], text_ngram: int, guesses: int, context: int,
                 seeds: TextPools | None = None) -> None:
        # the corpus pool's seeds come before the prompt's n-grams, as in the decoder
        self.pools = TextPools(guesses, text_ngram, context, base=seeds)
        self.pools.add_text(prompt_ids)
        self.seen = len(prompt_ids)

    def propose(self, sequence: list[int], budget: int) -> list[list[int]]:
        # The last token is not committed to the text yet (the decoder feeds it with the step).
        committed = sequence[:-1]
        self.pools.add_text(committed, self.seen)
        self.seen = len(committed)
        return [list(c[:budget]) for c in self.pools.candidates(sequence)[0]]

    def judged(self, proposal: list[int], agreed: int) -> None:
        pass


def replay(prompt_ids: list[int], output_ids: list[int],
           proposer: LookupProposer | TextPoolProposer) -> float:
    """Tokens per target forward after the first token (which the prefill commits), bonus tokens included, as
    the metrics count them: each step keeps the proposal that agrees longest, plus the target's next token."""
    if len(output_ids) < 2:
        raise ValueError("output_ids must hold at least two tokens")
    known, forwards = 1, 0
    while known < len(output_ids):
        left = len(output_ids) - known
        proposals = proposer.propose(list(prompt_ids) + list(output_ids[:known]), left)
        agreed = [agreement(p, output_ids[known:]) for p in proposals]
        if proposals:
            best = max(range(len(proposals)), key=agreed.__getitem__)
            proposer.judged(proposals[best], agreed[best])
        known += min(max(agreed, default=0) + 1, left)
        forwards += 1
    return (len(output_ids) - 1) / forwards


def plain_outputs(target: LoadedModel, new_tokens: int) -> list[dict[str, object]]:
    """Plain decoding's greedy tokens for every suite prompt."""
    generation = GenerationParams(max_new_tokens=new_tokens)
    runs = []
    for i, (category, prompt) in enumerate(SUITE, 1):
        output, _ = generate(target, prompt, None, SamplingParams(), generation)
        runs.append({"category": category, "prompt_ids": encode_prompt(target, prompt, generation),
                     "output_ids": list(output.token_ids)})
        print(f"plain decoding {i}/{len(SUITE)}", file=sys.stderr)
    return runs


def sizes(text: str) -> list[int]:
    """A comma-separated list of n-gram sizes."""
    try:
        return [int(x) for x in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers such as 3,4,5, got {text!r}") from None


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--outputs", type=Path, default=None)
    parser.add_argument("--max-ngram", type=int, default=3)
    parser.add_argument("--num-draft", type=int, default=8)
    parser.add_argument("--verify-overhead", type=float, default=0.15,
                        help="the gate's price of a verifying forward over a one-token step, in such steps, minus "
                             "one (default %(default)s)")
    parser.add_argument("--text-ngrams", type=sizes, default=[3, 4, 5, 6])
    parser.add_argument("--guesses", type=int, default=2)
    parser.add_argument("--contexts", type=sizes, default=[1, 3],
                        help="longest keys K of the text pools to replay (lookahead's --context), e.g. 1,2,3")
    parser.add_argument("--corpus", default=default_answers("embedded"),
                        help="answers file whose M-grams seed the pools, as lookahead's corpus pool does (default: "
                             "the shipped one); 'none' to replay without")
    args = parser.parse_args()
    try:  # the proposers' own checks name the field and its range
        PromptLookupParams(max_ngram=args.max_ngram, num_draft=args.num_draft)
        for m in args.text_ngrams:
            for k in args.contexts:
                LookaheadParams(guesses=args.guesses, text_ngram=m, context=k)
        GenerationParams(max_new_tokens=args.new_tokens)
        corpus = read_answers(args.corpus)[0] if args.corpus and args.corpus != "none" else None
        cached = args.outputs is not None and args.outputs.exists()
        target = None if cached else load_model(ModelSpec())
    except (ConfigError, ModelLoadError) as error:
        parser.error(str(error))

    if cached:
        runs = json.loads(args.outputs.read_text())
    else:
        runs = plain_outputs(target, args.new_tokens)
        if args.outputs:
            args.outputs.write_text(json.dumps(runs))
    runs = [r for r in runs if len(r["output_ids"]) >= 2]

    proposers = {
        f"prompt lookup, gated at {args.verify_overhead}":
            lambda run: LookupProposer(args.max_ngram, args.num_draft, args.verify_overhead),
        "prompt lookup, ungated": lambda run: LookupProposer(args.max_ngram, args.num_draft, None),
        **{f"lookahead text pools, M {m}, G {args.guesses}, K {k}":
           (lambda run, m=m, k=k: TextPoolProposer(run["prompt_ids"], m, args.guesses, k))
           for m in args.text_ngrams for k in args.contexts},
        **({f"lookahead text pools and corpus, M {m}, G {args.guesses}, K {k}":
            (lambda run, m=m, k=k, seeds=TextPools.seeded(args.guesses, m, k, corpus):
             TextPoolProposer(run["prompt_ids"], m, args.guesses, k, seeds))
            for m in args.text_ngrams for k in args.contexts} if corpus else {}),
    }
    print(f"tokens per target forward, replayed over plain decoding's tokens ({len(runs)} suite prompts)")
    print(f"{'proposer':60s} {'median':>7s} {'grounded':>9s}  per prompt")
    for name, make in proposers.items():
        rates = [replay(r["prompt_ids"], r["output_ids"], make(r)) for r in runs]
        grounded = [x for x, r in zip(rates, runs) if r["category"] in GROUNDED]
        print(f"{name:60s} {statistics.median(rates):7.2f} {statistics.median(grounded):9.2f}  "
              + " ".join(f"{x:.2f}" for x in rates))
    return 0


if __name__ == "__main__":
    sys.exit(main())
