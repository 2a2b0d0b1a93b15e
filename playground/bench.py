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
    parser.add_argument("--no-peers", action="store_true", help="skip the transformers peers")
    parser.add_argument("--draft", default=None,
                        help="draft model spec: adds speculative decoding and transformers assisted generation "
                             "(default for the embedded model: its shipped draft; 'none' to skip)")
    parser.add_argument("--gamma", type=int, default=4, help="draft tokens per step for --draft, 1..16 (default 4)")
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


def run_ours(decoder: Any, prompt: str) -> tuple[Run, Any, Any]:
    """One generation on our engine: the timing run, its metrics and its trace."""
    from .decoding import generate
    from .metrics import compute

    output, trace = generate(decoder, prompt)
    metrics = compute(trace)
    return Run(metrics.tokens, metrics.wall_s, output.token_ids), metrics, trace


def run_hf(hf_model: Any, prompt_ids: list[int], target: Any, generation: GenerationParams, **extra: Any) -> Run:
    """transformers `generate` on the same weights, greedy; `extra` adds e.g. an assistant model."""
    ids = torch.tensor([prompt_ids], device=hf_model.device)
    with torch.inference_mode():
        if hf_model.device.type == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        out = hf_model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=generation.max_new_tokens,
                                do_sample=False, eos_token_id=list(target.eos_token_ids),
                                pad_token_id=target.eos_token_ids[0], **extra)
        if hf_model.device.type == "cuda":
            torch.cuda.synchronize()
        wall = time.perf_counter() - start
    new = tuple(out[0, len(prompt_ids):].tolist())
    return Run(len(new), wall, new)


def run_stats(run: Run) -> dict[str, float]:
    return {"tokens": run.tokens, "wall_s": run.wall_s, "tokens_per_s": run.tokens_per_s}


def decode_step_seconds(model: Any, steps: int = 20) -> float:
    """Median wall time of a one-token forward after a 32-token prefill: the cost of one decode step."""
    from .decoding.base import forward_tokens, new_cache

    cache = new_cache(model, 32 + steps + 1)
    forward_tokens(model, cache, list(range(100, 132)))
    times = []
    for i in range(steps):
        start = time.perf_counter()
        forward_tokens(model, cache, [200 + i])
        if model.device.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def load_hf_peer(loaded: Any) -> Any:
    """The same weights as `loaded`, as a transformers model on the same device and dtype."""
    from transformers import AutoModelForCausalLM

    dtype = loaded.model.dtype
    return AutoModelForCausalLM.from_pretrained(loaded.folder, dtype=dtype).to(loaded.model.device).eval()


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
        peer = (f"{hf['tokens_per_s']:.1f} | {row['ratio_vs_hf']:.2f}x | {'yes' if row['same_tokens'] else 'NO'}"
                if hf else "- | - | -")
        lines.append(f"| {i} | {row['category']} | {row['prompt_tokens']} | {row['ar']['tokens']} | "
                     f"{row['ar']['tokens_per_s']:.1f} | {peer} |")
    s = report["summary"]
    bound = report["bandwidth"]
    lines += ["", f"- ours, plain decoding: median {s['ar_median_tokens_per_s']:.1f} tok/s"]
    if s.get("hf_median_tokens_per_s") is not None:
        lines += [
            f"- transformers `generate`: median {s['hf_median_tokens_per_s']:.1f} tok/s",
            f"- ours / transformers: median {s['median_ratio_vs_hf']:.2f}x (goal >= 1.5x)",
        ]
    lines.append(
        f"- memory-bandwidth bound: {bound['copy_gb_per_s']:.1f} GB/s copy / {bound['weight_mb_per_token']:.0f} MB "
        f"of weights per token = {bound['bound_tokens_per_s']:.1f} tok/s; ours reaches "
        f"{100 * s['fraction_of_bound']:.0f}% of it (goal >= 60%)")
    spec = report.get("speculative")
    if spec is not None:
        lines += [
            "",
            f"## Speculative decoding: draft {spec['draft']}, gamma {spec['gamma']}",
            "",
            "| # | category | tok/s | speedup vs ours plain | acceptance | tokens per target forward (measured / "
            "theory) | same tokens as plain | transformers assisted tok/s | ours / assisted |",
            "|---|---|---|---|---|---|---|---|---|",
        ]
        for i, row in enumerate(report["prompts"]):
            sp, assisted = row["speculative"], row.get("hf_assisted")
            peer = f"{assisted['tokens_per_s']:.1f} | {row['ratio_vs_hf_assisted']:.2f}x" if assisted else "- | -"
            lines.append(
                f"| {i} | {row['category']} | {sp['tokens_per_s']:.1f} | {row['speedup_vs_ar']:.2f}x | "
                f"{sp['acceptance_rate']:.2f} | {sp['mean_accepted_tokens']:.2f} / "
                f"{sp['predicted_tokens_per_forward']:.2f} | {'yes' if row['spec_same_tokens'] else 'NO'} | "
                f"{peer} |")
        lines += [
            "",
            f"- median speedup vs our plain decoding: {s['speculative_median_speedup_vs_ar']:.2f}x (goal >= 1.8x)",
            f"- acceptance rate (accepted / drafted, mean over prompts): {s['speculative_mean_acceptance_rate']:.2f}; "
            f"draft / target decode-step cost: {spec['draft_cost_ratio']:.3f}",
        ]
        if s.get("speculative_median_ratio_vs_hf_assisted") is not None:
            lines.append(f"- ours / transformers assisted generation (same draft): median "
                         f"{s['speculative_median_ratio_vs_hf_assisted']:.2f}x (goal >= 1.5x)")
    return "\n".join(lines) + "\n"


def cmd_bench(args: argparse.Namespace) -> int:
    from .__main__ import model_spec
    from .config import ModelSpec, SpeculativeParams
    from .decoding import AutoregressiveDecoder, SpeculativeDecoder, encode_prompt
    from .metrics import expected_tokens_per_step, mean_draft_length
    from .models import load_model
    from .models.loader import default_draft

    check_int("max_new_tokens", args.max_new_tokens, 1, 4096)
    spec_params = SpeculativeParams(gamma=args.gamma)
    prompts = list(SUITE)
    if args.limit is not None:
        check_int("limit", args.limit, 1, len(SUITE))
        prompts = prompts[: args.limit]
    target = load_model(model_spec(args))
    sampling = SamplingParams()
    generation = GenerationParams(max_new_tokens=args.max_new_tokens)
    plain = AutoregressiveDecoder(target, sampling, generation)
    draft = speculative = None
    draft_source = default_draft(args.model) if args.draft is None else args.draft
    if draft_source and draft_source != "none":
        draft = load_model(ModelSpec(source=draft_source, device=args.device, dtype=args.dtype,
                                     cache_dir=args.cache_dir))
        speculative = SpeculativeDecoder(target, draft, sampling, generation, spec_params)
    hf_model = None if args.no_peers else load_hf_peer(target)
    hf_draft = load_hf_peer(draft) if hf_model is not None and draft is not None else None
    # transformers' assisted generation at the same fixed draft length as ours
    assisted = {"assistant_model": hf_draft, "num_assistant_tokens": args.gamma,
                "num_assistant_tokens_schedule": "constant", "assistant_confidence_threshold": 0.0}
    device = target.model.device

    warm = GenerationParams(max_new_tokens=8)
    warm_ids = encode_prompt(target, "Hello", warm)
    run_ours(AutoregressiveDecoder(target, sampling, warm), "Hello")
    if draft is not None:
        run_ours(SpeculativeDecoder(target, draft, sampling, warm, spec_params), "Hello")
    if hf_model is not None:
        run_hf(hf_model, warm_ids, target, warm)
        if hf_draft is not None:
            run_hf(hf_model, warm_ids, target, warm, **assisted)

    rows = []
    for index, (category, prompt) in enumerate(prompts):
        prompt_ids = encode_prompt(target, prompt, generation)
        ours, _, _ = run_ours(plain, prompt)
        row: dict[str, Any] = {"category": category, "prompt": prompt, "prompt_tokens": len(prompt_ids),
                               "ar": run_stats(ours)}
        progress = f"[{index + 1}/{len(prompts)}] {category}: ours {ours.tokens_per_s:.1f} tok/s"
        if hf_model is not None:
            peer = run_hf(hf_model, prompt_ids, target, generation)
            row["hf"] = run_stats(peer)
            row["ratio_vs_hf"] = ours.tokens_per_s / peer.tokens_per_s
            row["same_tokens"] = ours.token_ids == peer.token_ids
            progress += f", transformers {peer.tokens_per_s:.1f}"
        if speculative is not None:
            fast, metrics, trace = run_ours(speculative, prompt)
            row["speculative"] = {
                **run_stats(fast), "acceptance_rate": metrics.acceptance_rate,
                "mean_accepted_tokens": metrics.mean_accepted_tokens,
                "predicted_tokens_per_forward": expected_tokens_per_step(metrics.acceptance_rate or 0.0,
                                                                         mean_draft_length(trace) or 0.0)}
            row["speedup_vs_ar"] = fast.tokens_per_s / ours.tokens_per_s
            row["spec_same_tokens"] = fast.token_ids == ours.token_ids
            progress += f", speculative {fast.tokens_per_s:.1f} (acceptance {metrics.acceptance_rate:.2f})"
            if hf_draft is not None:
                peer = run_hf(hf_model, prompt_ids, target, generation, **assisted)
                row["hf_assisted"] = run_stats(peer)
                row["ratio_vs_hf_assisted"] = fast.tokens_per_s / peer.tokens_per_s
                progress += f", transformers assisted {peer.tokens_per_s:.1f}"
        rows.append(row)
        print(progress + " tok/s", file=sys.stderr, flush=True)

    bandwidth = copy_bandwidth(device)
    per_token = weight_bytes_per_token(target.model)
    bound = bandwidth / per_token
    ar_median = statistics.median(r["ar"]["tokens_per_s"] for r in rows)
    summary: dict[str, Any] = {"ar_median_tokens_per_s": ar_median, "fraction_of_bound": ar_median / bound}
    if hf_model is not None:
        summary["hf_median_tokens_per_s"] = statistics.median(r["hf"]["tokens_per_s"] for r in rows)
        summary["median_ratio_vs_hf"] = statistics.median(r["ratio_vs_hf"] for r in rows)
        summary["all_same_tokens"] = all(r["same_tokens"] for r in rows)
    report: dict[str, Any] = {
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
    if speculative is not None:
        summary["speculative_median_speedup_vs_ar"] = statistics.median(r["speedup_vs_ar"] for r in rows)
        summary["speculative_mean_acceptance_rate"] = statistics.mean(
            r["speculative"]["acceptance_rate"] for r in rows)
        summary["speculative_all_same_tokens"] = all(r["spec_same_tokens"] for r in rows)
        if hf_draft is not None:
            summary["speculative_median_ratio_vs_hf_assisted"] = statistics.median(
                r["ratio_vs_hf_assisted"] for r in rows)
        report["speculative"] = {
            "draft": draft.name, "gamma": args.gamma,
            "draft_cost_ratio": decode_step_seconds(draft.model) / decode_step_seconds(target.model)}
    for path, text in ((args.json, json.dumps(report, indent=2)), (args.markdown, markdown(report))):
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text(text, encoding="utf-8")
    print(markdown(report))
    return 0
