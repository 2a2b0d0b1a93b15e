"""What a trained early exit could draft, measured before one is built (issue 105). Self-speculation drafts with 29 of
the embedded target's 30 layers, because an early exit's own guess (the stream through the final norm and head)
rarely matches the target's. LayerSkip trains the model to exit early; here only a small exit head is trained, the
target left as it is: the residual stream entering layer
L, through a residual MLP (E -> 2E -> E), the target's final norm and its output rows, learns the target's top-16
distribution at every answer position of the corpus (`python -m playground.train corpus`).

Scored on the corpus's held-out split: the share of positions where the exit's top token is the target's (its
acceptance for greedy drafting), for the raw exit and the trained one at each L, with what a drafting forward
through L layers and the exit reads against a whole forward, and the chain speedup that projects on a flat curve
(a verifying forward as dear as one token: an upper bound, labelled as a projection).

    python experiments/exit_heads.py [--train-tokens 200000] [--held-tokens 30000] [--layers 6,10,14,18,22]
        [--epochs 3] [--vocab 8192]
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch import nn  # noqa: E402

from playground.config import ModelSpec  # noqa: E402
from playground.models import load_model  # noqa: E402
from playground.train.corpus import read, target_pass  # noqa: E402
from playground.train.medusa import at_answers  # noqa: E402

CORPUS = Path(__file__).resolve().parent.parent / "data" / "corpus"


class Exit(nn.Module):
    """h -> h + W2 silu(W1 rms(h)), zero-initialised so that training starts from the raw exit."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.norm = nn.RMSNorm(width, eps=1e-5)
        self.up = nn.Linear(width, 2 * width)
        self.down = nn.Linear(2 * width, width)
        nn.init.zeros_(self.down.weight)
        nn.init.zeros_(self.down.bias)

    def forward(self, h: torch.Tensor) -> torch.Tensor:  # (N, E) -> (N, E)
        return h + self.down(F.silu(self.up(self.norm(h))))


def scored_rows(model, tokens: torch.Tensor, vocab: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The `vocab` tokens most frequent in `tokens`, ascending (V',); where each token id sits among them (V,), -1
    for the others; and the target's output rows for them (V', E) in float32."""
    ids = torch.bincount(tokens.flatten(), minlength=model.config.vocab_size).argsort(descending=True)
    ids = ids[:vocab].sort().values
    where = torch.full((model.config.vocab_size,), -1, dtype=torch.int64)
    where[ids] = torch.arange(len(ids))
    return ids, where, model.output_weight.float()[ids]


def fit(module: nn.Module, count: int, loss: Callable[[torch.Tensor], torch.Tensor], epochs: int, lr: float,
        batch: int) -> float:
    """Train `module` over `count` positions, `epochs` passes in shuffled batches (AdamW, a one-cycle schedule),
    `loss(pick)` the loss of the positions `pick`; the seconds it took."""
    optimiser = torch.optim.AdamW(module.parameters(), lr=lr, weight_decay=0.0)
    steps = epochs * ((count + batch - 1) // batch)
    schedule = torch.optim.lr_scheduler.OneCycleLR(optimiser, lr, total_steps=steps, pct_start=0.05)
    began = time.perf_counter()
    for _ in range(epochs):
        order = torch.randperm(count)
        for i in range(0, count, batch):
            optimiser.zero_grad()
            loss(order[i : i + batch]).backward()
            optimiser.step()
            schedule.step()
    return time.perf_counter() - began


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--corpus", default=str(CORPUS))
    parser.add_argument("--train-tokens", type=int, default=200_000)
    parser.add_argument("--held-tokens", type=int, default=30_000)
    parser.add_argument("--layers", default="6,10,14,18,22", help="exits: the stream entering these layers")
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--vocab", type=int, default=8192, help="the exit scores the target's most frequent tokens")
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--batch", type=int, default=512, help="positions per optimiser step")
    args = parser.parse_args()
    torch.manual_seed(0)
    target = load_model(ModelSpec())
    model, layers = target.model, tuple(int(x) for x in args.layers.split(","))
    width, count = model.config.hidden_size, model.config.num_layers
    train, _ = read(Path(args.corpus), "train", args.train_tokens)
    held, _ = read(Path(args.corpus), "held-out", args.held_tokens)
    start = time.perf_counter()
    train_states, train = target_pass(target, train, layers, labels=True)
    held_states, held = target_pass(target, held, layers, labels=True)
    print(f"features: {time.perf_counter() - start:.0f} s", flush=True)
    x_train, x_held = at_answers(train_states, train)[0], at_answers(held_states, held)[0]  # (N, (1 + L) E)
    del train_states, held_states
    # the exit's vocabulary: the target's most frequent top tokens on the training positions
    ids, where, rows = scored_rows(model, train.topk_ids[:, 0], args.vocab)  # (V',), (V,), (V', E)
    norm = model.norm
    for p in norm.parameters():
        p.requires_grad_(False)

    def teacher(corpus) -> tuple[torch.Tensor, torch.Tensor]:
        """Soft labels over the exit's vocabulary: where the target's top-16 tokens sit in it (N, K) and their
        probabilities (N, K), renormalised over the tokens it scores (0 for the others)."""
        at = where[corpus.topk_ids]  # (N, K)
        probs = corpus.topk_logprobs.exp() * (at >= 0)
        return at.clamp(min=0), probs / probs.sum(1, keepdim=True).clamp(min=1e-9)

    at_train, p_train = teacher(train)  # (N, K) each
    top_held = held.topk_ids[:, 0]  # (N,) the target's greedy token
    layer_bytes = sum(p.nbytes for w, p in model.packed_products() if p is not model.packed_output) / count
    head_bytes = model.packed_output.nbytes * len(ids) / model.config.vocab_size
    whole = layer_bytes * count + model.packed_output.nbytes
    print(f"train positions {len(x_train)}, held-out {len(x_held)}; exit vocabulary {len(ids)}", flush=True)
    print("| exit: stream entering layer | raw exit agrees | trained exit agrees | drafting forward / whole "
          "forward | best chain on a flat curve (projection) |")
    print("|---|---|---|---|---|")
    for n, layer in enumerate(layers, start=1):
        h_train = x_train[:, n * width : (n + 1) * width].float()  # (N, E)
        h_held = x_held[:, n * width : (n + 1) * width].float()

        def agree(exit_: nn.Module | None) -> float:
            with torch.no_grad():
                h = h_held if exit_ is None else exit_(h_held)
                guess = ids[(norm(h) @ rows.T).argmax(-1)]  # (N,)
            return float((guess == top_held).float().mean())

        raw = agree(None)
        exit_ = Exit(width)

        def loss(pick: torch.Tensor) -> torch.Tensor:
            logits = norm(exit_(h_train[pick])) @ rows.T  # (B, V')
            return -(p_train[pick] * logits.log_softmax(-1).gather(1, at_train[pick])).sum(-1).mean()

        seconds = fit(exit_, len(h_train), loss, args.epochs, args.lr, args.batch)
        trained = agree(exit_)
        adapter = sum(p.numel() for p in exit_.parameters()) * 1.0625  # as Q8_0 blocks
        cost = (layer * layer_bytes + head_bytes + adapter) / whole
        best = max(((1 - trained ** (g + 1)) / (1 - trained) / (1 + g * cost), g) for g in range(1, 9))
        print(f"| {layer} of {count} | {100 * raw:.1f}% | {100 * trained:.1f}% ({seconds:.0f} s "
              f"training) | {cost:.2f} | {best[0]:.2f}x at {best[1]} drafted |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
