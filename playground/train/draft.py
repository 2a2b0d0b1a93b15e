"""Distil a small draft model for a target: `python -m playground.train draft`.

1. The target answers the project's training prompts greedily (batched transformers `generate`, in bfloat16 by
   default: `--dtype`), and its top-k log-probabilities at every answer position are kept as soft labels
   (`--corpus` caches all of it).
2. A small Llama with the target's tokenizer and full vocabulary (so transformers can use it as
   `assistant_model`) learns to predict the target's next token at the answer positions: cross-entropy on the
   greedy token plus on the target's top-k distribution. Its tied embedding starts from the target's
   embedding projected on its top principal directions. Training scores only the rows of its proposal
   vocabulary (`--proposal-vocab`: the tokens the corpus ranks first, the same ranking as the Medusa heads'),
   in `--dtype`, since our engine lets it propose nothing else.
3. It is saved in Hugging Face format, with that vocabulary beside it (our engine scores only those rows of the
   draft's output projection, transformers ignores the file) and a report: greedy acceptance on held-out
   prompts and the draft/target decode-step cost ratio, both with that vocabulary.
Everything is seeded; the run is reproducible up to floating-point reduction order.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from ..config import ConfigError, GenerationParams, ModelSpec, SamplingParams, check_int
from ..models.loader import EMBEDDED_DRAFT, TORCH_DTYPES
from ..models.vocab import PROPOSAL_VOCAB, VOCAB_IDS, rows_of
from . import log
from .prompts import EXTRA_TEMPLATES, TEMPLATES, WIDE_TOPICS, held_out_prompts, second_stage_prompts, training_prompts

GAMMA = 4  # draft length of the acceptance report
TOP_K = 16  # target alternatives kept per answer position as soft labels
COMPUTE_DTYPES = ("bfloat16", "float32")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "generation_config.json")


def add_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="embedded", help="target model spec (default: embedded)")
    parser.add_argument("--out", default=str(EMBEDDED_DRAFT), help="output folder (Hugging Face format)")
    parser.add_argument("--hidden", type=int, default=192, help="draft hidden size (default 192)")
    parser.add_argument("--layers", type=int, default=4, help="draft decoder layers (default 4)")
    parser.add_argument("--proposal-vocab", type=int, default=8192,
                        help="tokens the draft proposes from, 1 to the target's vocabulary size (all of it: no "
                             "file); it trains on and our engine scores only those rows of its output projection "
                             "(default 8192)")
    parser.add_argument("--epochs", type=int, default=7, help="passes over the corpus (default 7)")
    parser.add_argument("--lr", type=float, default=3e-3, help="peak learning rate (default 3e-3)")
    parser.add_argument("--weights-dtype", choices=sorted(TORCH_DTYPES), default="float16",
                        help="dtype the weights are saved in (default float16, to fit 30 MB); loaders cast to the "
                             "dtype they run in")
    add_corpus_args(parser, "precision of the target writing the corpus and of the draft's output projection in "
                            "training (default bfloat16: 1.6x and 1.2x faster on a CPU with AVX512-BF16 or AMX; "
                            "pass float32 on others)", wide_topics=len(WIDE_TOPICS), generate_batch=256)
    parser.add_argument("--eval-prompts", type=int, default=len(held_out_prompts()),
                        help=f"held-out prompts for the acceptance report (default all {len(held_out_prompts())})")


def add_corpus_args(parser: argparse.ArgumentParser, dtype_help: str, wide_topics: int, generate_batch: int) -> None:
    """The options that decide the corpus, shared by both trainers so that they can share one `--corpus` file.
    The defaults that differ are each shipped asset's own: the Medusa heads were trained on the narrower corpus."""
    parser.add_argument("--answer-tokens", type=int, default=80, help="target tokens generated per prompt (default 80)")
    parser.add_argument("--limit", type=int, default=None, help="use only the first N training prompts")
    parser.add_argument("--extra-templates", type=int, default=10,
                        help=f"extra task templates per topic, 0..{len(EXTRA_TEMPLATES)} (default 10)")
    parser.add_argument("--wide-topics", type=int, default=wide_topics,
                        help=f"further topics, 0..{len(WIDE_TOPICS)}, each asked --templates-per-wide-topic "
                             f"prompts drawn from all the templates (default {wide_topics})")
    parser.add_argument("--templates-per-wide-topic", type=int, default=6,
                        help=f"1..{len(TEMPLATES) + len(EXTRA_TEMPLATES)} (default 6)")
    parser.add_argument("--dtype", choices=COMPUTE_DTYPES, default="bfloat16", help=dtype_help)
    parser.add_argument("--generate-batch", type=int, default=generate_batch,
                        help=f"prompts the target answers together, 1..512 (default {generate_batch}; a larger "
                             "batch answers faster on a 2-core CPU (first stage: 64 wrote 294 tokens/s, 256 about "
                             "370) and may tip a bfloat16 near-tie another way, so corpora of different batches "
                             "differ slightly)")
    parser.add_argument("--corpus", default=None,
                        help="safetensors file caching the target's answers: reused when it exists, else written")
    parser.add_argument("--corpus-dir", default=None,
                        help="train on a corpus folder of `python -m playground.train corpus` instead of writing a "
                             "corpus here: what the target computes at its positions then comes from its own "
                             "forward, as the engine runs it (the prompt options above and --corpus are not used)")
    parser.add_argument("--corpus-tokens", type=int, default=None,
                        help="with --corpus-dir, its first shards up to this many answer tokens (default: all)")
    parser.add_argument("--corpus-skip", type=int, default=0,
                        help="with --corpus-dir, leave out its first shards up to this many answer tokens, so that "
                             "a run can go on where an earlier one's --corpus-tokens stopped (default 0)")
    parser.add_argument("--seed", type=int, default=0)


@dataclass
class Corpus:
    """Prompts with the target's greedy answers and, per answer token, the target's top-k log-probabilities
    at the position that chose it (soft labels). Stored as safetensors, never pickled."""

    sequences: list[list[int]]  # prompt + answer token ids
    answer_starts: list[int]  # index of the first answer token in each sequence
    topk_ids: torch.Tensor  # (answer tokens in all sequences, K) int64, in sequence order
    topk_logprobs: torch.Tensor  # (answer tokens in all sequences, K) float32

    def answer_tokens(self) -> int:
        return sum(len(s) - a for s, a in zip(self.sequences, self.answer_starts))

    def save(self, path: Path, metadata: dict[str, str]) -> None:
        lengths = torch.tensor([len(s) for s in self.sequences])
        save_file({"tokens": torch.tensor([t for s in self.sequences for t in s]), "lengths": lengths,
                   "answer_starts": torch.tensor(self.answer_starts), "topk_ids": self.topk_ids,
                   "topk_logprobs": self.topk_logprobs}, str(path), metadata=metadata)

    def answers(self, tokenizer: Any) -> list[str]:
        """Each sequence's answer as text, special tokens dropped."""
        return [tokenizer.decode(s[a:], skip_special_tokens=True) for s, a in zip(self.sequences, self.answer_starts)]

    def __add__(self, other: "Corpus") -> "Corpus":
        return Corpus(self.sequences + other.sequences, self.answer_starts + other.answer_starts,
                      torch.cat((self.topk_ids, other.topk_ids)), torch.cat((self.topk_logprobs, other.topk_logprobs)))

    @classmethod
    def load(cls, path: Path) -> "Corpus":
        data = load_file(str(path))
        tokens = data["tokens"].tolist()
        sequences, first = [], 0
        for length in data["lengths"].tolist():
            sequences.append(tokens[first : first + length])
            first += length
        return cls(sequences, data["answer_starts"].tolist(), data["topk_ids"], data["topk_logprobs"])


class _RecordTopK:
    """A transformers logits processor that keeps the top-k log-probabilities of every generation step."""

    def __init__(self) -> None:
        self.steps: list[tuple[torch.Tensor, torch.Tensor]] = []

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        top = torch.topk(scores.float().log_softmax(-1), TOP_K)  # (B, K)
        self.steps.append((top.indices, top.values))
        return scores


def generate_corpus(target: Any, prompts: list[str], answer_tokens: int, dtype: str, batch: int = 64) -> Corpus:
    """The target, cast to `dtype`, answers every prompt greedily (batched transformers `generate`), recording
    soft labels; the corpus keeps the prompts' order.

    Batches are cut from the prompts sorted by length (stable), since a batch is padded to its longest prompt: the
    grounded prompts of the second stage run from one sentence to a paragraph. bfloat16 answers faster than
    float32 on a CPU with bfloat16 instructions and is still the target writing: its answers follow float32's for
    about half their tokens before a near tie tips another way, and its labels are the same distribution to
    bfloat16's precision (docs/results.md has the measurements)."""
    from transformers import LogitsProcessorList

    from ..decoding import encode_prompt
    from ..models.loader import load_hf_peer

    hf = load_hf_peer(target).to(TORCH_DTYPES[dtype])
    pad = target.eos_token_ids[0]
    generation = GenerationParams(max_new_tokens=answer_tokens)
    encoded = [encode_prompt(target, p, generation) for p in prompts]
    order = sorted(range(len(prompts)), key=lambda i: len(encoded[i]))
    answers: list[Any] = [None] * len(prompts)  # per prompt: (answer ids, top-k ids (A, K), top-k log-probs (A, K))
    tokens, start = 0, time.perf_counter()
    for first in range(0, len(order), batch):
        chosen = order[first : first + batch]
        width = max(len(encoded[i]) for i in chosen)
        ids = torch.tensor([[pad] * (width - len(encoded[i])) + encoded[i] for i in chosen])  # left padding: (B, W)
        mask = torch.tensor([[0] * (width - len(encoded[i])) + [1] * len(encoded[i]) for i in chosen])
        record = _RecordTopK()
        with torch.inference_mode():
            out = hf.generate(ids, attention_mask=mask, max_new_tokens=answer_tokens, do_sample=False,
                              eos_token_id=list(target.eos_token_ids), pad_token_id=pad,
                              logits_processor=LogitsProcessorList([record]))
        step_ids = torch.stack([i for i, _ in record.steps], 1)  # (B, steps, K)
        step_logprobs = torch.stack([v for _, v in record.steps], 1)  # (B, steps, K)
        for row, i in enumerate(chosen):
            answer = out[row, width:].tolist()
            ends = [j for j, t in enumerate(answer) if t in target.eos_token_ids]
            answer = answer[: ends[0] + 1] if ends else answer  # keep the end-of-sequence token, drop padding
            answers[i] = (answer, step_ids[row, : len(answer)], step_logprobs[row, : len(answer)])
            tokens += len(answer)
        done = first + len(chosen)
        log("corpus", f"target answered {done}/{len(prompts)} prompts, {tokens} tokens "
                      f"({time.perf_counter() - start:.0f} s)")
    return Corpus([e + a for e, (a, _, _) in zip(encoded, answers)], [len(e) for e in encoded],
                  torch.cat([i for _, i, _ in answers]), torch.cat([v for _, _, v in answers]))


def answer_ids(corpus: Corpus) -> torch.Tensor:
    """Every answer token (N,) in corpus order (for Medusa: row i of the hidden states predicted token i)."""
    return torch.tensor([t for s, a in zip(corpus.sequences, corpus.answer_starts) for t in s[a:]])


def frequent_vocabulary(corpus: Corpus, size: int, vocab_size: int) -> torch.Tensor:
    """The `size` token ids (ascending, int64) a proposer will score: the target's answer tokens, most frequent
    first, then the alternatives in its top-k soft labels, most frequent first, then the lowest remaining ids."""
    answers = torch.bincount(answer_ids(corpus), minlength=vocab_size).double()  # (V,)
    alternatives = torch.bincount(corpus.topk_ids.flatten(), minlength=vocab_size).double()  # (V,)
    score = answers * (alternatives.max() + 1) + alternatives  # answer counts first, ties by alternatives
    return torch.sort(score.argsort(descending=True, stable=True)[:size]).values


def vocabulary_position(vocab_ids: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """(V,) int64: each token's index in `vocab_ids`, -1 for a token outside it."""
    position = torch.full((vocab_size,), -1, dtype=torch.int64)
    position[vocab_ids] = torch.arange(len(vocab_ids))
    return position


def one_cycle(optimizer: torch.optim.Optimizer, lr: float, total: int, warmup: float) -> Any:
    """A one-cycle schedule (warm up over the first `warmup` fraction of `total` steps, then cosine decay).

    PyTorch's OneCycleLR divides by zero when the warmup comes to exactly one step (10 steps at 0.1: one epoch
    over 160 sequences); such a run warms up over two steps instead. Other runs get PyTorch's schedule unchanged,
    so earlier runs stay reproducible."""
    if total > 2 and math.isclose(warmup * total, 1.0):
        warmup = 2 / total
    return torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=lr, total_steps=total, pct_start=warmup)


def draft_config(target: Any, hidden: int, layers: int) -> Any:
    from transformers import LlamaConfig

    heads = max(1, hidden // 32)
    tcfg = target.model.config
    return LlamaConfig(vocab_size=tcfg.vocab_size, hidden_size=hidden, intermediate_size=3 * hidden,
                       num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=max(1, heads // 2),
                       max_position_embeddings=tcfg.max_position_embeddings, rms_norm_eps=1e-5,
                       rope_parameters={"rope_type": "default", "rope_theta": 100000.0}, tie_word_embeddings=True,
                       bos_token_id=1, eos_token_id=list(target.eos_token_ids), pad_token_id=target.eos_token_ids[0])


def projected_embedding(target: Any, hidden: int, seed: int) -> torch.Tensor:
    """The target's embedding (V, E) on its top `hidden` principal directions: (V, hidden), with the target's
    element scale, so that similar tokens start close together in the draft as they are in the target."""
    weights = target.model.embed_tokens.weight.detach().float()
    torch.manual_seed(seed)
    _, _, directions = torch.pca_lowrank(weights, q=hidden, center=True)  # (E, hidden)
    projected = (weights - weights.mean(0)) @ directions  # (V, hidden)
    return projected * (weights.std() / projected.std())


def batches(corpus: Corpus, size: int, generator: torch.Generator, pad: int):
    """Shuffled padded batches: ids (B, T); the positions whose next token is an answer token, as
    (row, column) index tensors (N,); and the row of `corpus.topk_*` holding each one's soft label (N,)."""
    label_offsets = [0]  # first soft-label row of each sequence
    for seq, answer_start in zip(corpus.sequences, corpus.answer_starts):
        label_offsets.append(label_offsets[-1] + len(seq) - answer_start)
    order = torch.randperm(len(corpus.sequences), generator=generator).tolist()
    for first in range(0, len(order), size):
        chosen = order[first : first + size]
        width = max(len(corpus.sequences[i]) for i in chosen)
        ids = torch.full((len(chosen), width), pad)
        rows: list[int] = []
        columns: list[int] = []
        labels: list[int] = []
        for r, i in enumerate(chosen):
            seq, answer_start = corpus.sequences[i], corpus.answer_starts[i]
            ids[r, : len(seq)] = torch.tensor(seq)
            # answer token j (sequence index answer_start + j) is predicted from position answer_start + j - 1
            count = len(seq) - answer_start
            rows += [r] * count
            columns += range(answer_start - 1, len(seq) - 1)
            labels += range(label_offsets[i], label_offsets[i] + count)
        yield ids, (torch.tensor(rows), torch.tensor(columns)), torch.tensor(labels)


def distillation_loss(logits: torch.Tensor, topk_ids: torch.Tensor, topk_logprobs: torch.Tensor) -> torch.Tensor:
    """Half cross-entropy on the target's greedy token, half on its top-k distribution renormalised.

    logits (N, V') from the draft over a vocabulary of V' tokens (all, or a reduced one); topk_ids, topk_logprobs
    (N, K) from the target, best first, ids indexing the logits, -1 for an alternative outside a reduced
    vocabulary (see `vocabulary_position`): those leave both terms. The hard term is what greedy acceptance
    scores; the soft term tells the draft how the target ranks the alternatives, which generalises better from a
    small corpus."""
    known = topk_ids >= 0  # (N, K)
    logq = logits.log_softmax(-1).gather(1, topk_ids.clamp_min(0))  # (N, K)
    # a row whose alternatives all lie outside gets an all -inf row: its NaN softmax becomes zero weights
    soft = topk_logprobs.masked_fill(~known, float("-inf")).softmax(-1).nan_to_num(0.0)  # (N, K)
    return -(0.5 * logq[:, 0] * known[:, 0] + 0.5 * (soft * logq).sum(-1)).mean()


def train(target: Any, corpus: Corpus, vocab_ids: torch.Tensor, args: argparse.Namespace) -> Any:
    """Train a draft on the corpus, scoring only the output rows of `vocab_ids` (V',) ascending: the only tokens
    our engine lets it propose."""
    from transformers import LlamaForCausalLM

    torch.manual_seed(args.seed)
    model = LlamaForCausalLM(draft_config(target, args.hidden, args.layers))
    with torch.no_grad():
        model.model.embed_tokens.weight.copy_(projected_embedding(target, args.hidden, args.seed))
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
    batch_size = 16
    total = args.epochs * math.ceil(len(corpus.sequences) / batch_size)
    schedule = one_cycle(optimizer, args.lr, total, 0.1)
    generator = torch.Generator().manual_seed(args.seed)
    labels_in_vocab = vocabulary_position(vocab_ids, target.model.config.vocab_size)[corpus.topk_ids]  # (N, K)
    # Over all 49,152 rows the output projection and its two gradients were most of a step (in bfloat16, 0.6 s of
    # 1.06 for 1,100 positions); over the 8,192 proposal rows an epoch of the shipped draft takes 110 s, not 245.
    # The other tokens still train as inputs, and the full-vocabulary argmax that transformers' assisted
    # generation uses fell outside the proposal rows at 0.1% of the suite's answer positions.
    low = TORCH_DTYPES[args.dtype]
    step, start = 0, time.perf_counter()
    for epoch in range(args.epochs):
        losses = []
        for ids, (rows, columns), labels in batches(corpus, batch_size, generator, target.eos_token_ids[0]):
            hidden = model.model(input_ids=ids).last_hidden_state  # (B, T, H)
            output = rows_of(model.lm_head.weight, vocab_ids)  # (V', H), differentiable
            # only where an answer token is predicted, in the product's dtype; the softmax stays in float32
            logits = F.linear(hidden[rows, columns].to(low), output.to(low)).float()  # (N, V')
            loss = distillation_loss(logits, labels_in_vocab[labels], corpus.topk_logprobs[labels])
            optimizer.zero_grad()
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            schedule.step()
            losses.append(loss.item())
            step += 1
        log("draft", f"epoch {epoch + 1}/{args.epochs}: loss {sum(losses) / len(losses):.3f} "
            f"({step}/{total} steps, {time.perf_counter() - start:.0f} s)")
    return model.eval()


@torch.inference_mode()
def evaluate(target: Any, folder: Path, prompts: list[str]) -> dict[str, float]:
    """Greedy acceptance on held-out prompts at gamma 4, from the draft's greedy token after each prefix of the
    target's own greedy answers (what a chain of fixed length would be accepted): per judged proposal (the theory's
    a) and per drafted token (proposals after a rejection are drafted but never judged); and the decode-step cost
    ratio."""
    from ..decoding.base import decode_step_seconds, encode_prompt, forward_tokens, new_cache
    from ..engine import generate
    from ..metrics import chain_acceptance
    from ..models import load_model
    from ..models.vocab import proposal_rows

    draft = load_model(ModelSpec(source=str(folder), device=str(target.model.device)))
    rows = proposal_rows(draft)
    generation = GenerationParams(max_new_tokens=64)
    accepted = drafted = judged = 0
    for prompt in prompts:
        answer = list(generate(target, prompt, None, SamplingParams(), generation)[0].token_ids)
        ids = encode_prompt(target, prompt, generation)
        cache = new_cache(draft.model, len(ids) + len(answer), generation)
        logits = forward_tokens(draft.model, cache, ids + answer[:-1], num_logits=len(answer), rows=rows)  # (n, V)
        agrees = [int(guess) == token for guess, token in zip(logits.argmax(-1).tolist(), answer)]
        accepted, drafted, judged = map(sum, zip((accepted, drafted, judged), chain_acceptance(agrees, GAMMA)))
    cost = decode_step_seconds(draft.model, rows=rows) / decode_step_seconds(target.model)
    return {"held_out_token_acceptance": accepted / judged, "held_out_accepted_per_drafted": accepted / drafted,
            "gamma": GAMMA, "draft_target_cost_ratio": cost, "held_out_prompts": len(prompts)}


def two_stage_corpus(target: Any, prompts: list[str], answer_tokens: int, dtype: str, batch: int = 64) -> Corpus:
    """The target's answers to `prompts`, then to the second-stage prompts built on those answers (see prompts.py),
    `batch` prompts at a time."""
    first = generate_corpus(target, prompts, answer_tokens, dtype, batch)
    second = second_stage_prompts(prompts, first.answers(target.tokenizer))
    log("corpus", f"second stage: {len(second)} grounded and arithmetic prompts built on the first {len(prompts)} "
                  "answers")
    return first + generate_corpus(target, second, answer_tokens, dtype, batch) if second else first


def load_or_generate_corpus(target: Any, prompts: list[str], args: argparse.Namespace,
                            dtype: str) -> tuple[Corpus, float]:
    """The corpus from `--corpus` when that file exists and was made with the same settings, else a fresh one
    written by the target in `dtype` (saved there when `--corpus` is given), so training variants can reuse one
    generation run. Also returns the seconds its generation took (then or now). With `--corpus-dir`, that folder's
    training shards instead, without soft labels: the trainer takes them from the target's own forward
    (`corpus.target_pass`)."""
    if args.corpus_dir is not None:
        from .corpus import read

        return read(Path(args.corpus_dir), "train", args.corpus_tokens, args.corpus_skip)
    # the digest tells apart prompt sets of one size (another seed, --limit, or wide-topic split)
    digest = hashlib.sha256("\0".join(prompts).encode()).hexdigest()[:16]
    settings = {"model": args.model, "prompts": str(len(prompts)), "prompts_sha256": digest,
                "answer_tokens": str(args.answer_tokens), "top_k": str(TOP_K), "stages": "2", "dtype": dtype}
    path = Path(args.corpus) if args.corpus else None
    if path is not None and path.is_file():
        with safe_open(str(path), "pt") as handle:
            stored = dict(handle.metadata() or {})
        seconds = float(stored.pop("generation_s", "nan"))
        if stored != settings:
            raise ConfigError(f"corpus: {path} was made with {stored}, not {settings}; delete it or pass another path")
        log("corpus", f"reusing the corpus in {path}")
        return Corpus.load(path), seconds
    start = time.perf_counter()
    corpus = two_stage_corpus(target, prompts, args.answer_tokens, dtype, args.generate_batch)
    seconds = time.perf_counter() - start
    if path is not None:
        path.parent.mkdir(parents=True, exist_ok=True)
        corpus.save(path, {**settings, "generation_s": f"{seconds:.1f}"})
    return corpus, seconds


def training_setup(args: argparse.Namespace) -> list[str]:
    """Check the options every trainer shares, seed torch, and return the training prompts with
    `--extra-templates` extra task templates per topic and `--wide-topics` further topics (--limit applied)."""
    check_int("answer_tokens", args.answer_tokens, 8, 512)
    check_int("epochs", args.epochs, 1, 100)
    check_int("generate_batch", args.generate_batch, 1, 512)
    check_int("extra_templates", args.extra_templates, 0, len(EXTRA_TEMPLATES))
    check_int("wide_topics", args.wide_topics, 0, len(WIDE_TOPICS))
    check_int("templates_per_wide_topic", args.templates_per_wide_topic, 1, len(TEMPLATES) + len(EXTRA_TEMPLATES))
    if args.corpus_tokens is not None:
        check_int("corpus_tokens", args.corpus_tokens, 1, 10**9)
    check_int("corpus_skip", args.corpus_skip, 0, 10**9)
    for name in ("corpus_tokens", "corpus_skip"):
        if getattr(args, name) and args.corpus_dir is None:
            raise ConfigError(f"{name}: reads a corpus folder; pass --corpus-dir DIR")
    if args.corpus_dir is not None:  # a folder without shards is refused before any model loads
        from .corpus import shards

        shards(Path(args.corpus_dir), "train")
    if not 0 < args.lr <= 0.1:
        raise ConfigError(f"lr must be in (0, 0.1], got {args.lr}")
    prompts = training_prompts(args.extra_templates, args.seed, args.wide_topics, args.templates_per_wide_topic)
    if args.limit is not None:
        check_int("limit", args.limit, 1, len(prompts))
        prompts = prompts[: args.limit]
    torch.manual_seed(args.seed)
    return prompts


def run_report(args: argparse.Namespace, prompts: list[str], corpus: Corpus, generation_s: float,
               start: float) -> dict[str, Any]:
    """The report entries every trainer shares: the corpus, the common options and the time taken. A corpus folder
    names itself instead of the prompt options that did not make it."""
    if args.corpus_dir is not None:
        return {"train_prompts": len(corpus.sequences), "corpus_dir": args.corpus_dir,
                "corpus_skip": args.corpus_skip, "train_answer_tokens": corpus.answer_tokens(),
                "targets_forward": "the engine's own",
                "epochs": args.epochs, "lr": args.lr, "weights_dtype": args.weights_dtype, "seed": args.seed,
                "corpus_generation_s": generation_s, "wall_s_this_run": time.perf_counter() - start}
    return {"train_prompts": len(corpus.sequences), "first_stage_prompts": len(prompts),
            "extra_templates_per_topic": args.extra_templates, "wide_topics": args.wide_topics,
            "templates_per_wide_topic": args.templates_per_wide_topic, "dtype": args.dtype, "epochs": args.epochs,
            "lr": args.lr, "weights_dtype": args.weights_dtype, "seed": args.seed,
            # the corpus's generation (in this run or an earlier one), then this run's time once the corpus was
            # ready: a full run takes their sum (loading the target aside)
            "corpus_generation_s": generation_s, "wall_s_this_run": time.perf_counter() - start}


def main(args: argparse.Namespace) -> int:
    from ..models import load_model

    check_int("hidden", args.hidden, 32, 1024)
    check_int("layers", args.layers, 1, 32)
    check_int("eval_prompts", args.eval_prompts, 1, len(held_out_prompts()))
    prompts = training_setup(args)
    target = load_model(ModelSpec(source=args.model, device="cpu"))
    vocab_size = target.model.config.vocab_size
    check_int("proposal_vocab", args.proposal_vocab, 1, vocab_size)
    corpus, generation_s = load_or_generate_corpus(target, prompts, args, args.dtype)
    start = time.perf_counter()
    if args.corpus_dir is not None:  # the soft labels, from one pass of the target's own forward
        from .corpus import target_pass

        corpus = target_pass(target, corpus, labels=True)[1]
    vocab_ids = frequent_vocabulary(corpus, args.proposal_vocab, vocab_size)
    model = train(target, corpus, vocab_ids, args)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    model.to(TORCH_DTYPES[args.weights_dtype]).save_pretrained(out)
    (out / PROPOSAL_VOCAB).unlink(missing_ok=True)  # a previous run's, which this draft may not use
    if args.proposal_vocab < vocab_size:
        save_file({VOCAB_IDS: vocab_ids}, str(out / PROPOSAL_VOCAB))
    for name in TOKENIZER_FILES:
        if (target.folder / name).is_file():
            shutil.copy(target.folder / name, out / name)
    report = evaluate(target, out, held_out_prompts()[: args.eval_prompts])
    report.update({**run_report(args, prompts, corpus, generation_s, start), "train_tokens": corpus.answer_tokens(),
                   "proposal_vocab": args.proposal_vocab, "hidden": args.hidden, "layers": args.layers,
                   "size_mb": sum(f.stat().st_size for f in out.glob("*.safetensors")) / 1e6})
    (out / "train_report.json").write_text(json.dumps(report, indent=2))
    log("draft", json.dumps(report))
    return 0
