"""The most any tree of a draft model's guesses could give where a forward over many tokens costs about one (as on a
GPU), with and without prompt lookup's copies: a ceiling for speculative decoding whatever shape its proposals take.

    python experiments/draft_ceiling.py [--limit 14] [--new-tokens 96] [--draft SPEC] [--top-k 1 2 4 8] [--depth 2 3 4]
                                    [--verify-cost 0.005]

Each suite prompt is answered greedily by plain decoding; one draft forward over the prompt and that answer ranks
each answer token among the draft's guesses (over its proposal vocabulary) after the true text before it. A tree
that expands the top-k guesses of every node, D deep, then keeps at each step the answer's next tokens for as long
as each ranks below k: along the kept path the draft reads the true text, so teacher forcing gives exactly what
drafting would. With copies, a step keeps the longer of that and the best copy prompt lookup could make
(`copies.best_copy`, up to 8 tokens). Tokens per target forward (TPF), first token from the prefill as the engine
counts it, are an upper bound for any tree of that width and depth. The speedup bound is TPF / (verify + D x
price): the verification of the whole tree (k + k^2 + ... + k^D nodes, and the copy's 8 tokens) priced by
`gpu_ceiling.py`'s flat curve (each token beyond the first adds `--verify-cost` one-token forwards), each of the D
draft forwards a step at the GPU's estimate (the draft's layers over the target's, as `gpu_ceiling.py` prices it).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from playground.bench.suite import SUITE  # noqa: E402
from playground.config import GenerationParams, ModelSpec  # noqa: E402
from playground.decoding.base import encode_prompt, forward_tokens, new_cache  # noqa: E402
from playground.decoding.copies import best_copy  # noqa: E402
from playground.decoding.costs import FLAT_TOKEN_COST  # noqa: E402
from playground.decoding.prompt_lookup import LOOKUP_TOKENS, PromptLookupParams  # noqa: E402
from playground.engine import generate  # noqa: E402
from playground.models import LoadedModel, load_model  # noqa: E402
from playground.models.loader import load_draft  # noqa: E402
from playground.models.vocab import proposal_rows  # noqa: E402

GOAL = 1.8  # the speedup goal for speculative decoding on a GPU


@torch.inference_mode()
def answer_ranks(draft: LoadedModel, prompt_ids: list[int], answer: list[int]) -> list[int]:
    """Each answer token's rank (0: the draft's first guess) among the draft's guesses after the text before it;
    a token outside the draft's proposal vocabulary ranks past every other."""
    model = draft.model
    cache = new_cache(model, len(prompt_ids) + len(answer), GenerationParams())
    # (A, V): the logits each answer token is guessed from, -inf outside the proposal vocabulary
    logits = forward_tokens(model, cache, prompt_ids + answer[:-1], num_logits=len(answer), rows=proposal_rows(draft))
    wanted = torch.tensor(answer, device=model.device)  # (A,)
    chosen = logits.gather(1, wanted[:, None])  # (A, 1)
    ranks = (logits > chosen).sum(1)  # (A,)
    ranks[chosen[:, 0] == -torch.inf] = logits.shape[1]
    return ranks.tolist()


def tokens_per_forward(prompt_ids: list[int], answer: list[int], ranks: list[int], top_k: int, depth: int,
                       copies: bool) -> tuple[int, int]:
    """(tokens committed after the prefill's, target forwards) of the best tree `top_k` wide and `depth` deep,
    and with `copies` the best copy as well, along the answer."""
    known, forwards = 1, 0
    while known < len(answer):
        kept = 0
        while kept < depth and known + kept < len(answer) and ranks[known + kept] < top_k:
            kept += 1
        if copies:
            kept = max(kept, best_copy(prompt_ids + answer[:known], answer[known:], PromptLookupParams().max_ngram,
                                       LOOKUP_TOKENS))
        known += min(kept + 1, len(answer) - known)
        forwards += 1
    return len(answer) - 1, forwards


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--limit", type=int, default=len(SUITE), help="the suite's first N prompts")
    parser.add_argument("--new-tokens", type=int, default=96)
    parser.add_argument("--draft", help="the draft's model spec (default: the one shipped for the embedded model)")
    parser.add_argument("--top-k", type=int, nargs="+", default=[1, 2, 4, 8], help="guesses expanded per node")
    parser.add_argument("--depth", type=int, nargs="+", default=[2, 3, 4], help="drafted depths (draft forwards)")
    parser.add_argument("--verify-cost", type=float, default=FLAT_TOKEN_COST,
                        help="what each verified token beyond the first adds, in one-token forwards")
    args = parser.parse_args()
    target = load_model(ModelSpec(device="cpu", dtype="float32"))
    draft = load_draft(args.draft, target)
    price = draft.model.config.num_layers / target.model.config.num_layers
    generation = GenerationParams(max_new_tokens=args.new_tokens)
    answers = []
    for _, prompt in SUITE[: args.limit]:
        prompt_ids = encode_prompt(target, prompt, generation)
        answer = list(generate(target, prompt, None, None, generation)[0].token_ids)
        answers.append((prompt_ids, answer, answer_ranks(draft, prompt_ids, answer)))
    print(f"{len(answers)} prompts x {args.new_tokens} tokens, greedy; draft {draft.name}, a forward priced "
          f"{price:.3f} of the target's")
    print(f"| copies | top-k | depth | nodes verified | TPF upper bound | speedup bound | >= {GOAL}x |")
    print("|---|---|---|---|---|---|---|")
    for copies in (False, True):
        for top_k in args.top_k:
            for depth in args.depth:
                counts = [tokens_per_forward(p, a, r, top_k, depth, copies) for p, a, r in answers]
                tpf = sum(t for t, _ in counts) / sum(f for _, f in counts)
                nodes = sum(top_k ** d for d in range(1, depth + 1)) + (LOOKUP_TOKENS if copies else 0)
                bound = tpf / (1 + args.verify_cost * nodes + depth * price)
                print(f"| {'yes' if copies else 'no'} | {top_k} | {depth} | {nodes} | {tpf:.2f} | "
                      f"{bound:.2f}x | {'yes' if bound >= GOAL else 'no'} |", flush=True)


if __name__ == "__main__":
    main()
