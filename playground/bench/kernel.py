"""`python -m playground bench --suite kernel`: the native matrix products against this processor's bound.

This processor's most fused multiply-adds a second (`native.fma_peak`, on the threads the products use) against what
the kernel's products reach over 1, 4, 8 and 12 rows (and the rows one pass over a weight panel serves): the
target's largest layer product in each format it reads (GGUF Q4_1 blocks, the Q8_0 output rows) and the same layer
product's float32 panels. One row is bound by reading the weights, so each row also gives the bytes read a second;
more rows reuse each weight read from memory, so the share of the FMA bound is what they are judged by.
"""

from __future__ import annotations

import time
from typing import Any

import torch

from ..models import native

ROWS = (1, 4, 8, 12)
MIN_SECONDS = 0.02  # each timing repeats a product until it has run this long
REPEATS = 5  # timings of each; the fastest is kept (a slowed host only ever adds time)


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
        name = native.FORMAT_NAMES[panels.format]
        for n in rows:
            x = torch.randn(n, panels.in_features)  # (n, in)
            seconds = product_seconds(x, panels)
            fmas = n * panels.in_features * panels.out
            table.append({"format": name, "out": panels.out, "in": panels.in_features, "rows": n,
                          "microseconds": 1e6 * seconds, "gfma_per_s": fmas / seconds / 1e9,
                          "share_of_peak": fmas / seconds / peak, "gb_per_s": panels.nbytes / seconds / 1e9})
            progress(f"{name} {panels.out}x{panels.in_features}, {n} row(s): {1e6 * seconds:.0f} us, "
                     f"{table[-1]['gfma_per_s']:.1f} GFMA/s ({100 * table[-1]['share_of_peak']:.0f}% of the bound)")
    return {"threads": threads, "vector_width": kernel.vector_width, "rows_per_pass": kernel.rows_per_pass,
            "kernel": kernel.path.name, "peak_gfma_per_s": peak / 1e9, "products": table}


def markdown_kernel(report: dict[str, Any]) -> str:
    k = report["kernel"]
    lines = [f"# Kernel efficiency: {report['model']}, {report['environment']['machine']}", "",
             f"FMA bound: {k['peak_gfma_per_s']:.1f} GFMA/s on {k['threads']} thread(s) ({k['vector_width']}-float "
             f"vectors; `native.fma_peak`). The kernel ({k['kernel']}) serves {k['rows_per_pass']} rows a pass over "
             "each weight panel.", "",
             "| product | format | rows | us | GFMA/s | share of the FMA bound | weights read, GB/s |",
             "|---|---|---|---|---|---|---|"]
    for p in k["products"]:
        lines.append(f"| {p['out']}x{p['in']} | {p['format']} | {p['rows']} | {p['microseconds']:.0f} | "
                     f"{p['gfma_per_s']:.1f} | {100 * p['share_of_peak']:.0f}% | {p['gb_per_s']:.1f} |")
    return "\n".join(lines) + "\n"
