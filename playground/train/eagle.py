"""Train an EAGLE head for a frozen target by self-distillation: `python -m playground.train eagle`.

1. The target answers the project's training prompts greedily (the corpus of the Medusa heads, with the same
   options: one `--corpus` file serves both).
2. One pass of the frozen target over every sequence gives its final-norm features at every position (and, with
   `--taps`, the inputs of those layers).
3. The head's vocabulary (`--head-vocab`): the target's most frequent answer tokens, then its most frequent top-k
   alternatives, as the Medusa heads'. With `--init` training starts from a trained head instead, its vocabulary
   kept: a run can go on from an earlier one's head on more of a corpus (`--corpus-skip`).
4. At every position t the head reads the target's feature f_t (with Gaussian noise of `--noise` times the
   features' RMS, so that it learns to draft on its own imperfect predictions) and the embedding of x_{t+1}, and
   learns f_{t+1}: a smooth-L1 regression on the feature plus `--token-weight` times the cross-entropy of the
   target's next-token distribution (its output rows over the head's vocabulary) against the head's. With
   `--taps` it reads the mix of the tapped layers' inputs instead (`EagleHead.read`, each layer noised by its own
   RMS) and learns the cross-entropy alone: what it predicts is no target feature. With
   `--unroll K` it also learns, K-1 more passes deep, from the features it predicted itself, seeing the keys
   drafting sees there (EAGLE-3's training-time test): drafting past depth 1 reads its own predictions.
5. A report: the engine drafting with the head on the held-out prompts, greedy: tokens per target forward,
   the share of steps that kept at least d drafted tokens for each depth d, and the head's forward cost.
Everything is seeded; the run is reproducible up to floating-point reduction order.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import time
from collections.abc import Sequence
from contextlib import nullcontext
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from safetensors import safe_open
from safetensors.torch import save_file

from ..config import ConfigError, GenerationParams, ModelSpec, SamplingParams, check_int
from ..decoding.eagle import EagleParams
from ..models.eagle import EMBEDDED_EAGLE, WEIGHTS, EagleHead, head_config, read_head, save_head
from ..models.loader import TORCH_DTYPES
from ..models.vocab import rows_of
from . import log
from .corpus import target_pass
from .draft import (
    Corpus,
    add_corpus_args,
    frequent_vocabulary,
    load_or_generate_corpus,
    one_cycle,
    run_report,
    training_setup,
)
from .medusa import sequence_states
from .prompts import held_out_prompts

EVAL_TOKENS = 64  # tokens each held-out prompt is answered with in the report


def add_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="embedded", help="target model spec (default: embedded)")
    parser.add_argument("--out", default=str(EMBEDDED_EAGLE), help="output folder")
    parser.add_argument("--epochs", type=int, default=16, help="passes over the corpus (default 16)")
    parser.add_argument("--lr", type=float, default=1e-3, help="peak learning rate (default 1e-3)")
    parser.add_argument("--batch", type=int, default=16, help="sequences per optimiser step (default 16)")
    parser.add_argument("--head-vocab", type=int, default=8192,
                        help="tokens the head scores, from 1 to the target's vocabulary size (default 8192)")
    parser.add_argument("--noise", type=float, default=0.1,
                        help="Gaussian noise on the input features, times their RMS, 0..1 (default 0.1)")
    parser.add_argument("--token-weight", type=float, default=0.5,
                        help="weight of the next-token cross-entropy beside the feature regression (default 0.5; a "
                             "head with --taps learns the tokens alone)")
    parser.add_argument("--unroll", type=int, default=2,
                        help="passes per position, 1..4: pass k learns from the features the head itself predicted "
                             "k-1 deep, as it drafts (default 2)")
    parser.add_argument("--taps", type=int, nargs="*", default=[], metavar="LAYER",
                        help="target layers whose inputs the head reads instead of the final-norm features, as "
                             "EAGLE-3 reads a low, a middle and a high one (e.g. 2 15 27 of 30; default: none)")
    parser.add_argument("--features", default=None, metavar="DIR",
                        help="with --corpus-dir: keep the target's features in files in DIR, not in memory (they may "
                             "exceed it: 2 bytes per position and column, 4 x 576 columns with three taps), and "
                             "read them back when a stopped run starts again (default: in memory)")
    parser.add_argument("--init", default=None, metavar="DIR",
                        help="start from the head in DIR (its weights and the tokens it scores) instead of a fresh "
                             "one, to train it further, on more of a corpus or another; --taps and --head-vocab "
                             "must be its own (default: a fresh head)")
    parser.add_argument("--device", default="cpu", help="where the target's features and the training run: cpu "
                        "(default) or cuda")
    parser.add_argument("--weights-dtype", choices=sorted(TORCH_DTYPES), default="float16",
                        help="dtype the weights are saved in (default float16)")
    parser.add_argument("--eval-prompts", type=int, default=len(held_out_prompts()),
                        help=f"held-out prompts the report drafts on (default all {len(held_out_prompts())})")
    add_corpus_args(parser, "precision of the target writing the corpus and computing the features, and of the "
                            "head's products in training (default bfloat16; the report drafts in float32)",
                    wide_topics=0, generate_batch=64)


def batches(lengths: list[int], size: int, generator: torch.Generator) -> list[list[int]]:
    """Sequence indices in batches of `size` of similar length (little padding), the batches shuffled."""
    order = sorted(range(len(lengths)), key=lambda i: lengths[i])
    groups = [order[i : i + size] for i in range(0, len(order), size)]
    return [groups[i] for i in torch.randperm(len(groups), generator=generator).tolist()]


def unrolled(head: EagleHead, embeddings: torch.Tensor, inputs: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
             unroll: int, first: int = 0) -> list[tuple[int, torch.Tensor]]:
    """The head's predicted features at every position, `unroll` passes: what drafting 1..unroll deep gives, as
    (offset, (B, N - offset, E)) per pass, the pass's predictions at positions offset..N-1.

    embeddings (B, N, E) e(x_{j+1}); inputs (B, N, E) the (noised) features f_j; cos, sin the RoPE at positions
    0..N-1. Pass 1 reads f_j and sees every position's pass-1 keys up to its own. Pass k reads the feature pass k-1
    predicted for position j (from j-1) and sees what drafting at depth k sees: the pass-1 keys (real features) up to
    position j-k+1, then one key of each pass 2..k-1 along its own chain (position j-k+m for pass m), then its own.
    A position whose chain starts before position 0 only counts from pass k at j >= k-1. Where nothing before
    position `first` is read by a loss, pass k >= 2 starts at first - (unroll - k), the first key a later pass reads
    (pass 1 runs everywhere: its keys are every deeper pass's context)."""
    b, n, _ = inputs.shape
    cfg = head.config
    past_k = past_v = inputs.new_zeros(b, cfg.num_kv_heads, 0, cfg.head_dim)
    key_positions: list[torch.Tensor] = []  # each pass's positions, in the order of its keys in past_k
    passes: list[tuple[int, torch.Tensor]] = []
    for k in range(1, unroll + 1):
        start = 0 if k == 1 else max(0, first - (unroll - k))
        own = torch.arange(start, n, device=inputs.device)  # (N_k,) this pass's positions
        key_positions.append(own)
        j = own.unsqueeze(1)  # (N_k, 1) the query's position
        blocks = [key_positions[0] <= j - k + 1] + [key_positions[m - 1] == j - k + m for m in range(2, k + 1)]
        visible = torch.cat(blocks, 1).expand(b, len(own), -1)  # (B, N_k, keys so far)
        if k == 1:
            x = inputs
        else:  # f^_j: pass k-1's prediction from position j-1, or the real feature at position 0
            offset, before = passes[-1]
            shifted = before[:, max(start, 1) - 1 - offset : n - 1 - offset].to(inputs.dtype)
            x = torch.cat((inputs[:, :1], shifted), 1) if start == 0 else shifted
        predicted, keys, values = head(embeddings[:, start:], x, cos[:, start:], sin[:, start:], past_k, past_v,
                                       visible)  # (B, N_k, E)
        passes.append((start, predicted))
        past_k, past_v = torch.cat((past_k, keys), 2), torch.cat((past_v, values), 2)  # (B, Hkv, keys, D)
    return passes


def head_loss(head: EagleHead, target: Any, ids: torch.Tensor, features: torch.Tensor, lengths: torch.Tensor,
              starts: torch.Tensor, output: torch.Tensor, noise: float, generator: torch.Generator,
              unroll: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """(regression, token cross-entropy), each the mean over the `unroll` passes (the regression 0 for a head with
    taps), for a padded batch: ids (B, T), features (B, T, (1 + taps) E) float32 as `sequence_states` gives them,
    lengths (B,), starts (B,) each sequence's first answer token; output (V', E) the target's rows over the head's
    vocabulary. The head reads every position, and learns where what it predicts chooses an answer token (the
    prompts share a chat template, which would otherwise weigh as much as every answer)."""
    b, t = ids.shape
    e = head.config.hidden_size
    inputs = features[:, :-1]  # (B, T-1, (1 + taps) E)
    if noise:  # each of the final states and the tapped layers' inputs by its own RMS
        rms = features.unflatten(-1, (-1, e)).pow(2).mean((0, 1, 3)).sqrt().repeat_interleave(e)  # ((1 + taps) E,)
        inputs = inputs + noise * rms * torch.randn(inputs.shape, generator=generator).to(inputs.device)
    inputs = head.read(inputs)  # f_t (B, T-1, E)
    embeddings = target.model.embed_tokens.weight[ids[:, 1:]].float()  # e(x_{t+1}) (B, T-1, E)
    positions = torch.arange(t - 1, device=ids.device).expand(b, t - 1)  # (B, T-1)
    cos, sin = target.model.rope(positions, torch.float32)
    # (B, T-1): f_{j+1} is real and chooses an answer token x_{j+2}
    j = positions[:1]
    answer = (j + 1 < lengths.unsqueeze(1)) & (j + 2 >= starts.unsqueeze(1))
    truth = features[:, 1:, :e][answer]  # (N, E) every pass's final states, the answer positions in order
    with torch.no_grad():
        teacher = (truth @ output.T).softmax(-1)  # (N, V')
    row = torch.full(answer.shape, -1, device=ids.device)
    row[answer] = torch.arange(len(truth), device=ids.device)  # (B, T-1) each answer position's row in truth
    first = max(0, int(starts.min()) - 2)  # no answer position before it
    regressions, tokens = [], []
    for k, (offset, predicted) in enumerate(unrolled(head, embeddings, inputs, cos, sin, unroll, first), start=1):
        valid = answer[:, offset:] & (j[:, offset:] >= k - 1)
        rows = row[:, offset:][valid]  # (N_k,)
        guess = predicted[valid].float()  # (N_k, E)
        regressions.append(guess.new_zeros(()) if head.taps else F.smooth_l1_loss(guess, truth[rows]))
        tokens.append(-(teacher[rows] * (guess @ output.T).log_softmax(-1)).sum(-1).mean())
    return torch.stack(regressions).mean(), torch.stack(tokens).mean()


def losses(head: EagleHead, regression: float, tokens: float) -> str:
    """The losses a progress line shows: a head with taps learns the tokens alone."""
    return f"tokens {tokens:.3f}" if head.taps else f"regression {regression:.4f}, tokens {tokens:.3f}"


CHECKPOINT = "checkpoint.safetensors"  # in --out while a run is under way: the state after its last whole epoch


def run_settings(args: argparse.Namespace, corpus: Corpus) -> dict[str, Any]:
    """What decides a run's steps: a checkpoint resumes only the run that wrote it (`--init`: from the same head)."""
    shape = hashlib.sha256(json.dumps([corpus.answer_starts, [len(s) for s in corpus.sequences]]).encode())
    start = {} if args.init is None else {
        "init": hashlib.sha256((Path(args.init) / WEIGHTS).read_bytes()).hexdigest()[:16]}
    return {"corpus": shape.hexdigest()[:16], **start, **{key: getattr(args, key) for key in (
        "epochs", "lr", "batch", "seed", "noise", "unroll", "token_weight", "taps", "head_vocab", "dtype", "device")}}


def save_checkpoint(path: Path, head: EagleHead, optimizer: torch.optim.Optimizer, schedule: Any,
                    generator: torch.Generator, epochs: int, settings: dict[str, Any]) -> None:
    """The run's state after `epochs` whole epochs, as safetensors (never pickled): the head's weights, AdamW's moments,
    the generator that shuffles and noises; the schedule, the optimiser's settings and the run's in the metadata."""
    state = optimizer.state_dict()
    tensors = {f"head.{name}": value.detach().cpu().contiguous() for name, value in head.state_dict().items()}
    tensors |= {f"optimizer.{index}.{key}": value.cpu() for index, moments in state["state"].items()
                for key, value in moments.items()}
    tensors["generator"] = generator.get_state()
    partial = path.with_suffix(".partial")
    save_file(tensors, str(partial), metadata={
        "epochs": str(epochs), "settings": json.dumps(settings), "groups": json.dumps(state["param_groups"]),
        "schedule": json.dumps(schedule.state_dict())})
    partial.replace(path)  # whole or absent


def load_checkpoint(path: Path, head: EagleHead, optimizer: torch.optim.Optimizer, schedule: Any,
                    generator: torch.Generator, settings: dict[str, Any]) -> int:
    """The whole epochs a checkpoint holds, its state put back in place; 0 where there is none."""
    if not path.is_file():
        return 0
    with safe_open(str(path), "pt") as handle:
        meta = handle.metadata() or {}
        tensors = {name: handle.get_tensor(name) for name in handle.keys()}
    if json.loads(meta["settings"]) != json.loads(json.dumps(settings)):
        raise ConfigError(f"out: {path} is the checkpoint of another run ({meta['settings']}); delete it to start "
                          "afresh")
    head.load_state_dict({name[5:]: value for name, value in tensors.items() if name.startswith("head.")})
    moments: dict[int, dict[str, torch.Tensor]] = {}
    for name, value in tensors.items():
        if name.startswith("optimizer."):
            _, index, key = name.split(".")
            moments.setdefault(int(index), {})[key] = value
    optimizer.load_state_dict({"state": moments, "param_groups": json.loads(meta["groups"])})
    schedule.load_state_dict(json.loads(meta["schedule"]))
    generator.set_state(tensors["generator"])
    return int(meta["epochs"])


def train(target: Any, head: EagleHead, corpus: Corpus, states: Sequence[torch.Tensor], output: torch.Tensor,
          args: argparse.Namespace, checkpoint: Path | None = None) -> None:
    """Train the head; with `checkpoint`, save the run's state there after every epoch and resume from it where a
    stopped run of the same settings left one."""
    device = torch.device(args.device)
    pad = target.eos_token_ids[0]
    generator = torch.Generator().manual_seed(args.seed)
    corpus_ids = corpus.sequences
    steps_per_epoch = math.ceil(len(corpus_ids) / args.batch)
    total = args.epochs * steps_per_epoch
    optimizer = torch.optim.AdamW(head.parameters(), lr=args.lr, weight_decay=0.0)
    schedule = one_cycle(optimizer, args.lr, total, 0.05)
    low = TORCH_DTYPES[args.dtype]
    autocast = torch.autocast(device.type, dtype=low) if low != torch.float32 else nullcontext()
    head.train()
    settings = run_settings(args, corpus)
    done = load_checkpoint(checkpoint, head, optimizer, schedule, generator, settings) if checkpoint else 0
    if done:
        log("eagle", f"resuming from {checkpoint} after epoch {done}/{args.epochs}")
    step, start = done * steps_per_epoch, time.perf_counter()
    for epoch in range(done, args.epochs):
        sums = [0.0, 0.0]
        for group in batches([len(s) for s in corpus_ids], args.batch, generator):
            width = max(len(corpus_ids[i]) for i in group)
            ids = torch.tensor([corpus_ids[i] + [pad] * (width - len(corpus_ids[i])) for i in group], device=device)
            features = torch.zeros(len(group), width, states[0].shape[-1], device=device)  # (B, T, (1 + taps) E)
            for row, i in enumerate(group):
                features[row, : len(states[i])] = states[i].to(device, torch.float32)
            lengths = torch.tensor([len(corpus_ids[i]) for i in group], device=device)
            starts = torch.tensor([corpus.answer_starts[i] for i in group], device=device)
            with autocast:
                regression, tokens = head_loss(head, target, ids, features, lengths, starts, output, args.noise,
                                               generator, args.unroll)
            loss = regression + args.token_weight * tokens if not head.taps else tokens
            optimizer.zero_grad()
            loss.backward()
            torch.nn.utils.clip_grad_norm_(head.parameters(), 1.0)
            optimizer.step()
            schedule.step()
            step += 1
            sums[0] += regression.item()
            sums[1] += tokens.item()
            if step % 50 == 0:
                log("eagle", f"epoch {epoch + 1}, step {step}/{total}: {losses(head, regression.item(), tokens.item())}"
                    f" ({time.perf_counter() - start:.0f} s)")
        log("eagle", f"epoch {epoch + 1}/{args.epochs}: {losses(head, *(s / steps_per_epoch for s in sums))} "
            f"({time.perf_counter() - start:.0f} s)")
        if checkpoint is not None:
            save_checkpoint(checkpoint, head, optimizer, schedule, generator, epoch + 1, settings)
    head.eval()


def evaluate(target: Any, folder: Path, prompts: list[str]) -> dict[str, Any]:
    """The engine drafting with the head saved in `folder` on `prompts`, greedy, in float32 on the CPU: tokens per
    target forward and the share of decode steps that kept at least d drafted tokens, d = 1..depth. The head's
    forward is priced at its weights' estimate and the target's by the flat curve (`costs.flat`), not as measured
    here, so that the figures judge the head rather than the host (whose measured costs size the trees)."""
    from ..decoding.costs import flat
    from ..decoding.eagle import EagleProposer
    from ..engine import generate
    from ..metrics import kept_by_step
    from ..trace import CommitEvent

    proposer = EagleProposer(target, EagleParams(head=str(folder)))
    proposer.own.fixed = proposer.estimate_cost()
    generation = GenerationParams(max_new_tokens=EVAL_TOKENS)
    kept_per_step: list[int] = []
    tokens = forwards = 0
    for prompt in prompts:
        output, trace = generate(target, prompt, proposer, SamplingParams(), generation, algo="eagle", costs=flat())
        kept = kept_by_step(trace)
        steps = [e.step for e in trace.events if isinstance(e, CommitEvent) and e.step > 0]  # decode forwards
        kept_per_step += [kept.get(step, 0) for step in steps]
        tokens += len(output.token_ids) - 1  # the first token comes from the prefill
        forwards += len(steps)
    depth = proposer.depth
    return {"held_out_prompts": len(prompts), "held_out_tokens_per_target_forward": tokens / max(forwards, 1),
            "held_out_kept_at_least": {d: sum(k >= d for k in kept_per_step) / max(len(kept_per_step), 1)
                                       for d in range(1, depth + 1)},
            "head_target_cost_ratio": proposer.own.fixed}


def init_head(target: Any, args: argparse.Namespace) -> tuple[EagleHead, torch.Tensor] | None:
    """`--init`'s head and the (V',) token ids it scores, checked against `--taps` and `--head-vocab` before any long
    work; None without `--init` (a fresh head, scoring the corpus's most frequent tokens)."""
    if args.init is None:
        return None
    head, vocab_ids, _ = read_head(Path(args.init), target)
    if list(head.taps) != list(args.taps) or len(vocab_ids) != args.head_vocab:
        taps = f"--taps {' '.join(map(str, head.taps))}" if head.taps else "no --taps"
        raise ConfigError(f"init: the head in {args.init} taps layers {list(head.taps)} and scores {len(vocab_ids)} "
                          f"tokens; pass {taps} and --head-vocab {len(vocab_ids)}")
    return head, vocab_ids


def main(args: argparse.Namespace) -> int:
    from ..models import load_model

    check_int("batch", args.batch, 1, 1024)
    check_int("unroll", args.unroll, 1, 4)
    check_int("eval_prompts", args.eval_prompts, 1, len(held_out_prompts()))
    if len(set(args.taps)) != len(args.taps):
        raise ConfigError(f"taps must name each layer once, got {args.taps}")
    for name, value, most in (("noise", args.noise, 1), ("token_weight", args.token_weight, 10)):
        if not 0 <= value <= most:
            raise ConfigError(f"{name} must be in [0, {most}], got {value}")
    if args.features is not None and args.corpus_dir is None:
        raise ConfigError("features: keeping the target's features in files needs --corpus-dir")
    if args.device not in ("cpu", "cuda") or (args.device == "cuda" and not torch.cuda.is_available()):
        raise ConfigError(f"device must be cpu or cuda (with a CUDA GPU present), got {args.device!r}")
    prompts = training_setup(args)  # checks the options every trainer shares and seeds torch
    target = load_model(ModelSpec(source=args.model, device=args.device))
    check_int("head_vocab", args.head_vocab, 1, target.model.config.vocab_size)
    for layer in args.taps:
        check_int("taps", layer, 0, target.model.config.num_layers - 1)
    initial = init_head(target, args)
    corpus, generation_s = load_or_generate_corpus(target, prompts, args, args.dtype)
    start = time.perf_counter()
    states: Sequence[torch.Tensor]
    if args.corpus_dir is None:
        states = sequence_states(target, corpus, args.dtype, keep=torch.bfloat16, device=args.device,
                                 taps=tuple(args.taps))
    else:  # the features from the forward the head drafts beside
        store = Path(args.features) if args.features is not None else None
        states = target_pass(target, corpus, taps=tuple(args.taps), store=store)[0]
    head, vocab_ids = initial or (EagleHead(head_config(target.model), tuple(args.taps)),
                                  frequent_vocabulary(corpus, args.head_vocab, target.model.config.vocab_size))
    output = rows_of(target.model.output_weight.detach().float(), vocab_ids.to(target.model.device))  # (V', E)
    log("eagle", f"{sum(len(s) for s in corpus.sequences)} positions in {len(corpus.sequences)} sequences; the head "
                 f"scores {len(vocab_ids)} tokens")
    head = head.to(args.device)
    target.model.requires_grad_(False)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    train(target, head, corpus, states, output, args, out / CHECKPOINT)
    save_head(head, out, target, TORCH_DTYPES[args.weights_dtype], vocab_ids)
    (out / CHECKPOINT).unlink()  # the run is whole: a rerun starts afresh
    evaluation_target = target if args.device == "cpu" else load_model(ModelSpec(source=args.model, device="cpu"))
    report = evaluate(evaluation_target, out, held_out_prompts()[: args.eval_prompts])
    report.update({**run_report(args, prompts, corpus, generation_s, start),
                   "train_positions": sum(len(s) for s in corpus.sequences), "batch": args.batch,
                   "noise": args.noise, "unroll": args.unroll, "token_weight": args.token_weight, "taps": args.taps,
                   "head_vocab": args.head_vocab, "init": args.init, "device": args.device,
                   "size_mb": (out / WEIGHTS).stat().st_size / 1e6})
    (out / "train_report.json").write_text(json.dumps(report, indent=2))
    log("eagle", json.dumps(report))
    return 0
