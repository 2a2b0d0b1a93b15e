"""Benchmark harness (`python -m playground bench`): our decoders vs plain decoding vs transformers, in one run.

Speed claims are ratios measured in the same process, one prompt after another, because these machines are
noisy; absolute tokens/s are reported next to the memory-bandwidth bound that caps batch-1 decoding.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from .bench_suite import SUITE
from .config import GenerationParams, SamplingParams, check_int


def add_bench_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--suite", default="default", choices=["default"], help="prompt suite")
    parser.add_argument("--max-new-tokens", type=int, default=128, help="1..4096 (default 128)")
    parser.add_argument("--limit", type=int, default=None, help="run only the first N prompts of the suite")
    parser.add_argument("--no-peers", action="store_true", help="skip the transformers peer")
    parser.add_argument("--json", default="bench_results/bench.json", help="where to write the JSON results")
    parser.add_argument("--markdown", default="bench_results/bench.md", help="where to write the markdown table")
    parser.set_defaults(func=cmd_bench)


@dataclass(frozen=True, slots=True)
class Run:
    tokens: int
    wall_s: float
    token_ids: tuple[int, ...]

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.wall_s


def copy_bandwidth(device: torch.device, megabytes: int = 256, repeats: int = 10) -> float:
    """Bytes/s of a large tensor copy, counting the read and the write (the STREAM 'copy' convention)."""
    src = torch.ones(megabytes * 2**20 // 4, dtype=torch.float32, device=device)
    dst = torch.empty_like(src)
    best = float("inf")
    for _ in range(repeats):
        if device.type == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        dst.copy_(src)
        if device.type == "cuda":
            torch.cuda.synchronize()
        best = min(best, time.perf_counter() - start)
    return 2 * src.numel() * src.element_size() / best


def weight_bytes_per_token(model: torch.nn.Module) -> int:
    """Bytes of weights one decode step reads: every parameter, except that an untied input embedding only
    contributes the one row it looks up (a tied one is read whole as the output projection)."""
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    if model.lm_head is not None:
        emb = model.embed_tokens.weight
        total -= emb.numel() * emb.element_size() - emb.shape[1] * emb.element_size()
    return total


def run_ours(target: Any, prompt: str, sampling: SamplingParams, generation: GenerationParams) -> Run:
    from .decoding import AutoregressiveDecoder, generate
    from .metrics import compute

    output, trace = generate(AutoregressiveDecoder(target, sampling, generation), prompt)
    metrics = compute(trace)
    return Run(metrics.tokens, metrics.wall_s, output.token_ids)


def run_hf(hf_model: Any, prompt_ids: list[int], target: Any, generation: GenerationParams) -> Run:
    ids = torch.tensor([prompt_ids], device=hf_model.device)
    with torch.inference_mode():
        if hf_model.device.type == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        out = hf_model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=generation.max_new_tokens,
                                do_sample=False, eos_token_id=list(target.eos_token_ids),
                                pad_token_id=target.eos_token_ids[0])
        if hf_model.device.type == "cuda":
            torch.cuda.synchronize()
        wall = time.perf_counter() - start
    new = tuple(out[0, len(prompt_ids):].tolist())
    return Run(len(new), wall, new)


def load_hf_peer(target: Any) -> Any:
    from transformers import AutoModelForCausalLM

    dtype = target.model.dtype
    return AutoModelForCausalLM.from_pretrained(target.folder, dtype=dtype).to(target.model.device).eval()


def markdown(report: dict[str, Any]) -> str:
    env = report["environment"]
    lines = [
        f"# Benchmark: {report['model']} ({env['device']}, {env['dtype']}, batch 1, greedy, "
        f"{report['max_new_tokens']} new tokens)",
        "",
        f"torch {env['torch']}, {env['threads']} threads, {env['machine']}.",
        "",
        "| # | category | prompt tokens | new tokens | ours tok/s | transformers tok/s | ours / transformers | same tokens |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for i, row in enumerate(report["prompts"]):
        hf = row.get("hf")
        lines.append(
            f"| {i} | {row['category']} | {row['prompt_tokens']} | {row['ar']['tokens']} | "
            f"{row['ar']['tokens_per_s']:.1f} | {hf['tokens_per_s']:.1f} | {row['ratio_vs_hf']:.2f}x | "
            f"{'yes' if row['same_tokens'] else 'NO'} |" if hf else
            f"| {i} | {row['category']} | {row['prompt_tokens']} | {row['ar']['tokens']} | "
            f"{row['ar']['tokens_per_s']:.1f} | - | - | - |")
    s = report["summary"]
    bound = report["bandwidth"]
    lines += [
        "",
        f"- ours, plain decoding: median {s['ar_median_tokens_per_s']:.1f} tok/s",
    ]
    if s.get("hf_median_tokens_per_s") is not None:
        lines += [
            f"- transformers `generate`: median {s['hf_median_tokens_per_s']:.1f} tok/s",
            f"- ours / transformers: median {s['median_ratio_vs_hf']:.2f}x (goal >= 1.5x)",
        ]
    lines += [
        f"- memory-bandwidth bound: {bound['copy_gb_per_s']:.1f} GB/s copy / {bound['weight_mb_per_token']:.0f} MB "
        f"of weights per token = {bound['bound_tokens_per_s']:.1f} tok/s; ours reaches "
        f"{100 * s['fraction_of_bound']:.0f}% of it (goal >= 60%)",
    ]
    return "\n".join(lines) + "\n"


def cmd_bench(args: argparse.Namespace) -> int:
    from .__main__ import model_spec
    from .decoding import encode_prompt
    from .models import load_model

    check_int("max_new_tokens", args.max_new_tokens, 1, 4096)
    prompts = list(SUITE)
    if args.limit is not None:
        check_int("limit", args.limit, 1, len(SUITE))
        prompts = prompts[: args.limit]
    spec = model_spec(args)
    target = load_model(spec)
    sampling = SamplingParams()
    generation = GenerationParams(max_new_tokens=args.max_new_tokens)
    hf_model = None if args.no_peers else load_hf_peer(target)
    device = target.model.device

    warm = GenerationParams(max_new_tokens=8)
    run_ours(target, "Hello", sampling, warm)
    if hf_model is not None:
        run_hf(hf_model, encode_prompt(target, "Hello", warm), target, warm)

    rows = []
    for index, (category, prompt) in enumerate(prompts):
        prompt_ids = encode_prompt(target, prompt, generation)
        ours = run_ours(target, prompt, sampling, generation)
        row: dict[str, Any] = {"category": category, "prompt": prompt, "prompt_tokens": len(prompt_ids),
                               "ar": {"tokens": ours.tokens, "wall_s": ours.wall_s,
                                      "tokens_per_s": ours.tokens_per_s}}
        if hf_model is not None:
            peer = run_hf(hf_model, prompt_ids, target, generation)
            row["hf"] = {"tokens": peer.tokens, "wall_s": peer.wall_s, "tokens_per_s": peer.tokens_per_s}
            row["ratio_vs_hf"] = ours.tokens_per_s / peer.tokens_per_s
            row["same_tokens"] = ours.token_ids == peer.token_ids
        rows.append(row)
        print(f"[{index + 1}/{len(prompts)}] {category}: ours {ours.tokens_per_s:.1f} tok/s"
              + (f", transformers {row['hf']['tokens_per_s']:.1f} tok/s" if hf_model is not None else ""),
              file=sys.stderr, flush=True)

    bandwidth = copy_bandwidth(device)
    per_token = weight_bytes_per_token(target.model)
    bound = bandwidth / per_token
    ar_median = statistics.median(r["ar"]["tokens_per_s"] for r in rows)
    summary: dict[str, Any] = {"ar_median_tokens_per_s": ar_median, "fraction_of_bound": ar_median / bound}
    if hf_model is not None:
        summary["hf_median_tokens_per_s"] = statistics.median(r["hf"]["tokens_per_s"] for r in rows)
        summary["median_ratio_vs_hf"] = statistics.median(r["ratio_vs_hf"] for r in rows)
        summary["all_same_tokens"] = all(r["same_tokens"] for r in rows)
    report = {
        "model": target.name,
        "max_new_tokens": args.max_new_tokens,
        "environment": {"device": str(device), "dtype": str(target.model.dtype).removeprefix("torch."),
                        "torch": torch.__version__, "threads": torch.get_num_threads(),
                        "machine": f"{platform.machine()} {platform.processor() or platform.system()}"},
        "bandwidth": {"copy_gb_per_s": bandwidth / 1e9, "weight_mb_per_token": per_token / 1e6,
                      "bound_tokens_per_s": bound},
        "summary": summary,
        "prompts": rows,
    }
    for path, text in ((args.json, json.dumps(report, indent=2)), (args.markdown, markdown(report))):
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text(text, encoding="utf-8")
    print(markdown(report))
    return 0
