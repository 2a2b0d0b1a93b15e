"""Distil a small draft model for a target: `python -m playground.train draft`.

1. The target answers the project's training prompts greedily (batched transformers `generate`).
2. A small Llama with the target's tokenizer and full vocabulary (so transformers can use it as
   `assistant_model`) learns to predict the target's greedy tokens: cross-entropy on the answer positions.
   Its tied embedding starts from the target's embedding projected on its top principal directions.
3. It is saved in Hugging Face format with a report: greedy acceptance on held-out prompts and the
   draft/target decode-step cost ratio.
Everything is seeded; the run is reproducible up to floating-point reduction order.
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
import sys
import time
from pathlib import Path
from typing import Any

import torch

from ..config import GenerationParams, ModelSpec, SamplingParams, SpeculativeParams, check_int
from ..models.loader import EMBEDDED_DRAFT
from .prompts import held_out_prompts, training_prompts

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "generation_config.json")


def add_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="embedded", help="target model spec (default: embedded)")
    parser.add_argument("--out", default=str(EMBEDDED_DRAFT), help="output folder (Hugging Face format)")
    parser.add_argument("--hidden", type=int, default=128, help="draft hidden size (default 128)")
    parser.add_argument("--layers", type=int, default=4, help="draft decoder layers (default 4)")
    parser.add_argument("--answer-tokens", type=int, default=96, help="target tokens generated per prompt")
    parser.add_argument("--epochs", type=int, default=8)
    parser.add_argument("--limit", type=int, default=None, help="use only the first N training prompts")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--eval-prompts", type=int, default=len(held_out_prompts()),
                        help=f"held-out prompts for the acceptance report (default all {len(held_out_prompts())})")


def log(message: str) -> None:
    print(f"[train draft] {message}", file=sys.stderr, flush=True)


def generate_corpus(target: Any, prompts: list[str], answer_tokens: int, batch: int = 16) -> list[tuple[list[int], int]]:
    """(token ids of prompt + greedy answer, index where the answer starts) per prompt."""
    from ..bench import load_hf_peer
    from ..decoding import encode_prompt

    hf = load_hf_peer(target)
    pad = target.eos_token_ids[0]
    generation = GenerationParams(max_new_tokens=answer_tokens)
    corpus = []
    start = time.perf_counter()
    for first in range(0, len(prompts), batch):
        encoded = [encode_prompt(target, p, generation) for p in prompts[first : first + batch]]
        width = max(len(e) for e in encoded)
        ids = torch.tensor([[pad] * (width - len(e)) + e for e in encoded])  # left padding: (B, W)
        mask = torch.tensor([[0] * (width - len(e)) + [1] * len(e) for e in encoded])
        with torch.inference_mode():
            out = hf.generate(ids, attention_mask=mask, max_new_tokens=answer_tokens, do_sample=False,
                              eos_token_id=list(target.eos_token_ids), pad_token_id=pad)
        for row, prompt_ids in enumerate(encoded):
            answer = out[row, width:].tolist()
            if pad in answer:  # keep the end-of-sequence token itself, drop the padding after it
                answer = answer[: answer.index(pad) + 1]
            corpus.append((prompt_ids + answer, len(prompt_ids)))
        done = first + len(encoded)
        log(f"target answered {done}/{len(prompts)} prompts ({time.perf_counter() - start:.0f} s)")
    return corpus


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


def batches(corpus: list[tuple[list[int], int]], size: int, generator: torch.Generator, pad: int):
    """Shuffled padded batches: ids (B, T), labels (B, T) with -100 outside the answers."""
    order = torch.randperm(len(corpus), generator=generator).tolist()
    for first in range(0, len(order), size):
        rows = [corpus[i] for i in order[first : first + size]]
        width = max(len(ids) for ids, _ in rows)
        ids = torch.full((len(rows), width), pad)
        labels = torch.full((len(rows), width), -100)
        for r, (seq, answer_start) in enumerate(rows):
            ids[r, : len(seq)] = torch.tensor(seq)
            # transformers shifts labels by one inside the loss: label t is token t, scored at position t-1.
            # Only the target's greedy answer tokens are learned.
            labels[r, answer_start : len(seq)] = torch.tensor(seq[answer_start:])
        yield ids, labels


def train(target: Any, corpus: list[tuple[list[int], int]], args: argparse.Namespace) -> Any:
    from transformers import LlamaForCausalLM

    torch.manual_seed(args.seed)
    model = LlamaForCausalLM(draft_config(target, args.hidden, args.layers))
    with torch.no_grad():
        model.model.embed_tokens.weight.copy_(projected_embedding(target, args.hidden, args.seed))
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01)
    batch_size = 16
    total = args.epochs * math.ceil(len(corpus) / batch_size)
    schedule = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=3e-3, total_steps=total, pct_start=0.1)
    generator = torch.Generator().manual_seed(args.seed)
    step, start = 0, time.perf_counter()
    for epoch in range(args.epochs):
        losses = []
        for ids, labels in batches(corpus, batch_size, generator, target.eos_token_ids[0]):
            loss = model(input_ids=ids, labels=labels).loss
            optimizer.zero_grad()
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            schedule.step()
            losses.append(loss.item())
            step += 1
        log(f"epoch {epoch + 1}/{args.epochs}: loss {sum(losses) / len(losses):.3f} "
            f"({step}/{total} steps, {time.perf_counter() - start:.0f} s)")
    return model.eval()


def evaluate(target: Any, folder: Path, prompts: list[str]) -> dict[str, float]:
    """Greedy acceptance per drafted token on held-out prompts, and the decode-step cost ratio."""
    from ..bench import decode_step_seconds
    from ..decoding import SpeculativeDecoder, generate
    from ..metrics import compute
    from ..models import load_model

    draft = load_model(ModelSpec(source=str(folder), device=str(target.model.device)))
    decoder = SpeculativeDecoder(target, draft, SamplingParams(), GenerationParams(max_new_tokens=64),
                                 SpeculativeParams(gamma=4))
    accepted = drafted = 0
    for prompt in prompts:
        _, trace = generate(decoder, prompt)
        drafts = sum(len(e.tokens) for e in trace.events if e.KIND == "draft")
        accepted += round((compute(trace).acceptance_rate or 0.0) * drafts)
        drafted += drafts
    cost = decode_step_seconds(draft.model) / decode_step_seconds(target.model)
    return {"held_out_greedy_acceptance": accepted / drafted, "draft_target_cost_ratio": cost,
            "held_out_prompts": len(prompts)}


def main(args: argparse.Namespace) -> int:
    from ..models import load_model

    check_int("hidden", args.hidden, 32, 1024)
    check_int("layers", args.layers, 1, 32)
    check_int("answer_tokens", args.answer_tokens, 8, 512)
    check_int("epochs", args.epochs, 1, 100)
    check_int("eval_prompts", args.eval_prompts, 1, len(held_out_prompts()))
    prompts = training_prompts()
    if args.limit is not None:
        check_int("limit", args.limit, 1, len(prompts))
        prompts = prompts[: args.limit]
    torch.manual_seed(args.seed)
    target = load_model(ModelSpec(source=args.model, device="cpu"))
    start = time.perf_counter()
    corpus = generate_corpus(target, prompts, args.answer_tokens)
    model = train(target, corpus, args)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    for name in TOKENIZER_FILES:
        if (target.folder / name).is_file():
            shutil.copy(target.folder / name, out / name)
    report = evaluate(target, out, held_out_prompts()[: args.eval_prompts])
    report.update({"train_prompts": len(prompts), "train_tokens": sum(len(s) - a for s, a in corpus),
                   "hidden": args.hidden, "layers": args.layers, "epochs": args.epochs, "seed": args.seed,
                   "wall_s": time.perf_counter() - start,
                   "size_mb": sum(f.stat().st_size for f in out.glob("*.safetensors")) / 1e6})
    (out / "train_report.json").write_text(json.dumps(report, indent=2))
    log(json.dumps(report))
    return 0
