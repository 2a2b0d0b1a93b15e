"""The GPU engine's checks in one run, one table, quick ones first: what a decode forward costs eager, in graphs
of its own width and in graphs at the one width that keeps a token's bits, and how many kernels it runs, with the
layers as PyTorch's ops (`graphs`) and compiled (`compiled`); then, with whichever of the two gives the shorter
forward: how often a decode step waits for the device (plain decoding, the draft, Medusa, EAGLE); `bench` on a
subset of the suite (plain decoding against eager forwards and transformers `generate`; speculative, Medusa and
EAGLE against plain decoding); greedy exactness of every algorithm on both caches and in engine batches
(`check_exact.py`) in float32 and bfloat16. Each row is printed as it is measured. Meant to finish in under 8
minutes on one H100/H200 (444 s on an H200, docs/gpu.md).

    bash scripts/gpu_check.sh [--limit 4] [--rounds 2] [--new-tokens 32] [--dtypes float32,bfloat16]
                              [--out bench_results/gpu]

On a machine without CUDA (`--device cpu`) the same checks run with static shapes uncaptured, which tests the
script, not the GPU. Exits 1 when a greedy output differs from plain decoding's. A machine without the embedded
model or a package index: `scripts/gpu_stage.py`.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
import warnings
from collections import Counter
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402
from check_exact import check  # noqa: E402
from count_waits import step_waits  # noqa: E402
from torch.autograd import DeviceType  # noqa: E402
from torch.profiler import ProfilerActivity  # noqa: E402

from playground.config import GenerationParams, ModelSpec, SamplingParams  # noqa: E402
from playground.decoding.base import contiguous_cache, forward_tokens  # noqa: E402
from playground.decoding.registry import build_proposer  # noqa: E402
from playground.engine import generate  # noqa: E402
from playground.events import VerifyEvent  # noqa: E402
from playground.kv import KVCache  # noqa: E402
from playground.models import Transformer, load_model  # noqa: E402
from playground.models.forwards import ONE_WIDTH, Forwards, StaticForwards, one_width  # noqa: E402
from playground.models.loader import load_draft  # noqa: E402
from tests.prompts import PROMPTS  # noqa: E402

# ops that make no kernel of their own (a view, an allocation): left out of `kernels`' count off CUDA
VIEWS = frozenset({"view", "reshape", "_reshape_alias", "_unsafe_view", "slice", "select", "transpose", "t", "permute",
                   "unsqueeze", "squeeze", "expand", "as_strided", "split", "split_with_sizes", "narrow", "unflatten",
                   "flatten", "movedim", "alias", "detach", "detach_", "lift_fresh", "empty", "empty_like",
                   "empty_strided", "resize_", "result_type", "to", "item", "_local_scalar_dense"})


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    parser.add_argument("--new-tokens", type=int, default=32, help="tokens per prompt in the exactness checks")
    parser.add_argument("--limit", type=int, default=4, help="bench prompts (spread over the suite's categories)")
    parser.add_argument("--rounds", type=int, default=2, help="bench rounds per prompt")
    parser.add_argument("--dtypes", default="float32,bfloat16", help="the exactness checks' dtypes, comma-separated")
    parser.add_argument("--out", default="bench_results/gpu", help="where the bench's JSON and markdown go")
    args = parser.parse_args()
    started = time.perf_counter()
    rows: list[tuple[str, str, str, str]] = []  # (check, measured, goal, met)
    # the quick measurements first, so that a run stopped at its time limit has them
    fast, one_s = forward_costs(rows, args.device)
    waits(rows, args.device, fast)
    print(f"[{time.perf_counter() - started:.0f} s] forward costs measured", file=sys.stderr, flush=True)
    bench(rows, args.device, fast, args.limit, args.rounds, Path(args.out), one_s)
    print(f"[{time.perf_counter() - started:.0f} s] bench run", file=sys.stderr, flush=True)
    failures = 0
    for dtype in args.dtypes.split(","):
        failures += exactness(rows, args.device, fast, dtype, args.new_tokens)
        print(f"[{time.perf_counter() - started:.0f} s] {dtype} checked", file=sys.stderr, flush=True)
    row(rows, ("wall time", f"{time.perf_counter() - started:.0f} s", "< 480 s", "-"))

    print("\n| check | measured | goal | met |\n|---|---|---|---|")
    for measured in rows:
        print("| " + " | ".join(measured) + " |")
    return 1 if failures else 0


def forward_costs(rows: list, device: str) -> tuple[str, float]:
    """A decode forward eager, in static buckets and at the one width, over 1 and 8 tokens (float32), each way of
    running static forwards (`graphs`, and `compiled`: the layers' work around attention fused by torch.compile; off
    CUDA uncaptured); returns the way whose one-token forward as plain decoding runs it is shorter, which the other
    checks then use, with its seconds."""
    model = load_model(ModelSpec(device=device, dtype="float32", forwards="static")).model
    graphs = device == "cuda"
    eager = forward_times(model, lambda cache: Forwards(model, cache))
    ways: dict[str, float] = {}
    for mode, fused in (("graphs" if graphs else "static", False), ("compiled", True)):
        started = time.perf_counter()
        try:
            buckets = forward_times(model, lambda cache: StaticForwards(model, cache, graphs, compiled=fused))
            one = forward_times(model, lambda cache: StaticForwards(model, cache, graphs, ONE_WIDTH, compiled=fused))
        except Exception as exc:  # a compiler that fails on this machine leaves the other way's checks to run
            if not fused:
                raise
            reason = (str(exc).strip().splitlines() or [type(exc).__name__])[0][:200]
            row(rows, (f"forwards {mode}", f"failed: {reason}", "-", "NO"))
            continue
        row(rows, (f"one-token forward, eager / {mode}", f"{eager[1] / buckets[1]:.1f}x ({1e3 * eager[1]:.2f} / "
                   f"{1e3 * buckets[1]:.2f} ms)", "(information)", "-"))
        row(rows, (f"forward of 8 tokens / 1, {mode} in buckets", f"{buckets[8] / buckets[1]:.2f}", "<= 1.15",
                   yes(buckets[8] / buckets[1] <= 1.15)))
        row(rows, (f"forward at the one width {ONE_WIDTH} / 1 token in buckets, {mode}", f"{one[1] / buckets[1]:.2f}",
                   "(the price of one shape)", "-"))
        launched = kernels(model, lambda cache: StaticForwards(model, cache, compiled=fused))  # 0: none seen
        per_kernel = f"{1e6 * buckets[1] / launched:.2f} us" if launched else "-"
        row(rows, (f"kernels of a one-token forward, {mode}; its time per kernel", f"{launched}; {per_kernel}",
                   "(information: a graph replays each kernel)", "-"))
        ways[mode] = one[1] if one_width(model, 1) else buckets[1]
        row(rows, (f"seconds to measure {mode}, its compiles and captures included",
                   f"{time.perf_counter() - started:.0f} s", "(information)", "-"))
    fast = min(ways, key=ways.__getitem__)
    row(rows, ("forwards the other checks run", fast, "(the shorter one-token forward)", "-"))
    return fast, ways[fast]


def waits(rows: list, device: str, fast: str) -> None:
    """How often a decode step waits for the device, in plain decoding (the issue's goal: at most once) and with each
    model-based proposer (the draft's chain, the Medusa heads and EAGLE's trees read their guesses back once a step,
    so at most twice; a draft that samples, `sample`, once per place): the synchronizing CUDA operations PyTorch's
    sync debug mode reports, over the steps one generation makes more than a shorter one (so the engine's set-up and
    the prefill cancel out). Where a count is over its goal, the call sites of its waits follow the table's row (the
    file and line each warning names). Off CUDA the operations that would wait there, counted (`count_waits.py`)."""
    goal = "plain <= 1, proposers <= 2"
    if device != "cuda":
        target = load_model(ModelSpec(device=device, dtype="float32", forwards="static"))
        steps = {algo: step_waits(target, algo, [(PROMPTS[0], None)], GenerationParams(max_new_tokens=24))[0][1:]
                 for algo in ("ar", "speculative", "medusa", "eagle")}  # the decode steps
        counted = {algo: [sum(step.values()) for step in decode] for algo, decode in steps.items()}
        row(rows, ("waits a decode step would make on a GPU (counted)",
                   ", ".join(f"{algo} {sum(w) / len(w):.2f}" for algo, w in counted.items()), goal,
                   yes(max(counted["ar"]) <= 1 and max(max(w) for w in counted.values()) <= 2)))
        return
    name = "device waits per decode step"
    target = load_model(ModelSpec(device=device, dtype="float32", forwards=fast))
    measured, over = {}, []
    for algo in (None, "speculative", "medusa", "eagle"):
        proposer = build_proposer(target, algo) if algo else None
        generate(target, PROMPTS[0], proposer, None, GenerationParams(max_new_tokens=8))  # captures the graphs
        counted = []  # (steps, synchronizing operations by call site)
        for new_tokens in (8, 40):
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                torch.cuda.set_sync_debug_mode("warn")
                try:
                    _, trace = generate(target, PROMPTS[0], proposer, SamplingParams(),
                                        GenerationParams(max_new_tokens=new_tokens))
                finally:
                    torch.cuda.set_sync_debug_mode("default")
            sites = Counter((Path(w.filename).name, w.lineno) for w in caught if "synchroniz" in str(w.message))
            counted.append((sum(isinstance(e, VerifyEvent) for e in trace.events), sites))
        (short, short_sites), (long, long_sites) = counted
        steps = long - short if long > short else float("nan")
        per_step = measured[algo or "plain"] = (long_sites.total() - short_sites.total()) / steps
        if per_step > (2 if algo else 1):
            extra = (long_sites - short_sites).items()
            over.append(f"  waits of {algo or 'plain'} by site, a step: "
                        + ", ".join(f"{file}:{line} {n / steps:.2f}" for (file, line), n in extra))
    proposers = [per_step for algo, per_step in measured.items() if algo != "plain"]
    row(rows, (name, ", ".join(f"{algo} {per_step:.2f}" for algo, per_step in measured.items()), goal,
               yes(measured["plain"] <= 1 and max(proposers) <= 2)))
    if over:
        print("\n".join(over), flush=True)


def bench(rows: list, device: str, fast: str, limit: int, rounds: int, out: Path, one_s: float) -> None:
    """`python -m playground bench` on a subset: plain decoding against eager forwards and transformers, and the
    proposers against plain decoding; what of plain decoding's time per token its forward (`one_s`) leaves to the
    host (scheduling, tracing, the step's draws and waits), which graphs cannot remove."""
    out.mkdir(parents=True, exist_ok=True)
    subprocess.run([sys.executable, "-m", "playground", "bench", "--device", device, "--forwards", fast,
                    "--limit", str(limit), "--rounds", str(rounds), "--json", str(out / "bench.json"),
                    "--markdown", str(out / "bench.md")], check=True)
    summary = json.loads((out / "bench.json").read_text(encoding="utf-8"))["summary"]
    algos = summary["algos"]
    row(rows, (f"plain decoding, {fast}", f"{summary['ar_median_tokens_per_s']:.0f} tok/s", ">= 1000 (H100/H200)",
               yes(summary["ar_median_tokens_per_s"] >= 1000)))
    per_token = 1 / summary["ar_median_tokens_per_s"]
    row(rows, ("plain decoding's time per token beside its forward", f"{1e3 * (per_token - one_s):.2f} of "
               f"{1e3 * per_token:.2f} ms", "(information: the host's share)", "-"))
    if "ar-eager" in algos:
        ratio = 1 / algos["ar-eager"]["median_speedup_vs_ar"]
        row(rows, (f"plain {fast} / plain eager", f"{ratio:.2f}x", ">= 10x", yes(ratio >= 10)))
    if "median_ratio_vs_hf" in summary:
        row(rows, ("plain / transformers generate", f"{summary['median_ratio_vs_hf']:.2f}x", "(peer)", "-"))
    for name in ("speculative", "speculative-copy", "medusa", "medusa-copy", "eagle", "eagle-copy"):
        if name in algos:
            speedup = algos[name]["median_speedup_vs_ar"]
            row(rows, (f"{name} / plain decoding", f"{speedup:.2f}x", ">= 1.8x", yes(speedup >= 1.8)))


def exactness(rows: list, device: str, fast: str, dtype: str, new_tokens: int) -> int:
    """Every algorithm against plain decoding (`check_exact.check`) in one dtype; the mismatches that count."""
    target = load_model(ModelSpec(device=device, dtype=dtype, forwards=fast))
    results = check(target, load_draft(None, target), new_tokens)
    failures = 0
    # batch 1 (every algorithm, both caches) and engine batches; in 16 bits a batch's rows and its prefill chunks
    # change the kernels' shapes, so batches equal solo runs in float32 only (docs/gpu.md)
    for kind, names in (("batch 1", [n for n in results if "/" in n]),
                        ("engine batches", [n for n in results if "/" not in n])):
        bad = {n: results[n][1] - results[n][0] for n in names if results[n][0] < results[n][1]}
        counted = kind == "batch 1" or dtype == "float32"
        failures += sum(bad.values()) if counted else 0
        row(rows, (f"greedy exact, {dtype}, {fast}, {kind}", f"{len(names) - len(bad)}/{len(names)} settings",
                   "all" if counted else "(information)", yes(not bad) if counted else "-"))
    eager_model = load_model(ModelSpec(device=device, dtype=dtype, forwards="eager"))
    generation, greedy = GenerationParams(max_new_tokens=new_tokens), SamplingParams()
    same = sum(generate(target, p, None, greedy, generation)[0].token_ids
               == generate(eager_model, p, None, greedy, generation)[0].token_ids for p in PROMPTS)
    row(rows, (f"plain {fast} = plain eager, {dtype}", f"{same}/{len(PROMPTS)} prompts", "(information)", "-"))
    return failures


@torch.inference_mode()
def forward_times(model: Transformer, make: Callable[[KVCache], Forwards], context: int = 256,
                  rounds: int = 30) -> dict[int, float]:
    """Median seconds of a decode forward over 1 and over 8 new tokens after `context` tokens, with its logits, the
    forwards `make` builds over a fresh cache (the first round, which may capture graphs, left out)."""
    cache = contiguous_cache(model, context + 64)
    forward_tokens(model, cache, list(range(context)))
    run = make(cache)
    times: dict[int, list[float]] = {1: [], 8: []}
    for _ in range(rounds + 1):
        for width in times:
            synchronize(model)
            start = time.perf_counter()
            model.project(run([0], [[7] * width], [list(range(context, context + width))]))
            synchronize(model)
            times[width].append(time.perf_counter() - start)
            cache.truncate(0, context)
    return {width: statistics.median(values[1:]) for width, values in times.items()}


@torch.inference_mode()
def kernels(model: Transformer, make: Callable[[KVCache], Forwards], context: int = 32) -> int:
    """The kernels (and device copies) of one one-token decode forward with its logits through the forwards `make`
    builds, uncaptured: what its graph replays one after another. Where the forward in graphs takes about this many
    times a kernel's few microseconds, only fewer kernels (fused layers) make it faster. Off CUDA: the PyTorch ops
    that compute (not views; neither the native CPU kernel's calls nor compiled code's are PyTorch ops)."""
    cache = contiguous_cache(model, context + 8)
    forward_tokens(model, cache, list(range(context)))
    run = make(cache)
    run([0], [[7]], [[context]])  # compiles where it compiles
    cache.truncate(0, context)
    cuda = model.device.type == "cuda"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with torch.profiler.profile(activities=activities) as profile:
        model.project(run([0], [[7]], [[context]]))
        synchronize(model)
    events = profile.events()
    if cuda:
        return sum(e.device_type == DeviceType.CUDA for e in events)
    return sum(e.name.startswith("aten::") and e.name.removeprefix("aten::") not in VIEWS
               and not any(c.name.startswith("aten::") for c in e.cpu_children) for e in events)


def synchronize(model: Transformer) -> None:
    if model.device.type == "cuda":
        torch.cuda.synchronize()


def row(rows: list[tuple[str, str, str, str]], measured: tuple[str, str, str, str]) -> None:
    """Add a row to the table and print it at once (a run stopped at its time limit keeps what it measured)."""
    rows.append(measured)
    print("| " + " | ".join(measured) + " |", flush=True)


def yes(met: bool) -> str:
    return "yes" if met else "NO"


if __name__ == "__main__":
    sys.exit(main())
