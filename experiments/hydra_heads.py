"""Medusa's heads against Hydra's, measured before one is built (issue 105). The shipped Medusa heads guess tokens
t+2..t+5 from the target's final state h_t and the embedding of the next token x_{t+1}, all at once, so head k
never knows what head k-1 guessed. Hydra (Ankner et al. 2024) makes the heads sequential: head k also reads the
token guessed just before its own. Both kinds are trained here on the same corpus positions, the same way (the
target's final states from its own forward, the next tokens from the corpus's answers, cross-entropy on the token
k+2 ahead, the heads scoring the target's most frequent tokens), and scored on the corpus's held-out split:

- each head's top-1 accuracy where every earlier token is right (teacher-forced: what a chain accepts at that
  depth, given it got there), and
- the chain's expected tokens per step, 1 + a_1 + a_1 a_2 + ... (the next token always kept; head k's guess kept
  only where the guesses before it were, each feeding the next Hydra head its own guess).

    python experiments/hydra_heads.py [--train-tokens 200000] [--held-tokens 30000] [--heads 4] [--epochs 3]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from exit_heads import fit, scored_rows  # noqa: E402  (this folder: the script's own)
from torch import nn  # noqa: E402

from playground.config import ModelSpec  # noqa: E402
from playground.models import load_model  # noqa: E402
from playground.train.corpus import read, target_pass  # noqa: E402

CORPUS = Path(__file__).resolve().parent.parent / "data" / "corpus"


class Heads(nn.Module):
    """Head k: (h, e_next, e_before) -> h + silu(W_k [h; e_next; e_before]) -> scores over the vocabulary's rows.
    e_before is the embedding of the token just before the one head k guesses (Hydra); Medusa's heads get zeros
    there, so both have the same shape and training."""

    def __init__(self, width: int, heads: int, sequential: bool) -> None:
        super().__init__()
        self.sequential = sequential
        self.blocks = nn.ModuleList(nn.Linear(3 * width, width) for _ in range(heads))
        for block in self.blocks:
            nn.init.zeros_(block.weight)
            nn.init.zeros_(block.bias)

    def state(self, k: int, h: torch.Tensor, e_next: torch.Tensor, e_before: torch.Tensor) -> torch.Tensor:
        before = e_before if self.sequential else torch.zeros_like(e_before)
        return h + F.silu(self.blocks[k](torch.cat((h, e_next, before), -1)))  # (N, E)


def windows(states: list[torch.Tensor], corpus, heads: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Every answer position t with heads + 1 tokens after it: the target's final state there (N, E) and the token
    ids x_{t+1} .. x_{t+heads+1} (N, heads + 1)."""
    rows, ids = [], []
    for s, sequence, answer in zip(states, corpus.sequences, corpus.answer_starts):
        tokens = torch.tensor(sequence)
        last = len(sequence) - heads - 1  # one past the last t whose tokens t+1 .. t+heads+1 exist
        if last < answer:  # no position with every token it needs
            continue
        rows.append(s[answer - 1 : last])
        ids.append(tokens[answer:].unfold(0, heads + 1, 1)[: last - answer + 1])
    return torch.cat(rows).float(), torch.cat(ids)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--corpus", default=str(CORPUS))
    parser.add_argument("--train-tokens", type=int, default=200_000)
    parser.add_argument("--held-tokens", type=int, default=30_000)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--vocab", type=int, default=8192)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--batch", type=int, default=512)
    args = parser.parse_args()
    torch.manual_seed(0)
    target = load_model(ModelSpec())
    model, width = target.model, target.model.config.hidden_size
    train, _ = read(Path(args.corpus), "train", args.train_tokens)
    held, _ = read(Path(args.corpus), "held-out", args.held_tokens)
    started = time.perf_counter()
    h_train, x_train = windows(target_pass(target, train)[0], train, args.heads)  # (N, E), (N, K + 1)
    h_held, x_held = windows(target_pass(target, held)[0], held, args.heads)
    print(f"features: {time.perf_counter() - started:.0f} s; positions {len(h_train)} to train, {len(h_held)} held out",
          flush=True)
    embed = model.embed_tokens.weight.float()  # (V, E)
    ids, where, rows = scored_rows(model, x_train, args.vocab)  # (V',), (V,), (V', E)
    norm = model.norm
    for p in norm.parameters():
        p.requires_grad_(False)
    results = {}
    for name, sequential in (("Medusa (all at once)", False), ("Hydra (each sees the guess before)", True)):
        heads = Heads(width, args.heads, sequential)

        def loss(pick: torch.Tensor) -> torch.Tensor:
            h, x = h_train[pick], x_train[pick]  # (B, E), (B, K + 1)
            total = torch.zeros(())
            for k in range(args.heads):
                scores = norm(heads.state(k, h, embed[x[:, 0]], embed[x[:, k]])) @ rows.T  # (B, V')
                wanted = where[x[:, k + 1]]  # (B,) -1 outside the scored tokens
                keep = wanted >= 0
                total = total + F.cross_entropy(scores[keep], wanted[keep])
            return total

        seconds = fit(heads, len(h_train), loss, args.epochs, args.lr, args.batch)
        with torch.no_grad():
            right = torch.ones(len(h_held), dtype=torch.bool)  # every guess so far right (chained)
            guessed = x_held[:, 0]  # the token before head 0's: the next token, always known
            forced, chained = [], [1.0]
            for k in range(args.heads):
                e_before_forced = embed[x_held[:, k]]
                top = ids[(norm(heads.state(k, h_held, embed[x_held[:, 0]], e_before_forced)) @ rows.T).argmax(-1)]
                forced.append(float((top == x_held[:, k + 1]).float().mean()))
                own = ids[(norm(heads.state(k, h_held, embed[x_held[:, 0]], embed[guessed])) @ rows.T).argmax(-1)]
                right &= own == x_held[:, k + 1]
                chained.append(float(right.float().mean()))
                guessed = own
        results[name] = (forced, sum(chained), seconds)
    print(f"| heads | {' | '.join(f'head {k + 1} (t+{k + 2})' for k in range(args.heads))} | tokens a step, one "
          "chain | training |")
    print("|---|" + "---|" * args.heads + "---|---|")
    for name, (forced, tokens, seconds) in results.items():
        print(f"| {name} | {' | '.join(f'{100 * a:.1f}%' for a in forced)} | {tokens:.2f} | {seconds:.0f} s |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
