"""What a drafting forward costs with no host work around it, against the bytes it reads: one EAGLE head forward
(its native layer over `--rows` new rows of one request and `--keys` keys, its output rows and top-k) and one
draft-model decode forward (one token over `--keys` cached ones), each the median of `--rounds`, over this machine's
one-token target forward (the engine's cached curve), beside `own_estimate` (the bytes each reads over the
target's, at the rows it runs on that curve). The bench's `draft_forward` is the same price measured inside
`propose`, host work included; the gap between the two is the proposer's bookkeeping per depth.

    python experiments/drafting_ceiling.py [--rows 4] [--keys 100] [--rounds 80]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from playground.config import ModelSpec  # noqa: E402
from playground.decoding.costs import forward_costs  # noqa: E402
from playground.decoding.registry import build_proposer  # noqa: E402
from playground.engine.engine import one_request_costs  # noqa: E402
from playground.kv import PagedKVCache  # noqa: E402
from playground.models import load_model  # noqa: E402


def median_s(run: Callable[[], object], rounds: int) -> float:
    times = []
    with torch.inference_mode():
        for i in range(rounds + 3):  # the first three warm up
            start = time.perf_counter()
            run()
            if i >= 3:
                times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=4)
    parser.add_argument("--keys", type=int, default=100)
    parser.add_argument("--rounds", type=int, default=80)
    args = parser.parse_args()
    target = load_model(ModelSpec())
    costs = forward_costs(target.model, forwards=target.forwards)
    one_s, relative = costs.time(1), one_request_costs(target)
    eagle, draft = build_proposer(target, "eagle"), build_proposer(target, "speculative")
    head, cfg, t, past = eagle.eagle, eagle.eagle.head.config, args.rows, args.keys
    embeddings, features = torch.randn(1, t, cfg.hidden_size), torch.randn(1, t, cfg.hidden_size)  # (1, T, E)
    cos, sin = target.model.rope(torch.arange(past, past + t).unsqueeze(0), torch.float32)
    past_k, past_v = (torch.randn(1, cfg.num_kv_heads, past, cfg.head_dim) for _ in range(2))  # (1, Hkv, L, D)
    visible = torch.ones(1, t, past + t, dtype=torch.bool)  # (1, T, L + T)

    def head_forward() -> object:
        out = head.head(embeddings, features, cos, sin, past_k, past_v, visible)[0]  # (1, T, E)
        return head.output.logits(out).log_softmax(-1).topk(eagle.top_k, dim=-1)

    model = draft.draft.model
    dcfg = model.config
    cache = PagedKVCache(dcfg.num_layers, dcfg.num_kv_heads, dcfg.head_dim, past // 8 + 4, 8, dtype=torch.float32,
                         device="cpu")
    cache.blocks.add_sequence(0, [])
    with torch.inference_mode():
        model(torch.zeros(1, past, dtype=torch.long), torch.arange(past).unsqueeze(0), cache, [0], num_logits=0)

    def draft_forward() -> object:
        out = model(torch.zeros(1, 1, dtype=torch.long), torch.tensor([[past]]), cache, [0], num_logits=0)
        cache.truncate(0, past)
        return out

    print(f"one-token target forward {1e3 * one_s:.2f} ms (the cached curve); median of {args.rounds}\n")
    print("| forward | ms | target forwards | bytes predict | over bytes |\n|---|---|---|---|---|")
    for name, run, estimate in ((f"EAGLE head, {t} rows, output rows and top-k", head_forward,
                                 eagle.own.prior * relative(t)),
                                ("draft model, 1 token", draft_forward, draft.own_estimate(relative))):
        seconds = median_s(run, args.rounds)
        print(f"| {name} | {1e3 * seconds:.3f} | {seconds / one_s:.3f} | {estimate:.3f} | "
              f"{seconds / one_s / estimate:.2f} |")


if __name__ == "__main__":
    main()
