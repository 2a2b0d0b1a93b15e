"""The GPU engine's checks in one run, one table: greedy exactness of every algorithm on both caches and in engine
batches (`check_exact.py`) in float32 and bfloat16 with CUDA graphs, the forward cost by width with graphs and
eager, and `bench` on a subset of the suite (plain decoding with graphs against eager forwards and transformers
`generate`; speculative, Medusa and EAGLE against plain decoding). About 5 minutes on one H100/H200.

    bash scripts/gpu_check.sh [--limit 4] [--rounds 2] [--new-tokens 32] [--out bench_results/gpu]

On a machine without CUDA (`--device cpu`) the same checks run with static shapes uncaptured, which tests the
script, not the GPU. Exits 1 when a greedy output differs from plain decoding's.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from check_exact import check  # noqa: E402

from playground.config import GenerationParams, ModelSpec, SamplingParams  # noqa: E402
from playground.decoding.costs import measure  # noqa: E402
from playground.engine import generate  # noqa: E402
from playground.models import load_model  # noqa: E402
from playground.models.loader import load_draft  # noqa: E402
from tests.prompts import PROMPTS  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    parser.add_argument("--new-tokens", type=int, default=32, help="tokens per prompt in the exactness checks")
    parser.add_argument("--limit", type=int, default=4, help="bench prompts (spread over the suite's categories)")
    parser.add_argument("--rounds", type=int, default=2, help="bench rounds per prompt")
    parser.add_argument("--out", default="bench_results/gpu", help="where the bench's JSON and markdown go")
    args = parser.parse_args()
    fast = "graphs" if args.device == "cuda" else "static"
    started = time.perf_counter()
    rows: list[tuple[str, str, str, str]] = []  # (check, measured, goal, met)
    failures = 0

    for dtype in ("float32", "bfloat16"):
        target = load_model(ModelSpec(device=args.device, dtype=dtype, forwards=fast))
        results = check(target, load_draft(None, target), args.new_tokens)
        bad = {name: total - exact for name, (exact, total) in results.items() if exact < total}
        failures += sum(bad.values())
        rows.append((f"greedy exact, {dtype}, {fast}", f"{len(results) - len(bad)}/{len(results)} settings",
                     "all", yes(not bad)))
        eager = load_model(ModelSpec(device=args.device, dtype=dtype, forwards="eager"))
        generation, greedy = GenerationParams(max_new_tokens=args.new_tokens), SamplingParams()
        same = sum(generate(target, p, None, greedy, generation)[0].token_ids
                   == generate(eager, p, None, greedy, generation)[0].token_ids for p in PROMPTS)
        rows.append((f"plain {fast} = plain eager, {dtype}", f"{same}/{len(PROMPTS)} prompts", "(information)", "-"))
        print(f"[{time.perf_counter() - started:.0f} s] {dtype} checked", file=sys.stderr, flush=True)

    target = load_model(ModelSpec(device=args.device, dtype="float32", forwards=fast))
    for forwards in (fast, "eager"):
        costs = measure(target.model, rounds=3, forwards=forwards)
        ratio = costs.time(8) / costs.time(1)
        rows.append((f"forward of 8 tokens / 1, {forwards}", f"{ratio:.2f} ({1e3 * costs.time(1):.2f} ms for 1)",
                     "<= 1.15", yes(ratio <= 1.15) if forwards == fast else "-"))
    print(f"[{time.perf_counter() - started:.0f} s] forward costs measured", file=sys.stderr, flush=True)

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    subprocess.run([sys.executable, "-m", "playground", "bench", "--device", args.device, "--forwards", fast,
                    "--limit", str(args.limit), "--rounds", str(args.rounds), "--json", str(out / "bench.json"),
                    "--markdown", str(out / "bench.md")], check=True)
    summary = json.loads((out / "bench.json").read_text(encoding="utf-8"))["summary"]
    algos = summary["algos"]
    rows.append((f"plain decoding, {fast}", f"{summary['ar_median_tokens_per_s']:.0f} tok/s", ">= 1000 (H100/H200)",
                 yes(summary["ar_median_tokens_per_s"] >= 1000)))
    if "ar-eager" in algos:
        ratio = 1 / algos["ar-eager"]["median_speedup_vs_ar"]
        rows.append((f"plain {fast} / plain eager", f"{ratio:.2f}x", ">= 10x", yes(ratio >= 10)))
    if "median_ratio_vs_hf" in summary:
        rows.append(("plain / transformers generate", f"{summary['median_ratio_vs_hf']:.2f}x", "(peer)", "-"))
    for name in ("speculative", "medusa", "eagle"):
        if name in algos:
            speedup = algos[name]["median_speedup_vs_ar"]
            rows.append((f"{name} / plain decoding", f"{speedup:.2f}x", ">= 1.8x", yes(speedup >= 1.8)))
    rows.append(("wall time", f"{time.perf_counter() - started:.0f} s", "< 480 s", "-"))

    print("\n| check | measured | goal | met |\n|---|---|---|---|")
    for row in rows:
        print("| " + " | ".join(row) + " |")
    return 1 if failures else 0


def yes(met: bool) -> str:
    return "yes" if met else "NO"


if __name__ == "__main__":
    sys.exit(main())
