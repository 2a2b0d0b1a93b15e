"""Would an EAGLE head draft better reading the target's low, middle and high layers (as EAGLE-3) than its final-norm
features (as the shipped head)? A like-for-like bound on a CPU budget, before the runner is changed to return them.

    python experiments/eagle_features.py --corpus FILE [--sequences 1200] [--epochs 4] [--layers 2 15 27]
                                     [--variants [VARIANT ...]] [--reference DIR ...]

Each variant trains a fresh head (the shipped architecture, `--unroll 2`, the trainer's schedule and batches) for
the same steps on the same corpus sequences (a seeded sample of `--sequences` from the trainer's `--corpus` file):
- final: reads the final-norm features, learns them (smooth-L1) plus 0.5 x the tokens (the shipped recipe);
- final-tokens: reads the final-norm features, learns the tokens only;
- layers: reads a learned linear mix of the residual stream entering `--layers` (3E -> E, EAGLE-3's fusion), and
  learns the tokens only (its prediction is no target feature; deeper passes read it as they read the mix);
- layers-normed: the same with each layer's state scaled to unit RMS at each position before the mix;
- final+layers: the mix of the final-norm features and the scaled layers' states (4E -> E), tokens only.
Then each drafts on the held-out prompts' greedy answers, teacher-forced along the true text (which is what drafting
would read while its guesses are right), as a chain 4 deep: the share of positions whose first d guesses are all the
target's tokens, and the chain's tokens per target forward, 1 + the sum of those shares. The top-4 column is the
share whose first token is among the head's 4 likeliest (what a tree's first level can keep). `--reference` adds a
row for each trained head's folder (the shipped one: `assets/eagle-smollm2-135m`; a head the trainer saved with
`--taps` reads its own layers), measured the same way.
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from playground.config import ModelSpec  # noqa: E402
from playground.models import load_model  # noqa: E402
from playground.models.eagle import EagleHead, head_config, load_head  # noqa: E402
from playground.models.linear import Linear  # noqa: E402
from playground.models.vocab import rows_of  # noqa: E402
from playground.train.draft import Corpus, frequent_vocabulary, generate_corpus, one_cycle  # noqa: E402
from playground.train.eagle import batches, unrolled  # noqa: E402
from playground.train.medusa import sequence_states  # noqa: E402
from playground.train.prompts import held_out_prompts  # noqa: E402

DEPTH = 4  # the chain the held-out report drafts
VARIANTS = ["final", "final-tokens", "layers", "layers-normed", "final+layers"]


class Variant(torch.nn.Module):
    """A head and, for the variants that read layers, the mix it reads them through."""

    def __init__(self, name: str, target, taps: int) -> None:
        super().__init__()
        self.name, cfg = name, head_config(target.model)
        self.head = EagleHead(cfg)
        mixed = {"layers": taps, "layers-normed": taps, "final+layers": taps + 1}.get(name)
        self.fuse = Linear(mixed * cfg.hidden_size, cfg.hidden_size, bias=False) if mixed else None

    def inputs(self, feats: torch.Tensor, noise: float, generator: torch.Generator | None) -> torch.Tensor:
        """What pass 1 reads (B, N, E) from the stored features (B, N, (1 + L) E)."""
        e = self.head.config.hidden_size
        parts = list(feats.split(e, -1))  # final, then each tap: (B, N, E)
        parts = {"layers": parts[1:], "layers-normed": parts[1:], "final+layers": parts}.get(self.name, parts[:1])
        if self.name in ("layers-normed", "final+layers"):  # each to unit RMS per position, as the final norm's input
            parts = [p * p.pow(2).mean(-1, keepdim=True).add(1e-6).rsqrt() for p in parts]
        if noise:
            parts = [p + noise * p.pow(2).mean().sqrt() * torch.randn(p.shape, generator=generator) for p in parts]
        return parts[0] if self.fuse is None else self.fuse(torch.cat(parts, -1))


class Trained(torch.nn.Module):
    """A head the trainer saved, reading what its config names: the final-norm features or its taps' inputs."""

    def __init__(self, folder: str, target) -> None:
        super().__init__()
        loaded = load_head(folder, target)
        self.name, self.head, self.vocab_ids = folder, loaded.head, loaded.vocab_ids
        self.output = loaded.output.weight.float()  # (V', E) the target's output rows for the head's vocabulary

    def inputs(self, feats: torch.Tensor, noise: float, generator: torch.Generator | None) -> torch.Tensor:
        return self.head.read(feats)  # (B, N, E)


def passes(variant: Variant | Trained, target, ids, feats, unroll, noise, generator, first=0):
    b, t = ids.shape
    embeddings = target.model.embed_tokens.weight[ids[:, 1:]].float()  # e(x_{j+1}) (B, T-1, E)
    positions = torch.arange(t - 1).expand(b, t - 1)
    cos, sin = target.model.rope(positions, torch.float32)
    x = variant.inputs(feats[:, :-1], noise, generator)  # (B, T-1, E)
    return unrolled(variant.head, embeddings, x, cos, sin, unroll, first)


def train(variant: Variant, target, corpus: Corpus, feats, output, args) -> float:
    generator = torch.Generator().manual_seed(0)
    torch.manual_seed(0)
    steps = args.epochs * math.ceil(len(corpus.sequences) / args.batch)
    optimizer = torch.optim.AdamW(variant.parameters(), lr=args.lr, weight_decay=0.0)
    schedule = one_cycle(optimizer, args.lr, steps, 0.05)
    pad, start, e = target.eos_token_ids[0], time.perf_counter(), output.shape[1]
    variant.train()
    for _ in range(args.epochs):
        for group in batches([len(s) for s in corpus.sequences], args.batch, generator):
            width = max(len(corpus.sequences[i]) for i in group)
            ids = torch.tensor([corpus.sequences[i] + [pad] * (width - len(corpus.sequences[i])) for i in group])
            f = torch.zeros(len(group), width, feats[group[0]].shape[-1])  # (B, T, (1 + L) E)
            for row, i in enumerate(group):
                f[row, : len(feats[i])] = feats[i].float()
            lengths = torch.tensor([len(corpus.sequences[i]) for i in group])
            starts = torch.tensor([corpus.answer_starts[i] for i in group])
            j = torch.arange(width - 1).unsqueeze(0)
            answer = (j + 1 < lengths.unsqueeze(1)) & (j + 2 >= starts.unsqueeze(1))  # (B, T-1)
            truth = f[:, 1:, :e][answer]  # (N, E) the final-norm features each answer position predicts
            teacher = (truth @ output.T).softmax(-1)  # (N, V')
            row = torch.full(answer.shape, -1)
            row[answer] = torch.arange(len(truth))
            with torch.autocast("cpu", dtype=torch.bfloat16):
                losses = []
                for k, (offset, predicted) in enumerate(passes(variant, target, ids, f, args.unroll, 0.1, generator,
                                                               max(0, int(starts.min()) - 2)), start=1):
                    valid = answer[:, offset:] & (j[:, offset:] >= k - 1)
                    rows, guess = row[:, offset:][valid], predicted[valid].float()  # (N_k,), (N_k, E)
                    loss = -(teacher[rows] * (guess @ output.T).log_softmax(-1)).sum(-1).mean()
                    if variant.name == "final":
                        loss = F.smooth_l1_loss(guess, truth[rows]) + 0.5 * loss
                    losses.append(loss)
                loss = torch.stack(losses).mean()
            optimizer.zero_grad()
            loss.backward()
            torch.nn.utils.clip_grad_norm_(variant.parameters(), 1.0)
            optimizer.step()
            schedule.step()
    variant.eval()
    return time.perf_counter() - start


@torch.no_grad()
def held_out(variant: Variant | Trained, target, corpus: Corpus, feats, output, vocab_ids) -> tuple[list[float], float]:
    """The share of chains whose first d guesses are right, d = 1..DEPTH, and of first tokens among the top 4."""
    kept, top4, count = [0] * DEPTH, 0, 0
    for seq, start, f in zip(corpus.sequences, corpus.answer_starts, feats):
        ids = torch.tensor([seq])
        n = len(seq) - 1  # positions j = 0..n-1 draft token j + 2 from feature j
        right = torch.zeros(DEPTH, n, dtype=torch.bool)  # pass k at position j guessed x_{j+2}
        for k, (offset, predicted) in enumerate(passes(variant, target, ids, f.float().unsqueeze(0), DEPTH, 0.0,
                                                       None), start=1):
            logits = predicted[0].float() @ output.T  # (N_k, V')
            j = torch.arange(offset, n)
            inside = j + 2 < len(seq)
            guess = vocab_ids[logits.argmax(-1)]
            right[k - 1, offset:] = inside & (guess == ids[0, (j + 2).clamp(max=len(seq) - 1)])
            if k == 1:
                best4 = vocab_ids[logits.topk(4, -1).indices]  # (N, 4)
                hits = (best4 == ids[0, (j + 2).clamp(max=len(seq) - 1)].unsqueeze(1)).any(1) & inside
        for s in range(max(0, start - 2), n - 1):  # chains whose first guess is an answer token
            count += 1
            top4 += bool(hits[s])
            for d in range(DEPTH):
                if s + d >= n or not right[d, s + d]:
                    break
                kept[d] += 1
    return [k / count for k in kept], top4 / count


def report(name: str, seconds: str, shares: list[float], top4: float) -> None:
    cells = " | ".join(f"{s:.3f}" for s in shares)
    print(f"| {name} | {seconds} | {cells} | {1 + sum(shares):.2f} | {top4:.3f} |", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--corpus", required=True, help="a corpus file the EAGLE trainer wrote (--corpus)")
    parser.add_argument("--sequences", type=int, default=1200)
    parser.add_argument("--epochs", type=int, default=4)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--unroll", type=int, default=2)
    parser.add_argument("--layers", type=int, nargs=3, default=[2, 15, 27])
    parser.add_argument("--variants", nargs="*", choices=VARIANTS, default=VARIANTS,
                        help="the variants to train (default: all; none: only the --reference heads)")
    parser.add_argument("--reference", nargs="+", default=[], help="trained heads' folders to measure beside the "
                        "variants")
    args = parser.parse_args()
    target = load_model(ModelSpec(source="embedded", dtype="float32"))
    target.model.requires_grad_(False)
    full = Corpus.load(Path(args.corpus))
    sample = args.sequences if args.variants else 0  # what only the variants train on
    pick = torch.randperm(len(full.sequences), generator=torch.Generator().manual_seed(0))[:sample].tolist()
    corpus = Corpus([full.sequences[i] for i in pick], [full.answer_starts[i] for i in pick], full.topk_ids[:0],
                    full.topk_logprobs[:0])
    held = generate_corpus(target, held_out_prompts(), 64, "bfloat16")
    start = time.perf_counter()
    # per sequence (T_i, 4E) bfloat16: the final-norm features, then the input of each of `--layers`
    train_feats, held_feats = (sequence_states(target, c, "bfloat16", keep=torch.bfloat16, taps=tuple(args.layers))
                               for c in (corpus, held))
    print(f"features: {sum(len(s) for s in corpus.sequences)} training positions in {len(corpus.sequences)} "
          f"sequences, {len(held.sequences)} held-out answers ({time.perf_counter() - start:.0f} s)", flush=True)
    vocab_ids = frequent_vocabulary(full, 8192, target.model.config.vocab_size)
    output = rows_of(target.model.output_weight.detach().float(), vocab_ids)  # (V', E)
    print("| variant | train s | kept >= 1 | >= 2 | >= 3 | >= 4 | chain TPF | first in top 4 |")
    print("|---|---|---|---|---|---|---|---|")
    for folder in args.reference:
        trained = Trained(folder, target).eval()
        feats = sequence_states(target, held, "bfloat16", keep=torch.bfloat16, taps=trained.head.taps)
        report(folder, "-", *held_out(trained, target, held, feats, trained.output, trained.vocab_ids))
    for name in args.variants:
        variant = Variant(name, target, len(args.layers))
        seconds = train(variant, target, corpus, train_feats, output, args)
        report(name, f"{seconds:.0f}", *held_out(variant, target, held, held_feats, output, vocab_ids))


if __name__ == "__main__":
    main()
