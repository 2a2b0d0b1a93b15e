"""Train Medusa heads for a frozen target by self-distillation: `python -m playground.train medusa`.

1. The target answers the project's training prompts greedily (the same corpus as the draft's with the same
   options; `--corpus` caches it), so the heads learn the target's own continuations.
2. One pass of the frozen target (in `--dtype`) over every sequence gives the final hidden state at each answer
   position.
3. The heads' vocabulary (`--head-vocab`): the target's most frequent answer tokens, then its most frequent
   top-k alternatives; heads score only those rows of the frozen output projection.
4. Head k at position t, given that state and the embedding of the answer token it predicted (t + 1), learns the
   token at t + k + 2 with the draft's distillation loss (half the target's greedy token, half its top-k
   distribution at that position, both restricted to the heads' vocabulary).
5. A report: each head's top-1 and top-5 accuracy on the held-out prompts' answers (a token outside the heads'
   vocabulary counts as a miss) and the share of those answers the vocabulary covers.
Everything is seeded; the run is reproducible up to floating-point reduction order.
"""

from __future__ import annotations

import argparse
import json
import math
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from ..config import ModelSpec, check_int
from ..models.loader import TORCH_DTYPES
from ..models.medusa import EMBEDDED_MEDUSA, MedusaHeads, save_heads
from ..models.vocab import rows_of
from . import log
from .corpus import target_pass
from .draft import (
    TOP_K,
    Corpus,
    add_corpus_args,
    answer_ids,
    distillation_loss,
    frequent_vocabulary,
    generate_corpus,
    load_or_generate_corpus,
    one_cycle,
    run_report,
    training_setup,
    vocabulary_position,
)
from .prompts import held_out_prompts


def add_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="embedded", help="target model spec (default: embedded)")
    parser.add_argument("--out", default=str(EMBEDDED_MEDUSA), help="output folder")
    parser.add_argument("--heads", type=int, default=4, help="number of heads K (default 4)")
    parser.add_argument("--epochs", type=int, default=4, help="passes over the corpus (default 4)")
    parser.add_argument("--lr", type=float, default=3e-3, help="peak learning rate (default 3e-3)")
    parser.add_argument("--batch", type=int, default=512, help="positions per optimiser step (default 512)")
    parser.add_argument("--head-vocab", type=int, default=8192,
                        help="tokens the heads score, from 1 to the target's vocabulary size (all of it; "
                             "default 8192)")
    parser.add_argument("--weights-dtype", choices=sorted(TORCH_DTYPES), default="float16",
                        help="dtype the weights are saved in (default float16)")
    add_corpus_args(parser, "precision of the target writing the corpus and computing the hidden states the heads "
                            "learn from (default bfloat16, as the draft's, so one --corpus file serves both; the "
                            "held-out report uses float32 states, as decoding does)", wide_topics=0, generate_batch=64)


def sequence_states(target: Any, corpus: Corpus, dtype: str, batch: int = 32, keep: torch.dtype = torch.float32,
                    device: str = "cpu", taps: tuple[int, ...] = ()) -> list[torch.Tensor]:
    """Each corpus sequence's final-norm hidden states (T_i, E) at every position, as `keep`, in corpus order; with
    `taps`, the inputs of those layers after them, (T_i, (1 + len(taps)) E), as `Transformer.forward` returns them.

    The target runs in `dtype` on `device`. Sequences go through it in batches of similar length, which cuts the
    padded positions by a sixth on the project's corpus (458k against 552k for 456k real ones)."""
    from ..models.loader import load_hf_peer

    hf = load_hf_peer(target).to(device=device, dtype=TORCH_DTYPES[dtype])
    pad = target.eos_token_ids[0]
    sequences = corpus.sequences
    states: list[torch.Tensor] = [torch.empty(0)] * len(sequences)
    order = sorted(range(len(sequences)), key=lambda i: len(sequences[i]))
    start = time.perf_counter()
    for first in range(0, len(order), batch):
        picked = order[first : first + batch]
        width = max(len(sequences[i]) for i in picked)
        # right padding, which a causal model never attends to from the real positions
        ids = torch.tensor([sequences[i] + [pad] * (width - len(sequences[i])) for i in picked], device=device)
        with torch.inference_mode():
            out = hf.model(input_ids=ids, output_hidden_states=bool(taps))
            # after the final norm (B, T, E); hidden_states[l] is the input of layer l
            hidden = torch.cat([out.last_hidden_state, *(out.hidden_states[layer] for layer in taps)], -1)
            hidden = hidden.to("cpu", keep)  # (B, T, (1 + len(taps)) E)
        for row, i in enumerate(picked):
            states[i] = hidden[row, : len(sequences[i])].clone()  # (T_i, E)
        if (first // batch) % 10 == 0:
            log("corpus", f"hidden states: {first + len(picked)}/{len(order)} sequences "
                          f"({time.perf_counter() - start:.0f} s)")
    return states


def hidden_states(target: Any, corpus: Corpus, dtype: str) -> tuple[torch.Tensor, list[int]]:
    """Final-norm hidden states (N, E), float32, at every position that predicts an answer token, in corpus order
    (sequence by sequence, position answer_start - 1 onwards), and each sequence's count of such positions."""
    return at_answers(sequence_states(target, corpus, dtype), corpus)


def at_answers(states: Sequence[torch.Tensor], corpus: Corpus) -> tuple[torch.Tensor, list[int]]:
    """Of each sequence's states (T_i, E), those at the positions that predict an answer token, (N, E) float32 in
    corpus order, and each sequence's count of them."""
    # the position before each answer token predicts it
    answers = [s[a - 1 : len(seq) - 1] for s, a, seq in zip(states, corpus.answer_starts, corpus.sequences)]
    return torch.cat(answers).float(), [len(s) - a for s, a in zip(corpus.sequences, corpus.answer_starts)]


def head_examples(counts: list[int], head: int) -> tuple[torch.Tensor, torch.Tensor]:
    """For head k: (rows of the hidden states, rows of the corpus labels) pairing position t with the answer
    token k + 1 further on than the target's own next token. Both index arrays are (n,)."""
    rows, labels, offset = [], [], 0
    for count in counts:
        # state i of a sequence predicts answer token i; head k predicts answer token i + k + 1
        usable = max(0, count - head - 1)
        rows.append(torch.arange(offset, offset + usable))
        labels.append(torch.arange(offset + head + 1, offset + head + 1 + usable))
        offset += count
    return torch.cat(rows), torch.cat(labels)


def vocabulary_share(vocab_ids: torch.Tensor, tokens: torch.Tensor, vocab_size: int) -> float:
    """The share of `tokens` (N,) that lie inside `vocab_ids`."""
    return (vocabulary_position(vocab_ids, vocab_size)[tokens] >= 0).float().mean().item()


def train(target: Any, heads: MedusaHeads, vocab_ids: torch.Tensor, states: torch.Tensor, counts: list[int],
          corpus: Corpus, args: argparse.Namespace) -> None:
    examples = [head_examples(counts, k) for k in range(heads.num_heads)]
    total = args.epochs * math.ceil(len(examples[0][0]) / args.batch)
    optimizer = torch.optim.AdamW(heads.parameters(), lr=args.lr, weight_decay=0.0)
    schedule = one_cycle(optimizer, args.lr, total, 0.05)
    output = rows_of(target.model.output_weight.detach().float(), vocab_ids)  # (V', E), frozen
    embedding = target.model.embed_tokens.weight.detach().float()  # (V, E), frozen
    position = vocabulary_position(vocab_ids, len(embedding))[corpus.topk_ids]  # (N, K) soft labels in V', or -1
    next_ids = answer_ids(corpus)  # (N,)
    generator = torch.Generator().manual_seed(args.seed)
    heads.train()
    step, start = 0, time.perf_counter()
    for epoch in range(args.epochs):
        orders = [torch.randperm(len(rows), generator=generator) for rows, _ in examples]
        losses = []
        for b in range(math.ceil(len(examples[0][0]) / args.batch)):
            loss = torch.zeros(())
            for k in range(heads.num_heads):
                rows, labels = examples[k]
                pick = orders[k][b * args.batch : (b + 1) * args.batch]
                if len(pick) == 0:
                    continue
                logits = heads.head(k, states[rows[pick]], embedding[next_ids[rows[pick]]]) @ output.T  # (n, V')
                loss = loss + distillation_loss(logits, position[labels[pick]], corpus.topk_logprobs[labels[pick]])
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            schedule.step()
            step += 1
            losses.append(loss.item() / heads.num_heads)
            if step % 50 == 0:
                log("medusa", f"epoch {epoch + 1}, step {step}/{total}: "
                              f"loss {sum(losses[-50:]) / len(losses[-50:]):.3f} ({time.perf_counter() - start:.0f} s)")
        log("medusa", f"epoch {epoch + 1}/{args.epochs}: loss {sum(losses) / len(losses):.3f}")
    heads.eval()


@torch.inference_mode()
def evaluate(target: Any, heads: MedusaHeads, vocab_ids: torch.Tensor, answer_tokens: int) -> dict[str, Any]:
    """Each head's top-1 and top-5 accuracy against the target's own greedy answers to the held-out prompts, and
    the share of those answer tokens inside the heads' vocabulary."""
    # float32: the heads are judged against what the target writes when it decodes, whatever wrote the corpus
    corpus = generate_corpus(target, held_out_prompts(), answer_tokens, "float32")
    states, counts = hidden_states(target, corpus, "float32")
    output = rows_of(target.model.output_weight.detach().float(), vocab_ids)  # (V', E)
    truth = answer_ids(corpus)  # (N,)
    inside = vocabulary_share(vocab_ids, truth, target.model.config.vocab_size)
    report: dict[str, Any] = {"held_out_prompts": len(corpus.sequences), "head_vocab_size": len(vocab_ids),
                              "held_out_answers_in_head_vocab": inside, "heads": []}
    for k, head_state in enumerate(heads.float()(states, target.model.embed_tokens.weight.float()[truth])):
        rows, labels = head_examples(counts, k)
        top5 = vocab_ids[(head_state[rows] @ output.T).topk(5, dim=-1).indices]  # (n, 5) token ids
        hits = top5 == truth[labels].unsqueeze(1)  # (n, 5)
        report["heads"].append({"head": k, "predicts": f"t+{k + 2}", "positions": len(rows),
                                "top1": hits[:, 0].float().mean().item(), "top5": hits.any(1).float().mean().item()})
    return report


def main(args: argparse.Namespace) -> int:
    from ..models import load_model

    check_int("heads", args.heads, 1, 16)
    check_int("batch", args.batch, 1, 1 << 16)
    prompts = training_setup(args)
    target = load_model(ModelSpec(source=args.model, device="cpu"))
    check_int("head_vocab", args.head_vocab, 1, target.model.config.vocab_size)
    corpus, generation_s = load_or_generate_corpus(target, prompts, args, args.dtype)
    start = time.perf_counter()
    if args.corpus_dir is None:
        states, counts = hidden_states(target, corpus, args.dtype)
    else:  # one pass of the forward the heads propose beside: the states and the soft labels
        every, corpus = target_pass(target, corpus, labels=True, keep=torch.float32)
        states, counts = at_answers(every, corpus)
    log("medusa", f"{len(states)} answer positions; training {args.heads} heads")
    vocab_ids = frequent_vocabulary(corpus, args.head_vocab, target.model.config.vocab_size)
    covered = vocabulary_share(vocab_ids, answer_ids(corpus), target.model.config.vocab_size)
    log("medusa", f"the heads score {len(vocab_ids)} tokens: {covered:.1%} of the training answers")
    heads = MedusaHeads(target.model.config.hidden_size, args.heads)
    train(target, heads, vocab_ids, states, counts, corpus, args)
    out = Path(args.out)
    save_heads(heads, out, target, TORCH_DTYPES[args.weights_dtype], vocab_ids)
    report = evaluate(target, heads, vocab_ids, args.answer_tokens)
    report.update({**run_report(args, prompts, corpus, generation_s, start), "train_positions": len(states),
                   "heads_count": args.heads, "batch": args.batch, "top_k_soft_labels": TOP_K,
                   "size_mb": (out / "medusa.safetensors").stat().st_size / 1e6})
    (out / "train_report.json").write_text(json.dumps(report, indent=2))
    log("medusa", json.dumps(report))
    return 0
