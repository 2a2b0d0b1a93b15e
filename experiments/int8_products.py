"""Integer products on 8-bit activations (experiments/int8_products.c) against the float kernel's GGUF blocks, over
the matrix products of one forward of the embedded model's shapes (30 layers of Q4_1, the Q8_0 output head), and both
against this machine's memory bound: the question issue 102 starts from, before the kernel changes.

    python experiments/int8_products.py [--rows 1,2,4,8,12] [--rounds 7] [--threads 2]

The weights are random blocks of the model's shapes (timing does not depend on their values; about 97 MB, more than
any cache), the activations random. Prints, per row count: the float kernel's time for one forward's products
(`playground_gemm` on the same blocks, as the engine runs them), the integer path's (activations quantised per
product, included), each as a multiple of the memory bound (the bytes read over the read bandwidth measured here),
and each over its own one-row time (what a verifying forward costs). Also whether the integer path gives the same bits
built for this CPU, for AVX2 (`-march=haswell`) and for plain x86-64, and its error against float64 arithmetic on the
same quantised activations.
"""

from __future__ import annotations

import argparse
import ctypes
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from playground.models import native  # noqa: E402

SOURCE = Path(__file__).with_name("int8_products.c")
HIDDEN, INTER, KV, LAYERS, VOCAB = 576, 1536, 192, 30, 49152  # SmolLM2-135M
LAYER = [(HIDDEN, HIDDEN), (KV, HIDDEN), (KV, HIDDEN), (HIDDEN, HIDDEN), (INTER, HIDDEN), (INTER, HIDDEN),
         (HIDDEN, INTER)]  # (out, in) of q, k, v, o, gate, up, down
ARCHES = {"native": "native", "AVX2": "haswell", "plain": "x86-64"}
P = ctypes.c_void_p


def build(folder: Path, march: str) -> ctypes.CDLL:
    path = folder / f"int8-{march}.so"
    subprocess.run(["cc", "-O3", f"-march={march}", "-ffp-contract=off", "-fno-math-errno", "-fopenmp", "-shared",
                    "-fPIC", "-o", str(path), str(SOURCE), "-lm"], check=True)
    library = ctypes.CDLL(str(path))
    library.int8_panel_bytes.restype = ctypes.c_long
    library.int8_read_seconds.restype = ctypes.c_double
    return library


def random_blocks(rng: np.random.Generator, out: int, inp: int, q4: bool) -> np.ndarray:
    """GGUF rows (out, in / 32 blocks) of Q4_1 (d, m, 16 bytes of nibbles) or Q8_0 (d, 32 signed bytes)."""
    blocks = out * inp // 32
    if q4:
        heads = np.stack([rng.uniform(0.001, 0.02, blocks), rng.uniform(-0.15, 0.0, blocks)], 1).astype(np.float16)
        quants = rng.integers(0, 256, (blocks, 16), dtype=np.uint8)
    else:
        heads = rng.uniform(0.001, 0.02, (blocks, 1)).astype(np.float16)
        quants = rng.integers(-127, 128, (blocks, 32)).astype(np.int8).view(np.uint8)
    return np.concatenate([heads.view(np.uint8), quants], 1).reshape(out, -1)


def ptr(array: np.ndarray) -> int:
    return array.ctypes.data


_SCRATCH: dict[tuple[int, int], tuple[np.ndarray, ...]] = {}


def scratch(n: int, inp: int) -> tuple[np.ndarray, ...]:
    """Quantised activations' buffers for n rows of `inp` inputs, made once: (q, d_x, s_x, t_x)."""
    if (n, inp) not in _SCRATCH:
        blocks = n * inp // 32
        _SCRATCH[n, inp] = (np.empty((n, inp), np.int8), np.empty(blocks, np.float32), np.empty(blocks, np.float32),
                            np.empty(blocks, np.int32))
    return _SCRATCH[n, inp]


class Product:
    """One matrix: its GGUF rows, packed for the integer path and for the float kernel."""

    def __init__(self, library: ctypes.CDLL, kernel: native.Kernel, rows: np.ndarray, out: int, inp: int, q4: bool):
        self.out, self.inp, self.q4, self.rows = out, inp, q4, rows
        self.panels = np.empty(library.int8_panel_bytes(int(q4), inp) * -(-out // 16), np.uint8)
        library.int8_pack(P(ptr(rows)), out, inp, int(q4), P(ptr(self.panels)))
        self.floats = native.pack_blocks(torch.from_numpy(rows), "Q4_1" if q4 else "Q8_0", inp, kernel)

    def int8(self, library: ctypes.CDLL, x: np.ndarray, y: np.ndarray, threads: int) -> None:
        """y = x @ W^T, x quantised first (every product quantises its input: a forward would share some)."""
        n = x.shape[0]
        q, dx, sx, tx = scratch(n, self.inp)
        library.int8_quantise(P(ptr(x)), n, self.inp, P(ptr(q)), P(ptr(dx)), P(ptr(sx)), P(ptr(tx)))
        library.int8_gemm(P(ptr(q)), P(ptr(dx)), P(ptr(sx)), P(ptr(tx)), n, self.inp, P(ptr(self.panels)),
                          int(self.q4), self.out, P(ptr(y)), threads)

    def floats_gemm(self, kernel: native.Kernel, x: np.ndarray, y: np.ndarray, threads: int) -> None:
        kernel.library.playground_gemm(P(ptr(x)), x.shape[0], self.inp, P(self.floats.data.data_ptr()),
                                       self.floats.format, self.out, P(ptr(y)), threads)


def reference(product: Product, library: ctypes.CDLL, x: np.ndarray) -> np.ndarray:
    """The integer path's value in float64: the same quantised activations and blocks, summed exactly."""
    n, inp = x.shape
    blocks = n * inp // 32
    q = np.empty((n, inp), np.int8)
    dx, sx, tx = np.empty(blocks, np.float32), np.empty(blocks, np.float32), np.empty(blocks, np.int32)
    library.int8_quantise(P(ptr(x)), n, inp, P(ptr(q)), P(ptr(dx)), P(ptr(sx)), P(ptr(tx)))
    size = 20 if product.q4 else 34
    rows = product.rows.reshape(product.out, inp // 32, size)
    d = rows[:, :, :2].copy().view(np.float16)[..., 0].astype(np.float64)  # (out, blocks)
    if product.q4:
        m = rows[:, :, 2:4].copy().view(np.float16)[..., 0].astype(np.float64)
        nib = rows[:, :, 4:]
        w = np.concatenate([nib & 15, nib >> 4], 2).astype(np.float64)  # (out, blocks, 32)
    else:
        w = rows[:, :, 2:].view(np.int8).astype(np.float64)
    qx = q.reshape(n, inp // 32, 32).astype(np.float64)
    isum = np.einsum("obk,nbk->nob", w, qx)  # (n, out, blocks)
    y = (isum * d[None] * dx.reshape(n, 1, -1)).sum(2)
    if product.q4:
        y += (m[None] * sx.reshape(n, 1, -1).astype(np.float64)).sum(2)
    return y


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", default="1,2,4,8,12", help="row counts (new tokens), each 1..16")
    parser.add_argument("--rounds", type=int, default=7, help="interleaved rounds, 1..50 (default 7)")
    parser.add_argument("--threads", type=int, default=2, help="threads, 1..64 (default 2)")
    args = parser.parse_args()
    rows = [int(r) for r in args.rows.split(",")]
    if not rows or min(rows) < 1 or max(rows) > 16 or not 1 <= args.rounds <= 50 or not 1 <= args.threads <= 64:
        parser.error("--rows in 1..16, --rounds in 1..50, --threads in 1..64")
    kernel = native.kernel()
    if kernel is None or not kernel.gguf:
        parser.error("the float kernel with GGUF blocks is not built here (a C compiler and AVX2 are needed)")
    folder = Path(tempfile.mkdtemp(prefix="int8-"))
    builds = {name: build(folder, march) for name, march in ARCHES.items()}
    library = builds["native"]
    rng = np.random.default_rng(0)
    products = [Product(library, kernel, random_blocks(rng, out, inp, True), out, inp, True)
                for _ in range(LAYERS) for out, inp in LAYER]
    products.append(Product(library, kernel, random_blocks(rng, VOCAB, HIDDEN, False), VOCAB, HIDDEN, False))
    weight_bytes = sum(p.panels.nbytes for p in products)

    # the same bits on every build, and the error against exact arithmetic on the same quantised inputs
    for q4, product in ((True, products[4]), (False, products[-1])):
        x = rng.standard_normal((3, product.inp)).astype(np.float32)
        outs = {}
        for name, lib in builds.items():
            y = np.empty((3, product.out), np.float32)
            product.int8(lib, x, y, args.threads)
            outs[name] = y
        same = all(np.array_equal(outs["native"].view(np.uint32), y.view(np.uint32)) for y in outs.values())
        exact = reference(product, library, x)
        error = np.abs(outs["native"] - exact).max() / np.abs(exact).max()
        print(f"{'Q4_1' if q4 else 'Q8_0'} {product.out}x{product.inp}: same bits on {', '.join(builds)}: "
              f"{'yes' if same else 'NO'}; largest error over the largest output {error:.1e}")

    buffer = np.ones(512 * 2**20, np.uint8)
    read = library.int8_read_seconds(P(ptr(buffer)), buffer.nbytes, args.threads, 5)
    bandwidth = buffer.nbytes / read
    bound = weight_bytes / bandwidth
    del buffer
    print(f"weights {weight_bytes / 1e6:.1f} MB; read bandwidth {bandwidth / 1e9:.1f} GB/s on {args.threads} "
          f"threads: the memory bound of one forward's products {1e3 * bound:.2f} ms")

    times: dict[tuple[str, int], list[float]] = {}
    inputs = {n: {inp: rng.standard_normal((n, inp)).astype(np.float32) for inp in (HIDDEN, INTER)} for n in rows}
    outputs = {n: {p.out: np.empty((n, p.out), np.float32) for p in products} for n in rows}
    for _ in range(args.rounds):
        for n in rows:
            for path in ("float", "int8"):
                start = time.perf_counter()
                for p in products:
                    x, y = inputs[n][p.inp], outputs[n][p.out]
                    if path == "int8":
                        p.int8(library, x, y, args.threads)
                    else:
                        p.floats_gemm(kernel, x, y, args.threads)
                times.setdefault((path, n), []).append(time.perf_counter() - start)
    print(f"\nrows | float kernel ms | int8 ms | float / bound | int8 / bound | float over 1 row | int8 over 1 row "
          f"(medians of {args.rounds} rounds)")
    one = {path: statistics.median(times[path, rows[0]]) for path in ("float", "int8")}
    for n in rows:
        f, i = statistics.median(times["float", n]), statistics.median(times["int8", n])
        print(f"{n} | {1e3 * f:.2f} | {1e3 * i:.2f} | {f / bound:.2f} | {i / bound:.2f} | {f / one['float']:.2f} | "
              f"{i / one['int8']:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
