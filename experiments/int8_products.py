"""The kernel's GGUF blocks against float32 activations and against 8-bit activations (integer products), over the
matrix products of one forward of the embedded model's shapes (30 layers of Q4_1, the Q8_0 output head), both
against this machine's memory bound.

    python experiments/int8_products.py [--rows 1,2,4,8,12] [--rounds 9]

The weights are random blocks of the model's shapes (timing does not depend on their values; about 97 MB, more than
any cache), the activations random; `playground_gemm` is called straight through ctypes with buffers made once, as
close to the kernel as Python gets. Prints, per row count, the fastest round of each (rounds interleaved), each as a
multiple of the memory bound (the bytes read over `native.read_bandwidth`) and over its own one-row time.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from playground.models import native  # noqa: E402
from tests.test_gguf import random_blocks  # noqa: E402

HIDDEN, INTER, KV, LAYERS, VOCAB = 576, 1536, 192, 30, 49152  # SmolLM2-135M
LAYER = [(HIDDEN + 2 * KV, HIDDEN), (HIDDEN, HIDDEN), (2 * INTER, HIDDEN), (HIDDEN, INTER)]  # qkv, o, gate/up, down


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", default="1,2,4,8,12", help="row counts (new tokens), each 1..64")
    parser.add_argument("--rounds", type=int, default=9, help="interleaved rounds, 1..50 (default 9)")
    args = parser.parse_args()
    rows = [int(r) for r in args.rows.split(",")]
    if not rows or min(rows) < 1 or max(rows) > 64 or not 1 <= args.rounds <= 50:
        parser.error("--rows in 1..64, --rounds in 1..50")
    kernel = native.kernel()
    if kernel is None or not kernel.gguf:
        parser.error(f"the native kernel with GGUF blocks is not built here ({native.status()})")
    threads = torch.get_num_threads()
    weights = [("Q4_1", out, inp, random_blocks("Q4_1", out, inp, seed=i)) for i, (out, inp) in enumerate(LAYER)]
    weights.append(("Q8_0", VOCAB, HIDDEN, random_blocks("Q8_0", VOCAB, HIDDEN, seed=9)))
    ways = {name: [native.pack_blocks(blocks, kind, inp, kernel, integer=integer)
                   for _ in range(LAYERS) for kind, out, inp, blocks in weights[:-1]]
            + [native.pack_blocks(weights[-1][3], "Q8_0", HIDDEN, kernel, integer=integer)]
            for name, integer in (("float32 activations", False), ("8-bit activations", True))}
    read = sum(p.nbytes for p in next(iter(ways.values())))
    bound = read / native.read_bandwidth(kernel, threads)
    print(f"{kernel.dot_products}; weights {read / 1e6:.1f} MB; memory bound of one forward's products "
          f"{1e3 * bound:.2f} ms on {threads} threads")
    calls, buffers = {}, []  # buffers: the tensors the calls' pointers point into, alive until the end
    for n in rows:
        xs = {inp: torch.randn(n, inp) for inp in (HIDDEN, INTER)}
        buffers.append(xs)
        for name, panels in ways.items():
            ys = {p.out: torch.empty(n, p.out) for p in panels}
            buffers.append(ys)
            calls[name, n] = [(xs[p.in_features].data_ptr(), n, p.in_features, p.data.data_ptr(), p.format, p.out,
                               ys[p.out].data_ptr(), threads) for p in panels]
    times: dict[tuple[str, int], float] = {}
    gemm = kernel.library.playground_gemm
    for _ in range(args.rounds):
        for key, arguments in calls.items():
            start = time.perf_counter()
            for call in arguments:
                gemm(*call)
            times[key] = min(times.get(key, float("inf")), time.perf_counter() - start)
    names = list(ways)
    print("rows | " + " | ".join(f"{name}: ms, over the bound, over one row" for name in names))
    for n in rows:
        print(f"{n} | " + " | ".join(f"{1e3 * times[name, n]:.2f}, {times[name, n] / bound:.2f}, "
                                     f"{times[name, n] / times[name, rows[0]]:.2f}" for name in names))
    return 0


if __name__ == "__main__":
    sys.exit(main())
