"""The native matrix product and attention of this checkout against a baseline build of kernels.c (a git revision or
a file), over every packed weight and the attention shapes of the embedded model (or --model), and whether the two
give the same bits.

    python experiments/kernel_costs.py [--baseline HEAD|REV|FILE] [--widths 1,2,3,6,7,9,12] [--contexts 300]
        [--rounds 12] [--repeats 5]

Per row count: the median over rounds of the time of one pass over all of a forward's products (each round's time
the median of --repeats passes) with each build, the rounds interleaving the builds since this machine's speed drifts.
Then per row count (new tokens) and context (keys before them): the same for one forward's attention, one call per
layer over random queries, keys and values of the model's shapes, the new tokens a causal chain as a verification
sees them. Kernel changes that keep every sum's order must show "yes" under "same bits".
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402
from forward_costs import widths  # noqa: E402

from playground.config import ModelSpec  # noqa: E402
from playground.models import load_model, native  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent


def contexts(text: str) -> list[int]:
    values = [int(part) for part in text.split(",") if part.strip()]
    if not values or min(values) < 1 or max(values) > 8192:
        raise argparse.ArgumentTypeError(f"contexts must be integers in 1..8192, got {text!r}")
    return values


def baseline_source(spec: str) -> str:
    """kernels.c's text at a git revision, or a file's; raises ValueError naming what is missing."""
    if Path(spec).is_file():
        return Path(spec).read_text(encoding="utf-8")
    try:
        shown = subprocess.run(["git", "show", f"{spec}:{native.SOURCE.relative_to(ROOT).as_posix()}"], cwd=ROOT,
                               capture_output=True, text=True)
    except FileNotFoundError:
        raise ValueError(f"--baseline {spec!r} is not a file, and git is not installed to read a revision") from None
    if shown.returncode != 0:
        raise ValueError(f"--baseline {spec!r} is neither a file nor a git revision of this checkout "
                         f"({shown.stderr.strip().splitlines()[-1] if shown.stderr.strip() else 'git failed'})")
    return shown.stdout


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--baseline", default="HEAD", help="git revision or kernels.c file (default HEAD)")
    parser.add_argument("--model", default="embedded")
    parser.add_argument("--widths", type=widths, default=widths("1,2,3,6,7,9,12"))
    parser.add_argument("--contexts", type=contexts, default=[300],
                        help="keys before the new tokens in the attention timings, comma-separated")
    parser.add_argument("--rounds", type=int, default=12)
    parser.add_argument("--repeats", type=int, default=5, help="passes over the products timed per build and round")
    args = parser.parse_args()
    for name in ("rounds", "repeats"):
        if not 1 <= getattr(args, name) <= 4096:
            parser.error(f"--{name} must be in 1..4096, got {getattr(args, name)}")
    try:
        source = baseline_source(args.baseline)
    except ValueError as exc:
        parser.error(str(exc))
    current = native.kernel()
    if current is None:
        parser.error(f"the native kernel is {native.status()}")
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "kernels.c"
        path.write_text(source, encoding="utf-8")
        try:
            baseline = native.load(native.build(native.default_cache_dir(), os.environ.get("CC", "cc"), path))
        except subprocess.CalledProcessError as exc:
            parser.error(f"--baseline {args.baseline!r} does not build: {(exc.stderr or '').strip()[-300:]}")
        except AttributeError as exc:  # a library from before one of the functions `native.load` binds
            parser.error(f"--baseline {args.baseline!r} lacks a kernel function this checkout needs: {exc}")
    if baseline.panel_width != current.panel_width:
        parser.error(f"--baseline packs panels of {baseline.panel_width} rows, this checkout {current.panel_width}")
    model = load_model(ModelSpec(source=args.model, device="cpu")).model
    panels = [packed for _, packed in model.packed_products()]
    builds = {"baseline": baseline, "current": current}
    print(f"{len(panels)} products; current {current.path.name}, baseline {args.baseline} {baseline.path.name}")
    threads = torch.get_num_threads()
    generator = torch.Generator().manual_seed(0)
    inputs = {(w, p.in_features): torch.randn(w, p.in_features, generator=generator)  # (N, in)
              for w in args.widths for p in panels}

    def one_pass(build: native.Kernel, rows: int) -> tuple[float, list[torch.Tensor]]:
        outputs = []  # one (N, out) per product
        start = time.perf_counter()
        for p in panels:
            y = torch.empty(rows, p.out)  # (N, out)
            build.library.playground_gemm(inputs[rows, p.in_features].data_ptr(), rows, p.in_features,
                                          p.data.data_ptr(), p.format, p.out, y.data_ptr(), threads)
            outputs.append(y)
        return time.perf_counter() - start, outputs

    print("rows  baseline ms  current ms  current/baseline  same bits")
    for rows, (base, new, same) in interleaved(builds, args.widths, one_pass, args).items():
        print(f"{rows:4d}  {base * 1e3:11.2f}  {new * 1e3:10.2f}  {new / base:16.3f}  {'yes' if same else 'NO'}")
    attention_costs(builds, model.config, args)
    return 0


def interleaved(builds: dict[str, native.Kernel], cases: list, run, args: argparse.Namespace) -> dict:
    """case -> (baseline s, current s, same bits): the median over --rounds of each round's median of --repeats
    runs, the builds taking turns on each case within a round; run(build, case) -> (seconds, list of outputs)."""
    times: dict[tuple[str, object], list[float]] = {(b, c): [] for b in builds for c in cases}
    same = dict.fromkeys(cases, True)
    for _ in range(args.rounds):
        for case in cases:
            results = {}
            for name, build in builds.items():
                runs = [run(build, case) for _ in range(args.repeats)]
                times[name, case].append(statistics.median(t for t, _ in runs))
                results[name] = runs[-1][1]
            same[case] &= all(torch.equal(a, b) for a, b in zip(results["baseline"], results["current"]))
    return {case: (statistics.median(times["baseline", case]), statistics.median(times["current", case]), same[case])
            for case in cases}


def attention_costs(builds: dict[str, native.Kernel], cfg, args: argparse.Namespace) -> None:
    """The attention table: one forward's calls (one per layer) per new-token count and context, each build."""
    if not builds["current"].attends(cfg.head_dim, torch.float32, torch.device("cpu")):
        print(f"attention: head size {cfg.head_dim} is not the native kernel's (PyTorch's attention serves it)")
        return
    generator = torch.Generator().manual_seed(1)
    hkv, group, d = cfg.num_kv_heads, cfg.num_heads // cfg.num_kv_heads, cfg.head_dim
    cases = {}
    for tokens in args.widths:
        for context in args.contexts:
            keys = context + tokens
            visible = None
            if tokens > 1:  # (1, T, L): the prefix, then a causal chain among the new tokens
                visible = torch.ones(1, tokens, keys, dtype=torch.bool)
                visible[0, :, context:] = torch.ones(tokens, tokens, dtype=torch.bool).tril()
            cases[tokens, context] = (torch.randn(1, hkv, group * tokens, d, generator=generator),  # (1, Hkv, G*T, D)
                                      torch.randn(1, hkv, keys, d, generator=generator),
                                      torch.randn(1, hkv, keys, d, generator=generator), visible)

    def one_forward(build: native.Kernel, key: tuple[int, int]) -> tuple[float, list[torch.Tensor]]:
        q, k, v, visible = cases[key]
        start = time.perf_counter()
        for _ in range(cfg.num_layers):
            out = native.attention(build, q, k, v, visible, q.shape[2] // group)
        return time.perf_counter() - start, [out]

    print(f"attention, {cfg.num_layers} layers: tokens  context  baseline ms  current ms  current/baseline  same bits")
    for key, (base, new, same) in interleaved(builds, list(cases), one_forward, args).items():
        print(f"{key[0]:6d}  {key[1]:7d}  {base * 1e3:11.2f}  {new * 1e3:10.2f}  {new / base:16.3f}  "
              f"{'yes' if same else 'NO'}")


if __name__ == "__main__":
    sys.exit(main())
