"""`python -m playground.train layerskip`: which of the target's layers draft for self-speculative decoding.

Nothing is trained. The target answers a seeded sample of the training prompts greedily (never the benchmark's);
a set of drafting layers is scored by how often its next-token guess is the target's token as it reads the answers
teacher-forced (its acceptance, a), and by what its drafting forward reads beside the full forward's (its cost c,
from the weights, the output rows of the proposal vocabulary included). The score is the speedup this machine's
measured forward-cost curve predicts for a chain of g = 1..gamma drafted tokens each kept with a:
(1 + a + ... + a^g) / (cost(1 + g) + g c), at the best g. Candidates, in the spirit of SWIFT's search over skipped
layers: every early exit (a prefix of layers), and the sets a greedy search reaches by removing, each round, the
layer whose removal keeps a highest on a few of the answers; the best candidates are scored again on all of them.
Written to `layers.json` (the choice, its figures and every candidate's) beside the proposal vocabulary, the most
frequent tokens of the answers and of the target's shipped answers corpus, whose output rows alone a drafting
forward scores.
"""

from __future__ import annotations

import argparse
import json
import platform
import time
from collections import Counter
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from ..config import EngineParams, GenerationParams, ModelSpec, check_int
from ..decoding.self_speculative import EMBEDDED_LAYERS, LAYERS, drafting_cost, format_layers
from ..models.answers import default_answers, load_answers
from ..models.vocab import PROPOSAL_VOCAB, VOCAB_IDS, OutputRows, output_rows
from . import log
from .ngrams import sample_prompts


def add_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="embedded", help="target model spec (default: embedded)")
    parser.add_argument("--out", default=str(EMBEDDED_LAYERS.parent), help="output folder")
    parser.add_argument("--prompts", type=int, default=24,
                        help="training prompts the target answers, sampled with --seed, 2..1024 (default 24)")
    parser.add_argument("--search-prompts", type=int, default=6,
                        help="of those, the answers the greedy search scores each removal on (default 6)")
    parser.add_argument("--answer-tokens", type=int, default=48, help="most tokens per answer, 8..256 (default 48)")
    parser.add_argument("--gamma", type=int, default=4, help="most drafted tokens per step scored, 1..16 (default 4)")
    parser.add_argument("--min-layers", type=int, default=None,
                        help="fewest drafting layers considered (default: a quarter of the target's)")
    parser.add_argument("--proposal-vocab", type=int, default=8192,
                        help="most frequent tokens of the answers (and of the target's shipped answers corpus, where "
                             "one ships) a drafting forward scores, 1..vocab (default 8192)")
    parser.add_argument("--finalists", type=int, default=6,
                        help="best candidates on the search's answers scored again on all (default 6)")
    parser.add_argument("--seed", type=int, default=0)


class Scorer:
    """Teacher-forced agreement of drafting layer sets with the target on its own answers."""

    def __init__(self, target: Any, sequences: list[tuple[list[int], int]], rows: OutputRows) -> None:
        from ..decoding.base import contiguous_cache

        self.target, self.sequences, self.rows = target, sequences, rows  # (ids, where the answer starts)
        self.cache = contiguous_cache(target.model, max(len(ids) for ids, _ in sequences))
        self.count = target.model.config.num_layers

    @torch.inference_mode()
    def agreement(self, layers: tuple[int, ...], first: int | None = None) -> float:
        """The share of answer tokens (of the first `first` answers; None: all) that the drafting layers guess."""
        model, skip = self.target.model, frozenset(range(self.count)) - set(layers)
        agreed = judged = 0
        for ids, start in self.sequences[:first]:
            self.cache.truncate(0, 0)
            tokens = torch.tensor([ids])  # (1, T)
            positions = torch.arange(len(ids)).unsqueeze(0)  # (1, T)
            _, hidden = model(tokens, positions, self.cache, (0,), num_logits=0, skip=skip)  # (1, T, E)
            guess = self.rows.ids[self.rows.logits(hidden[0, start - 1 : -1]).argmax(-1)]  # (A,)
            agreed += int((guess == tokens[0, start:]).sum())
            judged += len(ids) - start
        return agreed / max(judged, 1)

    def cost(self, layers: tuple[int, ...]) -> float:
        """A drafting forward over the full one, by the weights each reads."""
        return drafting_cost(self.target.model, layers, self.rows)

    def score(self, alpha: float, cost: float, curve: Any, gamma: int) -> tuple[float, int]:
        """The predicted speedup of a chain kept with `alpha` per token at draft cost `cost`, and its best depth."""
        return max(((sum(alpha ** i for i in range(g + 1)) / (curve.step_cost(1, 1 + g) + g * cost), g)
                    for g in range(1, gamma + 1)), default=(1.0, 0))


def main(args: argparse.Namespace) -> int:
    from ..decoding import encode_prompt
    from ..decoding.costs import forward_costs
    from ..engine import Engine
    from ..models import load_model

    check_int("answer_tokens", args.answer_tokens, 8, 256)
    check_int("gamma", args.gamma, 1, 16)
    check_int("finalists", args.finalists, 1, 64)
    prompts = sample_prompts(args.prompts, args.seed)
    check_int("search_prompts", args.search_prompts, 1, len(prompts))
    start = time.perf_counter()
    target = load_model(ModelSpec(source=args.model, device="cpu"))
    model, count = target.model, target.model.config.num_layers
    lowest = count // 4 if args.min_layers is None else args.min_layers
    check_int("min_layers", lowest, 1, count - 1)
    check_int("proposal_vocab", args.proposal_vocab, 1, model.config.vocab_size)

    log("layerskip", f"the target answers {len(prompts)} training prompts ({args.answer_tokens} tokens each)")
    generation = GenerationParams(max_new_tokens=args.answer_tokens)
    engine = Engine(target, EngineParams(max_running=8))
    asked = {engine.add_request(p, generation=generation): encode_prompt(target, p, generation) for p in prompts}
    outputs = engine.run_all()
    sequences = [(ids + list(outputs[rid].token_ids), len(ids)) for rid, ids in asked.items()
                 if outputs[rid].token_ids]
    # the proposal vocabulary: the most frequent tokens of these answers and of the target's shipped answers corpus
    frequent = Counter(t for ids, at in sequences for t in ids[at:])
    corpus = default_answers(args.model)
    if corpus is not None:
        frequent.update(t for answer in load_answers(corpus, model.config.vocab_size) for t in answer)
    vocab_ids = torch.tensor(sorted(t for t, _ in frequent.most_common(args.proposal_vocab)), dtype=torch.int64)
    scorer = Scorer(target, sequences, output_rows(model, vocab_ids))
    curve = forward_costs(model)

    # the candidates: every early exit, and each set the greedy removal reaches, scored on the search's answers
    few = args.search_prompts
    tried: dict[tuple[int, ...], float] = {}

    def alpha(layers: tuple[int, ...]) -> float:
        if layers not in tried:
            tried[layers] = scorer.agreement(layers, few)
        return tried[layers]
    reached = [tuple(range(k)) for k in range(lowest, count)]
    for layers in reached:
        alpha(layers)
    log("layerskip", f"early exits scored ({time.perf_counter() - start:.0f} s)")
    current = tuple(range(count))
    while len(current) > lowest:
        current = max((tuple(i for i in current if i != gone) for gone in current), key=alpha)
        reached.append(current)
        log("layerskip", f"{len(current)} layers: {format_layers(current)} keeps a = {alpha(current):.3f} "
                         f"({time.perf_counter() - start:.0f} s)")
    ranked = sorted(reached, key=lambda ls: -scorer.score(tried[ls], scorer.cost(ls), curve, args.gamma)[0])
    finalists: list[dict[str, Any]] = []
    for layers in ranked[: args.finalists]:
        a, c = scorer.agreement(layers), scorer.cost(layers)
        speedup, depth = scorer.score(a, c, curve, args.gamma)
        finalists.append({"layers": format_layers(layers), "count": len(layers), "alpha": round(a, 4),
                          "draft_cost": round(c, 4), "gamma": depth, "predicted_speedup": round(speedup, 4)})
    best = max(finalists, key=lambda f: f["predicted_speedup"])
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    save_file({VOCAB_IDS: vocab_ids}, str(out / PROPOSAL_VOCAB))
    report = {"layers": best["layers"], "model": target.name, "chosen": best, "finalists": finalists,
              "searched": [{"layers": format_layers(ls), "alpha_on_search": round(tried[ls], 4)} for ls in reached],
              "prompts": len(prompts), "search_prompts": few, "answer_tokens": args.answer_tokens,
              "proposal_vocab": len(vocab_ids), "seed": args.seed, "machine": platform.processor() or
              platform.machine(), "seconds": round(time.perf_counter() - start, 1),
              "note": "predicted_speedup is a projection from teacher-forced agreement and the measured curve"}
    (out / LAYERS).write_text(json.dumps(report, indent=2))
    log("layerskip", json.dumps(best))
    return 0
