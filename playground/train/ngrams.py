"""`python -m playground.train ngrams`: the target's own greedy answers, whose most frequent n-grams seed
lookahead decoding's pool (`LookaheadParams.corpus_pool`).

Nothing is trained: the target answers a seeded sample of the draft's training prompts (never the benchmark's,
never the held-out ones) and the answers' token ids are saved; the decoder counts their n-grams when it is built,
for whatever M and G it runs with. A small model answers in habitual phrases (", and the", ". They are",
", which is", list numbers), which its own Jacobi window rarely guesses and a new prompt cannot supply.
"""

from __future__ import annotations

import argparse
import json
import random
import time
from pathlib import Path

from ..config import ModelSpec, check_int
from ..models.answers import ANSWERS, EMBEDDED_ANSWERS, save_answers
from . import log
from .draft import COMPUTE_DTYPES, generate_corpus
from .prompts import training_prompts

# The draft's prompt set: every template per topic, 10 extra templates per topic, 278 wide topics with 6 each.
PROMPT_SET = {"extra_templates": 10, "wide_topics": 278, "templates_per_wide_topic": 6}


def add_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="embedded", help="target model spec (default: embedded)")
    parser.add_argument("--out", default=str(EMBEDDED_ANSWERS.parent), help="output folder")
    parser.add_argument("--prompts", type=int, default=1024,
                        help="training prompts the target answers, sampled with --seed (default 1024)")
    parser.add_argument("--answer-tokens", type=int, default=128,
                        help="most tokens per answer, 8..512 (default 128)")
    parser.add_argument("--dtype", choices=COMPUTE_DTYPES, default="bfloat16",
                        help="precision of the target writing the answers (default bfloat16, 1.6x faster on a CPU "
                             "with AVX512-BF16; its answers follow float32's for about half their tokens)")
    parser.add_argument("--generate-batch", type=int, default=128,
                        help="prompts the target answers together, 1..512 (default 128)")
    parser.add_argument("--seed", type=int, default=0)


def sample_prompts(count: int, seed: int) -> list[str]:
    """`count` of the draft's training prompts, drawn with `seed`."""
    prompts = training_prompts(seed=seed, **PROMPT_SET)
    check_int("prompts", count, 1, len(prompts))
    random.Random(seed).shuffle(prompts)
    return prompts[:count]


def main(args: argparse.Namespace) -> int:
    from ..models import load_model

    check_int("answer_tokens", args.answer_tokens, 8, 512)
    check_int("generate_batch", args.generate_batch, 1, 512)
    prompts = sample_prompts(args.prompts, args.seed)
    target = load_model(ModelSpec(source=args.model, device="cpu"))
    start = time.perf_counter()
    corpus = generate_corpus(target, prompts, args.answer_tokens, args.dtype, args.generate_batch)
    answers = [s[a:] for s, a in zip(corpus.sequences, corpus.answer_starts)]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    save_answers(out / ANSWERS, answers, target.model.config.vocab_size, target.name)
    report = {"prompts": len(prompts), "answer_tokens": args.answer_tokens, "tokens": sum(map(len, answers)),
              "dtype": args.dtype, "generate_batch": args.generate_batch, "seed": args.seed, **PROMPT_SET,
              "generation_s": round(time.perf_counter() - start, 1)}
    (out / "report.json").write_text(json.dumps(report, indent=2))
    log("ngrams", json.dumps(report))
    return 0
