"""`python -m playground bench --suite kernel`: the native matrix products and the one-token forward against this
processor's bounds.

This processor's most multiply-adds a second on the threads the products use: float32 fused multiply-adds
(`native.fma_peak`) for the float formats, 8-bit integer ones through the integer products' instruction
(`native.dot_peak`) for the integer formats; against them what the kernel's products reach over 1, 4, 8 and 12 rows
(and the rows one pass over a weight panel serves): the target's largest layer product in each format it reads
(GGUF Q4_1 blocks, the Q8_0 output rows) and the same layer product's float32 panels. One row is bound by reading
the weights, so each row also gives the bytes read a second; more rows reuse each weight read from memory, so the
share of the arithmetic bound is what they are judged by. Then the whole forward: this machine's read bandwidth
(`native.read_bandwidth`), the bytes the model's products read over it (the memory bound of a one-token forward),
and the measured forward over 1, 4 and 8 tokens against it. A shared host's bandwidth drifts (by half between minutes on
a 2-core cloud machine), so the one-token forward is also judged round by round against the bandwidth measured just
before it (`paired_rounds`).
"""

from __future__ import annotations

import statistics
import time
from typing import Any

import torch

from ..decoding.costs import measure
from ..models import native

ROWS = (1, 4, 8, 12)
FORWARD_WIDTHS = (1, 4, 8)  # tokens of the whole forwards timed against the memory bound
MIN_SECONDS = 0.02  # each timing repeats a product until it has run this long
REPEATS = 5  # timings of each; the fastest is kept (a slowed host only ever adds time)
PAIRED_ROUNDS = 7  # rounds of the read bandwidth, then the one-token forward


def product_seconds(x: torch.Tensor, panels: native.Panels) -> float:
    """The fastest of REPEATS timings of one product x (n, in) @ panels (each timing a loop of MIN_SECONDS)."""
    native.panel_linear(x, panels)  # first-call costs
    calls, best = 1, float("inf")
    for _ in range(REPEATS):
        while True:
            start = time.perf_counter()
            for _ in range(calls):
                native.panel_linear(x, panels)
            elapsed = time.perf_counter() - start
            if elapsed >= MIN_SECONDS:
                break
            calls *= 2
        best = min(best, elapsed / calls)
    return best


def run_kernel(target: Any, progress: Any) -> dict[str, Any]:
    kernel = native.kernel()
    products = target.model.packed_products()
    if kernel is None or not products:
        raise RuntimeError("the kernel suite needs the native CPU kernel and a model whose products it runs "
                           f"(here: {native.status()})")
    threads = torch.get_num_threads()
    peak = native.fma_peak(kernel, threads)
    progress(f"FMA bound: {peak / 1e9:.1f} GFMA/s on {threads} thread(s), {kernel.vector_width}-float vectors")
    integer_peak = native.dot_peak(kernel, threads)
    progress(f"integer bound: {integer_peak / 1e9:.1f} G multiply-adds/s ({kernel.dot_products})")
    integer_codes = set(native.INTEGER_FORMATS.values())
    largest: dict[int, tuple[torch.Tensor, native.Panels]] = {}  # format -> its product that reads the most bytes
    for weight, panels in products:
        if panels.format not in largest or panels.nbytes > largest[panels.format][1].nbytes:
            largest[panels.format] = (weight, panels)
    chosen = list(largest.values())
    layers = [pair for pair in products if pair[1] is not target.model.packed_output]
    if layers:  # the largest layer product again, as float32 panels: what reading the blocks changes
        weight, panels = max(layers, key=lambda pair: pair[1].nbytes)
        if panels.format != native.FORMATS[torch.float32]:
            chosen.append((weight, native.pack_panels(weight.float(), kernel, narrow=False)))
    rows = sorted({*ROWS, kernel.rows_per_pass})
    table: list[dict[str, Any]] = []
    for weight, panels in chosen:
        name = " + ".join(native.FORMAT_NAMES[piece.format] for piece in panels.pieces)
        for n in rows:
            x = torch.randn(n, panels.in_features)  # (n, in)
            seconds = product_seconds(x, panels)
            fmas = n * panels.in_features * panels.out
            integer = all(piece.format in integer_codes for piece in panels.pieces)
            table.append({"format": name + (" x 8-bit" if integer else ""), "out": panels.out,
                          "in": panels.in_features, "rows": n, "microseconds": 1e6 * seconds,
                          "gfma_per_s": fmas / seconds / 1e9, "bound": "integer" if integer else "FMA",
                          "share_of_peak": fmas / seconds / (integer_peak if integer else peak),
                          "gb_per_s": panels.nbytes / seconds / 1e9})
            progress(f"{table[-1]['format']} {panels.out}x{panels.in_features}, {n} row(s): {1e6 * seconds:.0f} us, "
                     f"{table[-1]['gfma_per_s']:.1f} G multiply-adds/s ({100 * table[-1]['share_of_peak']:.0f}% of "
                     f"the {table[-1]['bound']} bound)")
    bandwidth = native.read_bandwidth(kernel, threads)
    read = sum(panels.nbytes for _, panels in products)
    curve = measure(target.model, widths=FORWARD_WIDTHS)
    forward = {"read_gb_per_s": bandwidth / 1e9, "bytes": read, "bound_ms": 1e3 * read / bandwidth,
               "ms": {w: 1e3 * curve.time(w) for w in FORWARD_WIDTHS}}
    progress(f"one-token forward {forward['ms'][1]:.2f} ms against the memory bound {forward['bound_ms']:.2f} ms "
             f"({read / 1e6:.0f} MB at {bandwidth / 1e9:.1f} GB/s): {forward['ms'][1] / forward['bound_ms']:.2f}x")
    forward["paired"] = paired_rounds(target.model, kernel, threads, read)
    paired = forward["paired"]
    progress(f"the one-token forward over the memory bound of its own moment: median {paired['median']:.2f}x over "
             f"{len(paired['ratios'])} rounds (reading {min(paired['read_gb_per_s']):.1f}-"
             f"{max(paired['read_gb_per_s']):.1f} GB/s)")
    return {"threads": threads, "vector_width": kernel.vector_width, "rows_per_pass": kernel.rows_per_pass,
            "kernel": kernel.path.name, "peak_gfma_per_s": peak / 1e9, "dot_products": kernel.dot_products,
            "integer_peak_g_per_s": integer_peak / 1e9, "products": table, "forward": forward}


def paired_rounds(model: Any, kernel: native.Kernel, threads: int, read: int,
                  rounds: int | None = None) -> dict[str, Any]:
    """Per round, this machine's read bandwidth and then the one-token forward (the fastest of a few, `measure`):
    each forward over the bytes it reads at the bandwidth of its own moment. The median ratio, each round's ratio and
    bandwidth (GB/s)."""
    ratios, bandwidths = [], []
    for _ in range(PAIRED_ROUNDS if rounds is None else rounds):
        bandwidth = native.read_bandwidth(kernel, threads)
        seconds = measure(model, rounds=3, widths=(1,)).seconds[0]
        ratios.append(seconds * bandwidth / read)
        bandwidths.append(bandwidth / 1e9)
    return {"median": statistics.median(ratios), "ratios": ratios, "read_gb_per_s": bandwidths}


def markdown_kernel(report: dict[str, Any]) -> str:
    k = report["kernel"]
    f = k["forward"]
    lines = [f"# Kernel efficiency: {report['model']}, {report['environment']['machine']}", "",
             f"FMA bound: {k['peak_gfma_per_s']:.1f} GFMA/s on {k['threads']} thread(s) ({k['vector_width']}-float "
             f"vectors; `native.fma_peak`). Integer bound: {k['integer_peak_g_per_s']:.1f} G 8-bit multiply-adds/s "
             f"({k['dot_products']}; `native.dot_peak`). The kernel ({k['kernel']}) serves {k['rows_per_pass']} rows "
             "a pass over each weight panel.", "",
             "| product | format | rows | us | G multiply-adds/s | share of its bound | weights read, GB/s |",
             "|---|---|---|---|---|---|---|"]
    for p in k["products"]:
        lines.append(f"| {p['out']}x{p['in']} | {p['format']} | {p['rows']} | {p['microseconds']:.0f} | "
                     f"{p['gfma_per_s']:.1f} | {100 * p['share_of_peak']:.0f}% of {p.get('bound', 'FMA')} | "
                     f"{p['gb_per_s']:.1f} |")
    ms = {int(w): v for w, v in f["ms"].items()}
    lines += ["", f"The whole forward ({report['environment']['weights']}): this machine reads "
              f"{f['read_gb_per_s']:.1f} GB/s on {k['threads']} thread(s) (`native.read_bandwidth`), so reading the "
              f"products' {f['bytes'] / 1e6:.0f} MB bounds a forward at {f['bound_ms']:.2f} ms.", "",
              "| tokens | forward, ms | over the memory bound | over one token |", "|---|---|---|---|"]
    for w, v in sorted(ms.items()):
        lines.append(f"| {w} | {v:.2f} | {v / f['bound_ms']:.2f}x | {v / ms[1]:.2f}x |")
    paired = f["paired"]
    lines += ["", f"Round by round, the read bandwidth just before each one-token forward: the forward took "
              f"{min(paired['ratios']):.2f}-{max(paired['ratios']):.2f}x the bound of its own moment (median "
              f"{paired['median']:.2f}x over {len(paired['ratios'])} rounds), the bandwidth moving between "
              f"{min(paired['read_gb_per_s']):.1f} and {max(paired['read_gb_per_s']):.1f} GB/s."]
    return "\n".join(lines) + "\n"
