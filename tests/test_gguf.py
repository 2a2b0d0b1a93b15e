"""GGUF weights read as the file stores them: the kernel's Q8_0 and Q4_1 panels sum each block apart, against float32
activations (the bits of a reference of that arithmetic, the same on the AVX2 build, nearer the exact product than the
float32 panels of gguf's dequantisation) or in integers against 8-bit activations (the bits of a correctly rounded
reference, the same on every build: AVX-512 VNNI, AVX-512BW, AVX-VNNI, AVX2 and plain C); the embedded model reads its
blocks in integers by default, every algorithm reproducing its plain decoding, within a bound of float32's quality;
and every way of asking for blocks that cannot work says why in one line."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize

from playground.__main__ import main
from playground.config import ConfigError, EngineParams, GenerationParams, ModelSpec, SamplingParams
from playground.decoding.costs import machine_key
from playground.decoding.registry import build_proposer
from playground.decoding.tree import ancestor_mask
from playground.engine import Engine, generate
from playground.kv import ContiguousKVCache
from playground.models import ModelLoadError, load_model, native
from playground.models.gguf import BLOCKS_FILE, BlocksError, save_blocks, unread
from playground.models.loader import load_weights, read_hf_config
from playground.models.vocab import output_rows

from .prompts import PROMPTS
from .test_native import forwards

SIZES = {"Q8_0": 34, "Q4_1": 20, "Q4_0": 18, "Q5_0": 22, "Q5_1": 24}
MINIMUMS = ("Q4_1", "Q5_1")  # formats of 32 weights whose blocks carry a minimum
OFFSETS = {"Q4_0": 8, "Q5_0": 16}  # formats read as q - offset
K_QUANTS = ("Q4_K", "Q5_K", "Q6_K")


@pytest.fixture(scope="module")
def kernel() -> native.Kernel:
    built = native.kernel()
    if built is None or not built.gguf:
        pytest.skip(f"no GGUF panels in this build (native kernel {native.status()})")
    return built


@pytest.fixture(scope="module")
def float32(target):
    """The embedded model on its dequantised float32 weights."""
    return load_model(ModelSpec(device="cpu", dtype="float32", weights="float32"))


@pytest.fixture(scope="module")
def float_blocks(target):
    """The embedded model's blocks against float32 activations."""
    return load_model(ModelSpec(device="cpu", dtype="float32", weights="gguf"))


def random_blocks(kind: str, out: int, in_features: int, seed: int) -> torch.Tensor:
    """(out, in / 32 * block bytes) uint8: scales over float16's range (zero, subnormal, large; either sign),
    minimums likewise, every quant value."""
    g = torch.Generator().manual_seed(seed)
    count = out * in_features // 32
    scales = torch.randn(count, generator=g) * torch.logspace(-7, 1, count)[torch.randperm(count, generator=g)]
    scales[::17] = 0.0
    scales[5::23] = 2.0 ** -20  # subnormal in float16
    halves = [scales.half().view(torch.uint8).view(count, 2)]
    if kind in MINIMUMS:
        halves.append((torch.randn(count, generator=g) * 0.3).half().view(torch.uint8).view(count, 2))
    quants = torch.randint(0, 256, (count, SIZES[kind] - 2 * len(halves)), generator=g, dtype=torch.uint8)
    return torch.cat([*halves, quants], 1).reshape(out, -1)


def dequantised(blocks: torch.Tensor, kind: str, in_features: int) -> torch.Tensor:
    values = dequantize(blocks.numpy(), GGMLQuantizationType[kind])
    return torch.from_numpy(np.ascontiguousarray(values.reshape(blocks.shape[0], in_features)))


def fma32(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
    """a * b + c rounded once to float32 (a * b is exact in float64 for the operands below: at most 24 + 11 bits)."""
    return (a.double() * b.double() + c.double()).float()


def factored(x: torch.Tensor, blocks: torch.Tensor, kind: str, in_features: int) -> torch.Tensor:
    """x (n, in) @ the blocks' weight^T as kernels.c sums it: per block, the sum of q * x in input order, then
    total = d * sum + total, and for Q4_1 total = m * (the block's sum of x) + total, each rounded once. (n, out)"""
    out, count = blocks.shape[0], in_features // 32
    raw = blocks.reshape(out, count, SIZES[kind])  # (out, blocks, bytes)
    d = raw[..., :2].contiguous().view(torch.float16).squeeze(-1).float()  # (out, blocks)
    if kind == "Q8_0":
        q = raw[..., 2:].contiguous().view(torch.int8).float()  # (out, blocks, 32)
    else:
        m = raw[..., 2:4].contiguous().view(torch.float16).squeeze(-1).float()
        nibbles = raw[..., 4:]  # (out, blocks, 16)
        q = torch.cat([nibbles & 15, nibbles >> 4], -1).float()
        runs = x.reshape(len(x), count, 4, 8)  # (n, blocks, 4, 8)
        lanes = ((runs[:, :, 0] + runs[:, :, 1]) + runs[:, :, 2]) + runs[:, :, 3]  # (n, blocks, 8)
        pairs = lanes[..., 0::2] + lanes[..., 1::2]  # (n, blocks, 4)
        sums = (pairs[..., 0] + pairs[..., 1]) + (pairs[..., 2] + pairs[..., 3])  # (n, blocks)
    total = torch.zeros(len(x), out)
    for b in range(count):
        acc = torch.zeros(len(x), out)
        for k in range(32):
            acc = fma32(x[:, b * 32 + k, None], q[None, :, b, k], acc)
        total = fma32(acc, d[None, :, b], total)
        if kind == "Q4_1":
            total = fma32(sums[:, b, None], m[None, :, b], total)
    return total


def fma_once(a: np.ndarray, b: np.ndarray, c: np.ndarray) -> np.ndarray:
    """a * b + c for float32 arrays, rounded once to float32 (a * b is exact in float64; the sum's error, found
    exactly by TwoSum, settles a float64 result that lies on a float32 tie)."""
    a, b, c = (np.asarray(v, np.float32).astype(np.float64) for v in (a, b, c))
    p = a * b
    s = p + c
    bb = s - p
    e = (p - (s - bb)) + (c - bb)  # p + c - s, exactly
    r = s.astype(np.float32).astype(np.float64)
    neighbour = np.nextafter(s.astype(np.float32), np.where(s > r, np.inf, -np.inf).astype(np.float32))
    tie = (s == (r + neighbour.astype(np.float64)) / 2) & (e != 0)
    return np.where(tie, np.nextafter(s, np.where(e > 0, np.inf, -np.inf)), s).astype(np.float32)


def quantised_rows(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """x (n, in) float32 as kernels.c's `quantise_rows` gives it: quants (n, in / 32, 32) int64 and scales (n, in / 32)
    float32, per block d = max |x| / 127 and q = round-half-even(x * (1 / d))."""
    runs = x.reshape(len(x), -1, 32).astype(np.float32)
    scale = (np.abs(runs).max(-1) / np.float32(127)).astype(np.float32)
    inverse = np.where(scale != 0, np.float32(1) / np.where(scale != 0, scale, np.float32(1)), 0).astype(np.float32)
    return np.rint((runs * inverse[..., None]).astype(np.float32)).astype(np.int64), scale


def block_parts(blocks: torch.Tensor, kind: str, in_features: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """A matrix of blocks of 32 decoded from the format's definition: quants q (out, blocks, 32) int64, Q4_0's and
    Q5_0's offset (8, 16) taken off, scales d and minimums m (out, blocks) float32 (m read for Q4_1 and Q5_1), so
    that w = d * q (+ m)."""
    out, count = blocks.shape[0], in_features // 32
    raw = blocks.numpy().reshape(out, count, SIZES[kind])  # (out, blocks, bytes)
    d = raw[..., :2].copy().view(np.float16)[..., 0].astype(np.float32)  # (out, blocks)
    m = raw[..., 2:4].copy().view(np.float16)[..., 0].astype(np.float32)  # (out, blocks): Q4_1 and Q5_1's
    if kind == "Q8_0":
        return raw[..., 2:].view(np.int8).astype(np.int64), d, m  # (out, blocks, 32)
    nibbles = raw[..., -16:]  # (out, blocks, 16)
    q = np.concatenate([nibbles & 15, nibbles >> 4], -1).astype(np.int64)
    if kind in ("Q5_0", "Q5_1"):  # the fifth bits: bit k of the 4 bytes before the nibbles
        fifth = raw[..., -20:-16].copy().view("<u4")  # (out, blocks, 1)
        q |= ((fifth >> np.arange(32, dtype=np.uint32)) & 1).astype(np.int64) << 4
    return q - OFFSETS.get(kind, 0), d, m


def integer_reference(x: torch.Tensor, blocks: torch.Tensor, kind: str, in_features: int) -> torch.Tensor:
    """x (n, in) @ the blocks' weight^T as the integer products compute it: x quantised per block, each block's
    integer sum of (q - offset) * q_x exact (Q4_0's offset 8, Q5_0's 16), then total = fma(float(sum) * d, d_x,
    total), for Q4_1 and Q5_1 with fma(m, the block's sum of q_x, float(sum) * d) in place of float(sum) * d, from
    total = 0 block by block. (n, out)"""
    q, d, m = block_parts(blocks, kind, in_features)
    xq, xd = quantised_rows(x.numpy())
    total = np.zeros((len(x), blocks.shape[0]), np.float32)
    for b in range(in_features // 32):
        exact = np.einsum("nk,ok->no", xq[:, b], q[:, b])  # (n, out) int64
        block = (exact.astype(np.float32) * d[None, :, b]).astype(np.float32)  # (n, out)
        if kind in MINIMUMS:
            block = fma_once(m[None, :, b], xq[:, b].sum(-1).astype(np.float32)[:, None], block)
        total = fma_once(block, xd[:, b, None], total)
    return torch.from_numpy(total)


def random_k_blocks(kind: str, out: int, in_features: int, seed: int) -> torch.Tensor:
    """(out, in / 256 * super-block bytes) uint8 of a K-quant format: every scale, minimum and quant byte random (any
    byte is a valid one), the float16 factors over a wide range, zero and subnormal included."""
    g = torch.Generator().manual_seed(seed)
    count = out * in_features // 256
    raw = torch.randint(0, 256, (count, native.BLOCKS[kind][1]), generator=g, dtype=torch.uint8)
    spread = torch.logspace(-7, 0, count)[torch.randperm(count, generator=g), None]  # (count, 1)
    factors = torch.randn(count, 2, generator=g) * spread  # (count, 2): d, dmin
    factors[::13] = 0.0
    factors[4::19, 0] = 2.0 ** -20  # subnormal in float16
    halves = factors.half().view(torch.uint8).view(count, 4)
    if kind == "Q6_K":
        raw[:, 208:] = halves[:, :2]  # d, at the end
    else:
        raw[:, :4] = halves
    return raw.reshape(out, -1)


def k_parts(blocks: torch.Tensor, kind: str, in_features: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """A K-quant matrix per block of 32 inputs, decoded from the format's definition: quants q (out, blocks, 32)
    int64, scales (out, blocks, 2) float32 (one for each 16 inputs: Q4_K's and Q5_K's twice the same), minimums
    (out, blocks) float32 (Q6_K: zero, its offset apart), so that w = scale * q + minimum (Q6_K: scale * (q - 32))."""
    raw = blocks.numpy().reshape(blocks.shape[0], in_features // 256, native.BLOCKS[kind][1])  # (out, supers, bytes)
    out, supers = raw.shape[:2]
    if kind == "Q6_K":
        d = raw[..., 208:210].copy().view(np.float16)[..., 0].astype(np.float32)  # (out, supers)
        sc = raw[..., 192:208].copy().view(np.int8).astype(np.float32)  # (out, supers, 16)
        w = np.arange(256)
        h, u = w // 128, w % 128
        low = raw[..., 64 * h + u % 64]  # (out, supers, 256)
        nibble = np.where(u < 64, low & 15, low >> 4)
        top = (raw[..., 128 + 32 * h + u % 32] >> (2 * (u // 32))) & 3
        q = (nibble | top << 4).astype(np.int64).reshape(out, supers * 8, 32)
        scales = (d[..., None] * sc).reshape(out, supers * 8, 2)
        return q, scales, np.zeros((out, supers * 8), np.float32)
    d, dmin = (raw[..., i:i + 2].copy().view(np.float16)[..., 0].astype(np.float32) for i in (0, 2))
    s = raw[..., 4:16].astype(np.int64)  # (out, supers, 12)
    sc = np.concatenate([s[..., :4] & 63, (s[..., 8:] & 15) | (s[..., :4] >> 6) << 4], -1)  # (out, supers, 8)
    m = np.concatenate([s[..., 4:8] & 63, (s[..., 8:] >> 4) | (s[..., 4:8] >> 6) << 4], -1)
    qs = raw[..., 16:144] if kind == "Q4_K" else raw[..., 48:176]  # (out, supers, 128)
    pairs = qs.reshape(out, supers, 4, 32)  # blocks 2j and 2j + 1 share 32 bytes
    q = np.stack([pairs & 15, pairs >> 4], 3).reshape(out, supers, 8, 32).astype(np.int64)
    if kind == "Q5_K":
        q |= ((raw[..., None, 16:48] >> np.arange(8)[:, None]) & 1).astype(np.int64) << 4
    scales = (d[..., None] * sc.astype(np.float32)).reshape(out, supers * 8)
    return (q.reshape(out, supers * 8, 32), np.repeat(scales[..., None], 2, -1),
            -(dmin[..., None] * m.astype(np.float32)).reshape(out, supers * 8))


def k_integer_reference(x: torch.Tensor, blocks: torch.Tensor, kind: str, in_features: int) -> torch.Tensor:
    """x (n, in) @ a K-quant weight^T as the integer products compute it: x quantised per block of 32; Q4_K and Q5_K
    folded per block as Q4_1 with scale d * sc and minimum -(dmin * m); Q6_K per 16 inputs as Q8_0, the integer sum
    of q * q_x - 32 * (sum of q_x) times d * sc, under the block's d_x. (n, out)"""
    q, scales, mins = k_parts(blocks, kind, in_features)
    xq, xd = quantised_rows(x.numpy())
    total = np.zeros((len(x), blocks.shape[0]), np.float32)
    for b in range(in_features // 32):
        if kind == "Q6_K":
            for h in (slice(0, 16), slice(16, 32)):
                exact = np.einsum("nk,ok->no", xq[:, b, h], q[:, b, h]) - 32 * xq[:, b, h].sum(-1)[:, None]
                part = (exact.astype(np.float32) * scales[None, :, b, h.start // 16]).astype(np.float32)
                total = fma_once(part, xd[:, b, None], total)
            continue
        exact = np.einsum("nk,ok->no", xq[:, b], q[:, b])  # (n, out) int64
        block = (exact.astype(np.float32) * scales[None, :, b, 0]).astype(np.float32)
        block = fma_once(mins[None, :, b], xq[:, b].sum(-1).astype(np.float32)[:, None], block)
        total = fma_once(block, xd[:, b, None], total)
    return torch.from_numpy(total)


def every_row_count_gives(kernel: native.Kernel, x: torch.Tensor, panels: native.Panels, want: torch.Tensor,
                          threads: int) -> None:
    """On `threads` threads, the products of the first 1, 2, 3, 4, 5, 7, a pass's, a pass's + 1 and all rows of x
    are exactly those rows of `want`."""
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for rows in (1, 2, 3, 4, 5, 7, kernel.rows_per_pass, kernel.rows_per_pass + 1, len(x)):
            assert torch.equal(native.panel_linear(x[:rows], panels), want[:rows]), rows
    finally:
        torch.set_num_threads(previous)


@pytest.mark.parametrize("kind", ["Q8_0", "Q4_1", "Q4_0", "Q5_0", "Q5_1"])
@pytest.mark.parametrize("shape", [(576, 576), (100, 1536), (49, 64), (7, 32)], ids=str)
@pytest.mark.parametrize("threads", [1, 2, 3])
def test_integer_products_give_the_bits_of_their_arithmetic(kernel, kind, shape, threads):
    """Every row count, output size and thread split: the bits of the correctly rounded reference, a row's alone;
    a block of zeros and inputs far apart in size included."""
    out, in_features = shape
    blocks = random_blocks(kind, out, in_features, seed=out + threads)
    panels = native.pack_blocks(blocks, kind, in_features, kernel, integer=True)
    assert panels.format == native.INTEGER_FORMATS[kind]
    g = torch.Generator().manual_seed(threads)
    x = torch.randn(2 * kernel.rows_per_pass + 3, in_features, generator=g) * torch.logspace(-3, 2, in_features)
    x[1, :32] = 0.0
    want = integer_reference(x, blocks, kind, in_features)
    every_row_count_gives(kernel, x, panels, want, threads)


@pytest.mark.parametrize("kind", ["Q8_0", "Q4_1"])
def test_activations_round_halves_to_even(kernel, kind):
    """Activations that fall exactly halfway between two quants (a block whose largest |x| is 127, so d = 1) round
    to the even one, as nearbyintf does, in every lane of the vectors that quantise them; a block of zeros and one
    whose largest value is negative alike: the products give the reference's bits."""
    halves = torch.arange(-15.5, 16.0, 1.0)  # (32,) every half from -15.5 to 15.5
    x = torch.stack([halves, -halves, torch.zeros(32), halves * 3]).repeat(1, 2)  # (4, 64)
    x[0, 7], x[1, 40], x[3, 63] = 127.0, -127.0, -127.0 * 3
    blocks = random_blocks(kind, 48, 64, seed=5)
    panels = native.pack_blocks(blocks, kind, 64, kernel, integer=True)
    assert torch.equal(native.panel_linear(x, panels), integer_reference(x, blocks, kind, 64))

@pytest.mark.parametrize("kind", ["Q4_0", "Q5_0", "Q5_1", "Q4_K", "Q5_K", "Q6_K"])
def test_the_references_read_the_formats_as_gguf_does(kind):
    """The references' reading of each format (d * q + m per block of 32, the K-quants' scale * q + minimum) is
    gguf's dequantised weight, random bytes throughout: the references the products are held to read the formats as
    llama.cpp does."""
    if kind not in K_QUANTS:
        blocks = random_blocks(kind, 5, 512, seed=3)
        q, d, m = block_parts(blocks, kind, 512)
        ours = d[..., None].astype(np.float64) * q + (m[..., None] if kind in MINIMUMS else 0)
        theirs = dequantize(blocks.numpy(), GGMLQuantizationType[kind]).reshape(ours.shape).astype(np.float64)
        assert np.allclose(ours, theirs, rtol=1e-6, atol=0)
        return
    blocks = random_k_blocks(kind, 5, 512, seed=3)
    q, scales, mins = k_parts(blocks, kind, 512)
    if kind == "Q6_K":
        ours = np.repeat(scales.astype(np.float64), 16, -1) * (q - 32)  # (out, blocks, 32)
    else:
        ours = scales[..., :1].astype(np.float64) * q + mins[..., None]
    theirs = dequantize(blocks.numpy(), GGMLQuantizationType[kind]).reshape(ours.shape).astype(np.float64)
    assert np.allclose(ours, theirs, rtol=1e-6, atol=0)


@pytest.mark.parametrize("kind", ["Q4_K", "Q5_K", "Q6_K"])
@pytest.mark.parametrize("shape", [(100, 1536), (49, 256), (7, 512)], ids=str)
@pytest.mark.parametrize("threads", [1, 2, 3])
def test_k_quant_products_give_the_bits_of_their_arithmetic(kernel, kind, shape, threads):
    """The K-quants read at their bytes: every row count, output size and thread split gives the bits of the
    correctly rounded reference, a row's alone; a block of zeros and inputs far apart in size included."""
    out, in_features = shape
    blocks = random_k_blocks(kind, out, in_features, seed=out + threads)
    panels = native.pack_blocks(blocks, kind, in_features, kernel, integer=True)
    assert panels.format == native.INTEGER_FORMATS[kind]
    bits = {"Q4_K": 4.625, "Q5_K": 5.625, "Q6_K": 6.5625}[kind]  # a weight's bits in the panels
    assert panels.nbytes == -(-out // kernel.panel_width) * kernel.panel_width * in_features * bits / 8
    g = torch.Generator().manual_seed(threads)
    x = torch.randn(2 * kernel.rows_per_pass + 3, in_features, generator=g) * torch.logspace(-3, 2, in_features)
    x[1, :32] = 0.0
    want = k_integer_reference(x, blocks, kind, in_features)
    every_row_count_gives(kernel, x, panels, want, threads)


@pytest.mark.parametrize("threads", [1, 2])
def test_a_product_of_parts_in_different_formats_gives_each_parts_own_bits(kernel, threads):
    """q, k and v (or gate and up) stored in different formats run as one product of parts: each part's columns are
    its own product's bits, for every row count; parts of one format are packed as one."""
    kinds = [("Q4_K", 70), ("Q6_K", 33), ("Q8_0", 64)]
    parts = [((random_k_blocks if kind in K_QUANTS else random_blocks)(kind, out, 512, seed=out), kind)
             for kind, out in kinds]
    product = native.pack_parts([(kind, blocks) for blocks, kind in parts], 512, kernel, integer=True)
    alone = [native.pack_blocks(blocks, kind, 512, kernel, integer=True) for blocks, kind in parts]
    assert product.format == native.PARTS and product.out == 167 and product.pieces == tuple(product.parts)
    assert product.nbytes == sum(p.nbytes for p in alone)
    x = torch.randn(kernel.rows_per_pass + 2, 512, generator=torch.Generator().manual_seed(threads))
    want = torch.cat([native.panel_linear(x, p) for p in alone], 1)  # (n, 167)
    every_row_count_gives(kernel, x, product, want, threads)
    same = native.pack_parts([("Q8_0", parts[2][0]), ("Q8_0", parts[2][0])], 512, kernel, integer=True)
    assert same.format == native.INTEGER_FORMATS["Q8_0"] and same.out == 128


def test_k_quant_blocks_run_in_integer_products_only(kernel):
    blocks = random_k_blocks("Q4_K", 4, 256, seed=0)
    with pytest.raises(ValueError, match="^Q4_K blocks run only in integer products on 8-bit activations$"):
        native.pack_blocks(blocks, "Q4_K", 256, kernel)
    with pytest.raises(ValueError, match=r"^Q4_K blocks for 512 inputs need 288 bytes a row, got \(4, 144\)$"):
        native.pack_blocks(blocks, "Q4_K", 512, kernel, integer=True)


@pytest.mark.parametrize("kind", ["Q8_0", "Q4_1"])
@pytest.mark.parametrize("shape", [(576, 576), (100, 1536), (49, 64), (7, 32)], ids=str)
@pytest.mark.parametrize("threads", [1, 2, 3])
def test_block_panels_sum_each_block_apart(kernel, kind, shape, threads):
    """Every row count (one pass of several panels, several passes, a remainder), every output size (a padded
    last panel), every thread split: the bits of the factored reference, a row's alone whatever shares its call."""
    out, in_features = shape
    blocks = random_blocks(kind, out, in_features, seed=out + threads)
    panels = native.pack_blocks(blocks, kind, in_features, kernel)
    assert panels.nbytes == -(-out // kernel.panel_width) * kernel.panel_width * in_features // 32 * SIZES[kind]
    x = torch.randn(2 * kernel.rows_per_pass + 3, in_features, generator=torch.Generator().manual_seed(threads))
    want = factored(x, blocks, kind, in_features)
    every_row_count_gives(kernel, x, panels, want, threads)


@pytest.mark.parametrize("kind", ["Q8_0", "Q4_1"])
def test_block_sums_round_less_than_the_float32_panels(kernel, kind):
    """Against the exact product (float64) of gguf's dequantised weight, the blocks' products err less than the
    float32 panels of that weight."""
    blocks = random_blocks(kind, 576, 1536, seed=3)
    weight = dequantised(blocks, kind, 1536)  # (576, 1536)
    x = torch.randn(8, 1536, generator=torch.Generator().manual_seed(0))
    exact = x.double() @ weight.double().T  # (8, 576)
    on_blocks = native.panel_linear(x, native.pack_blocks(blocks, kind, 1536, kernel)).double() - exact
    on_float32 = native.panel_linear(x, native.pack_panels(weight, kernel, narrow=False)).double() - exact
    assert on_blocks.abs().mean() < 0.75 * on_float32.abs().mean()


def test_pack_blocks_refuses_rows_of_the_wrong_size(kernel):
    with pytest.raises(ValueError, match="Q4_1 blocks for 64 inputs need 40 bytes a row"):
        native.pack_blocks(torch.zeros(4, 34, dtype=torch.uint8), "Q4_1", 64, kernel)
    with pytest.raises(ValueError, match="need"):
        native.pack_blocks(torch.zeros(4, 34, dtype=torch.uint8), "Q8_0", 48, kernel)


def test_the_embedded_model_reads_its_blocks(kernel, target, float_blocks, float32):
    """By default (weights auto) every product of the embedded model reads the file's blocks in integers, about
    96 MB instead of 538; either way of reading them gives the same bits with the stack in one call and layer by
    layer; the float-activation blocks give the float32 model's logits to within a thousandth of their spread."""
    assert (target.weights, float_blocks.weights, float32.weights) == ("gguf-int8", "gguf", "float32")
    assert target.model.formats_read().startswith("Q4_1 and Q8_0 blocks, 8-bit activations (")
    assert float_blocks.model.formats_read().startswith("Q4_1 and Q8_0 blocks, float32 activations (")
    for loaded, formats in ((target, native.INTEGER_FORMATS), (float_blocks, native.GGUF_FORMATS)):
        assert loaded.model.packed_output.format == formats["Q8_0"]
        assert set(loaded.model.native_stack.formats) == {formats["Q4_1"]}
    read = sum(p.nbytes for _, p in target.model.packed_products())
    assert 90e6 < read < 100e6 and sum(p.nbytes for _, p in float32.model.packed_products()) > 5 * read
    keys = {machine_key(m.model) for m in (target, float_blocks, float32)}
    assert len(keys) == 3  # each way of reading has its own cost curve
    cfg = target.model.config
    tree = ancestor_mask([-1, 0, 0, 2])  # (4, 4)
    steps = [((0,), 9, None, {}), ((0,), 1, None, {}), ((0,), 4, tree, {}), ((0,), 1, None, {0: 11})]
    runs = [forwards(model.model, stack, ContiguousKVCache(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, 32), steps)
            for model, stack in ((target, True), (target, False), (float_blocks, True), (float_blocks, False),
                                 (float32, True))]
    for got, layer_by_layer, on_float, on_float_layers, float32_got in zip(*runs):
        assert torch.equal(got, layer_by_layer) and torch.equal(on_float, on_float_layers)
        assert (on_float - float32_got).abs().max() <= 1e-3 * float32_got.std()


def test_the_integer_products_stay_near_float32_on_held_out_text(target, float32):
    """Teacher-forced on held-out text (the bench's quality suite, 3 windows): the 8-bit activations keep the
    next-token distribution near float32's (KL divergence, top-1 agreement, perplexity; the full suite's figures
    are in docs/results.md)."""
    from playground.bench.quality import held_out_text, measure_quality, window_logits, windows

    chosen = windows(float32.tokenizer, held_out_text(), 1000)[:3]
    rows = measure_quality(lambda ids: window_logits(float32.model, ids),
                           {"int8": lambda ids: window_logits(target.model, ids)}, chosen, lambda line: None)
    reference, integer = rows
    assert integer["positions"] >= 1000 and reference["kl"] == 0 and reference["top1"] == 1
    assert integer["kl"] < 0.008 and integer["top1"] > 0.93
    assert integer["perplexity"] < 1.02 * reference["perplexity"]


def test_some_output_rows_are_packed_from_the_blocks(kernel, target, float_blocks, float32):
    """A proposer's reduced output rows (the EAGLE head's, the Medusa heads') read the projection's Q8_0 blocks in
    the model's own arithmetic: about a quarter of float32's bytes, the bits of the whole projection's logits at
    those ids."""
    ids = torch.tensor([0, 2, 7, 100, 4000, 31000, 49151])
    hidden = torch.randn(3, target.model.config.hidden_size, generator=torch.Generator().manual_seed(0))  # (3, E)
    wide = output_rows(float32.model, ids)
    for loaded, code in ((target, native.INTEGER_FORMATS["Q8_0"]), (float_blocks, native.GGUF_FORMATS["Q8_0"])):
        rows = output_rows(loaded.model, ids)
        assert rows.packed.format == code and rows.packed.nbytes < wide.packed.nbytes / 3
        assert torch.equal(rows.logits(hidden), native.panel_linear(hidden, loaded.model.packed_output)[:, ids])


def test_a_proposer_is_priced_by_the_bytes_its_forward_reads(kernel, target, float32):
    """Before measuring, a draft's forward is priced at the bytes it reads over the target's: the blocks model as its
    own draft costs one forward; the float32 model, with as many weights, reads more than five times its bytes."""
    assert build_proposer(target, "speculative", draft=target).estimate_cost() == pytest.approx(1)
    assert build_proposer(target, "speculative", draft=float32).estimate_cost() > 5
    assert build_proposer(float32, "speculative", draft=target).estimate_cost() < 1 / 5


def test_plain_decoding_on_float_activation_blocks_equals_float32(kernel, float_blocks, float32):
    """The float-activation blocks' logits differ from float32's in their last bits: not enough to change a greedy
    token here. (The 8-bit activations change more: their quality is measured, not assumed, above.)"""
    generation = GenerationParams(max_new_tokens=24)
    for prompt in PROMPTS[:8]:
        runs = [generate(m, prompt, None, SamplingParams(), generation)[0].token_ids for m in (float_blocks, float32)]
        assert runs[0] == runs[1], prompt


@pytest.mark.parametrize("algo", ["speculative", "prompt-lookup", "lookahead", "medusa", "eagle"])
def test_every_algorithm_on_blocks_emits_plain_decoding(kernel, target, plain_outputs, algo):
    """Each proposer on the integer products (either cache) reproduces plain decoding on them."""
    generation = {kv: GenerationParams(max_new_tokens=24, kv=kv) for kv in ("contiguous", "paged")}
    proposer = build_proposer(target, algo)
    for i, prompt in enumerate(PROMPTS[:6]):
        out = generate(target, prompt, proposer, SamplingParams(), generation[("contiguous", "paged")[i % 2]])[0]
        assert out.token_ids == plain_outputs[prompt], prompt


def test_the_blocks_are_kept_beside_the_converted_weights(target):
    """Written once into the cached folder, then read from there by every later load."""
    from playground.models.gguf import census_of

    kept = target.folder / BLOCKS_FILE
    written = kept.stat().st_mtime_ns
    assert load_model(ModelSpec(device="cpu", weights="gguf")).weights == "gguf"
    assert kept.stat().st_mtime_ns == written
    assert census_of(target.folder) == {"Q4_1": 210, "Q8_0": 1}  # with the file's matrices by format


def test_blocks_that_are_not_the_weights_are_refused(target, tmp_path):
    from playground.models.loader import embedded_gguf

    tensors = load_weights(target.folder)
    tensors["model.layers.3.mlp.down_proj.weight"] = tensors["model.layers.3.mlp.down_proj.weight"] * 2
    with pytest.raises(BlocksError, match="blk.3.ffn_down.weight .* do not dequantise to "
                                          "model.layers.3.mlp.down_proj.weight"):
        save_blocks(embedded_gguf(), tmp_path, tensors, read_hf_config(target.folder))


@pytest.mark.parametrize("spec, message", [
    ({"weights": "gguf", "dtype": "bfloat16"}, "weights: gguf needs the CPU (--device cpu), dtype float32"),
    ({"weights": "gguf-int8", "quant": "int8"}, "weights: gguf-int8 needs the CPU"),
    ({"weights": "gguf", "source": "DRAFT"}, "weights: gguf needs a GGUF source (the embedded model or a .gguf file)"),
])
def test_asking_for_blocks_that_cannot_run_is_one_line(target, spec, message):
    from playground.models.loader import default_draft

    if spec.get("source") == "DRAFT":
        spec = {**spec, "source": default_draft("embedded")}
    with pytest.raises(ModelLoadError, match=message.replace("(", r"\(").replace(")", r"\)")):
        load_model(ModelSpec(device="cpu", **spec))


def test_without_the_kernel_auto_reads_float32_and_gguf_says_why(target, monkeypatch):
    monkeypatch.setattr(native, "kernel", lambda: None)
    assert load_model(ModelSpec(device="cpu")).weights == "float32"
    with pytest.raises(ModelLoadError, match="weights: gguf-int8 needs the native kernel"):
        load_model(ModelSpec(device="cpu", weights="gguf-int8"))
    with pytest.raises(ModelLoadError, match="weights: gguf needs the native kernel"):
        load_model(ModelSpec(device="cpu", weights="gguf"))
    with pytest.raises(ConfigError, match="weights must be one of"):
        ModelSpec(weights="q4")


def test_the_avx2_build_gives_the_same_bits(kernel, tmp_path):
    """The AVX2 path (8-wide vectors, 16-output panels) on a CPU that runs it, built for Haswell beside this
    machine's own build: its block panels give this build's bits."""
    import shutil
    import subprocess
    from pathlib import Path

    flags = Path("/proc/cpuinfo").read_text().split()
    if not {"avx2", "fma", "f16c"} <= set(flags) or shutil.which("cc") is None:
        pytest.skip("this CPU does not run AVX2 with FMA and F16C, or there is no C compiler")
    library = tmp_path / "kernels-avx2.so"
    build_flags = [f if f != "-march=native" else "-march=haswell" for f in native.FLAGS]
    subprocess.run(["cc", *build_flags, str(native.SOURCE), "-o", str(library)], check=True, timeout=300)
    avx2 = native.load(library)
    assert (avx2.vector_width, avx2.panel_width, avx2.gguf) == (8, 16, True)
    for kind in ("Q8_0", "Q4_1"):
        for out, in_features in ((100, 1536), (49, 64)):
            blocks = random_blocks(kind, out, in_features, seed=out)
            panels = native.pack_blocks(blocks, kind, in_features, avx2)
            own = native.pack_blocks(blocks, kind, in_features, kernel)
            for rows in (1, 2, 3, 5, 7, 13):
                x = torch.randn(rows, in_features, generator=torch.Generator().manual_seed(rows))
                assert torch.equal(native.panel_linear(x, panels), native.panel_linear(x, own)), (kind, rows)


# builds of the integer products: -march flags, the CPU flags that run them, and which instructions they use
BUILDS = [(["-march=x86-64"], set(), "plain C"), (["-march=haswell"], {"avx2", "fma", "f16c"}, "AVX2"),
          (["-march=haswell", "-mavxvnni"], {"avx2", "fma", "f16c", "avx_vnni"}, "AVX-VNNI"),
          (["-march=skylake-avx512"], {"avx512f", "avx512bw", "avx512vl"}, "AVX-512BW"),
          (["-march=icelake-server"], {"avx512f", "avx512bw", "avx512vl", "avx512_vnni", "avx512vbmi"},
           "AVX-512 VNNI")]


def test_every_build_gives_the_integer_products_the_same_bits(kernel, tmp_path):
    """Plain C, AVX2, AVX-VNNI, AVX-512BW and AVX-512 VNNI, each built beside this machine's own where this CPU runs
    it: the integer products give this build's bits (panels of 8, 16 and 32 outputs; exact integer sums, folded
    alike)."""
    import shutil
    import subprocess
    from pathlib import Path

    if shutil.which("cc") is None:
        pytest.skip("no C compiler")
    cpu = set(Path("/proc/cpuinfo").read_text().split())
    built = []
    for march, needs, name in BUILDS:
        if not needs <= cpu:
            continue
        library = tmp_path / f"kernels-{name.replace(' ', '-')}.so"
        flags = [f for f in native.FLAGS if f != "-march=native"]
        subprocess.run(["cc", *march, *flags, str(native.SOURCE), "-o", str(library)], check=True, timeout=300)
        other = native.load(library)
        assert other.dot_products == name
        built.append(other)
    assert any(k.dot_products == "plain C" for k in built)
    for kind in native.INTEGER_FORMATS:
        for out, in_features in ((100, 1536), (49, 256)):
            blocks = (random_k_blocks if kind in K_QUANTS else random_blocks)(kind, out, in_features, seed=out)
            own = native.pack_blocks(blocks, kind, in_features, kernel, integer=True)
            for rows in (1, 2, 3, 5, 7, 13):
                x = torch.randn(rows, in_features, generator=torch.Generator().manual_seed(rows))
                want = native.panel_linear(x, own)
                for other in built:
                    got = native.panel_linear(x, native.pack_blocks(blocks, kind, in_features, other, integer=True))
                    assert torch.equal(got, want), (other.dot_products, kind, rows)


def test_q4_0_and_q5_0_blocks_are_read_as_q4_1_and_q8_0_blocks_of_the_same_weights():
    from gguf.quants import quantize

    from playground.models.gguf import q4_0_as_q4_1, q5_0_as_q8_0

    x = np.random.default_rng(1).standard_normal((4, 128)).astype(np.float32)
    x[0, :32] = 0.0
    for stored, widen, read in (("Q4_0", q4_0_as_q4_1, "Q4_1"), ("Q5_0", q5_0_as_q8_0, "Q8_0")):
        blocks = quantize(x, GGMLQuantizationType[stored])
        wide = widen(blocks)
        assert wide.shape == (4, 4 * SIZES[read])
        assert np.array_equal(dequantize(blocks, GGMLQuantizationType[stored]),
                              dequantize(wide, GGMLQuantizationType[read]))


def test_a_file_of_other_block_formats_runs_what_the_kernel_reads_and_says_what_it_does_not(
        target, tmp_path, capsys):
    """The embedded model re-quantised to llama.cpp's Q4_K_M mix (its metadata copied): in integer products every
    matrix runs at its bytes (q, k and v in two formats as one product of parts); against float32 activations its
    Q5_0 ones run as Q8_0 blocks of the same weights and its K-quants as float32, each said in one line (no internal
    error, no claim of blocks it lacks). The algorithms give plain decoding's tokens on it, in batches of 1, 4 and
    20 too. A file whose matrices are all in a format a path does not read refuses it when asked for, naming what
    it stores. Bad input to the re-quantiser is one line."""
    import gguf

    from playground.models.gguf import census_of
    from playground.models.loader import embedded_gguf
    from playground.models.requantise import main as requantise_main
    from playground.models.requantise import requantise

    path = tmp_path / "q4_k_m.gguf"
    requantise(embedded_gguf(), path, "Q4_K_M")
    template = "tokenizer.chat_template"
    assert (gguf.GGUFReader(path).get_field(template).contents()
            == gguf.GGUFReader(embedded_gguf()).get_field(template).contents())
    for source, message in ((tmp_path / "none.gguf", "is not a file"), (path.parent, "is not a file"),
                            (Path(__file__), "could not be read as a GGUF file")):
        assert requantise_main([str(source), str(tmp_path / "out.gguf"), "--format", "Q8_0"]) == 2
        err = capsys.readouterr().err.strip()
        assert err.startswith("error: source: ") and message in err and len(err.splitlines()) == 1
    cache = str(tmp_path / "cache")
    mixed = load_model(ModelSpec(source=str(path), device="cpu", cache_dir=cache))
    err = capsys.readouterr().err
    assert mixed.weights == "gguf-int8" and "Error" not in err and "Q8_0/Q4_1 blocks of" not in err
    assert "does not read" not in err and "dequantised" not in err and "the same weights" not in err
    assert census_of(mixed.folder) == {"Q5_0": 166, "Q8_0": 15, "Q4_K": 16, "Q6_K": 14}
    down = {mixed.model.native_stack.formats[4 * layer + 3] for layer in range(30)}  # the MLP's down products
    assert down == {native.INTEGER_FORMATS["Q4_K"], native.INTEGER_FORMATS["Q6_K"]}
    assert mixed.model.formats_read().startswith("Q4_K, Q5_0, Q6_K and Q8_0 blocks, 8-bit activations (")
    floats = load_model(ModelSpec(source=str(path), device="cpu", cache_dir=cache, weights="gguf"))
    err = capsys.readouterr().err
    assert ("weights: the native kernel reads q4_k_m.gguf's 166 Q5_0 matrices as Q8_0 (34 bytes a block of 32 "
            "instead of 22): the same weights") in err
    assert ("weights: q4_k_m.gguf stores 16 Q4_K and 14 Q6_K matrices; with --weights gguf the native kernel reads "
            "only Q4_0, Q4_1, Q5_0 and Q8_0 (--weights auto reads more, in integer products)") in err
    assert floats.model.formats_read().startswith("Q8_0 and float32 (")
    generation = GenerationParams(max_new_tokens=12)
    prompt = "Repeat exactly: red green blue, red green blue, red green blue."
    plain = generate(mixed, prompt, None, SamplingParams(), generation)[0].token_ids
    for algo in ("prompt-lookup", "lookahead"):  # the proposers that need nothing trained for this file
        assert generate(mixed, prompt, build_proposer(mixed, algo), SamplingParams(), generation)[0].token_ids == plain
    prompts = [prompt, *PROMPTS[:7]]
    alone = {p: generate(mixed, p, None, SamplingParams(), generation)[0].token_ids for p in prompts}
    for max_running in (1, 4, 20):  # the paged cache, rows of several requests and widths in one forward
        engine = Engine(mixed, EngineParams(max_running=max_running), proposer=build_proposer(mixed, "prompt-lookup"))
        ids = {engine.add_request(p, generation=generation): p for p in prompts}
        outputs = engine.run_all()
        assert {ids[rid]: out.token_ids for rid, out in outputs.items()} == alone, max_running
    requantise(embedded_gguf(), tmp_path / "q5_1.gguf", "Q5_1")
    q5_1 = load_model(ModelSpec(source=str(tmp_path / "q5_1.gguf"), device="cpu", cache_dir=cache))
    assert q5_1.model.formats_read().startswith("Q5_1 blocks, 8-bit")
    with pytest.raises(ModelLoadError, match=r"^weights: q5_1.gguf holds no Q4_0, Q4_1, Q5_0 or Q8_0 matrix \(it "
                                             r"stores 211 Q5_1\); use --weights float32$"):
        load_model(ModelSpec(source=str(tmp_path / "q5_1.gguf"), device="cpu", cache_dir=cache, weights="gguf"))
    # the quality suite on it: the float-activation row left out, in one line, the rest measured
    report = tmp_path / "quality.json"
    assert main(["bench", "--suite", "quality", "--model", str(tmp_path / "q5_1.gguf"), "--limit", "1",
                 "--cache-dir", cache, "--json", str(report)]) == 0
    assert "holds no Q4_0, Q4_1, Q5_0 or Q8_0 matrix" in capsys.readouterr().err
    rows = json.loads(report.read_text())["quality"]["rows"]
    assert [row["weights"] for row in rows if row["weights"] != "llama.cpp"] == ["float32", "gguf-int8"]
    assert unread(Counter({"Q3_K": 5, "Q8_0": 2, "F32": 3})) == "5 Q3_K"  # a format no path reads


def test_a_file_of_every_format_runs_each_at_its_bytes_and_as_plain_decoding_does(target, tmp_path, monkeypatch):
    """The embedded model with its matrices spread over all eight formats the kernel reads, layer by layer and
    product by product (so q, k and v, and gate and up, mostly differ: products of parts), runs every matrix at its
    bytes; prompt lookup in batches of 1, 4 and 20 on the paged cache gives each request its plain decoding alone."""
    from playground.models import requantise as requantise_module
    from playground.models.gguf import census_of
    from playground.models.loader import embedded_gguf

    kinds = ["Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q4_K", "Q5_K", "Q6_K"]
    products = ["attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down"]

    def spread(name: str, columns: int, fmt: str, layers: int) -> str:
        parts = name.split(".")  # blk.N.PRODUCT.weight
        kind = kinds[(int(parts[1]) + products.index(parts[2])) % 8] if parts[0] == "blk" else "Q8_0"
        return requantise_module.FALLBACK.get(kind, kind) if columns % 256 and kind in K_QUANTS else kind

    monkeypatch.setattr(requantise_module, "chosen", spread)
    path = tmp_path / "every.gguf"
    written = requantise_module.requantise(embedded_gguf(), path, "Q8_0")
    assert set(written) == {"F32", *kinds}
    every = load_model(ModelSpec(source=str(path), device="cpu", cache_dir=str(tmp_path / "cache")))
    assert set(census_of(every.folder)) == set(kinds)  # the matrices (the norms are not)
    read = {piece.format for _, panels in every.model.packed_products() for piece in panels.pieces}
    assert read == {native.INTEGER_FORMATS[kind] for kind in kinds}  # nothing dequantised to float32
    assert native.PARTS in {panels.format for _, panels in every.model.packed_products()}
    generation = GenerationParams(max_new_tokens=12)
    prompts = PROMPTS[:8]
    alone = {p: generate(every, p, None, SamplingParams(), generation)[0].token_ids for p in prompts}
    for max_running in (1, 4, 20):
        engine = Engine(every, EngineParams(max_running=max_running), proposer=build_proposer(every, "prompt-lookup"))
        ids = {engine.add_request(p, generation=generation): p for p in prompts}
        outputs = engine.run_all()
        assert {ids[rid]: out.token_ids for rid, out in outputs.items()} == alone, max_running


@pytest.mark.parametrize("fmt, levels, block", [("Q4_K", 15, 32), ("Q5_K", 31, 32), ("Q6_K", 63, 16)])
def test_the_k_quant_blocks_are_the_formats_own(fmt, levels, block):
    """`kquants` writes blocks that gguf's dequantiser reads back within one quantisation step of every weight, at
    its own place (a block, a scale or a bit out of place would be far off), and a block of zeros as zeros."""
    from playground.models.kquants import BYTES, quantise

    rng = np.random.default_rng(0)
    x = (0.05 * rng.standard_normal((6, 512))).astype(np.float32)
    x[0, :256] += 0.03  # a super-block of positive weights: its minimum is zero
    x[1, 256:] = 0.0
    x[2, :32] *= 40  # one sub-block far wider than the rest
    blocks = quantise(x, fmt)
    assert blocks.shape == (6, 2 * BYTES[fmt]) and blocks.dtype == np.uint8
    y = dequantize(blocks, GGMLQuantizationType[fmt])  # (6, 512)
    parts = x.reshape(6, 256 // block * 2, block)  # (rows, sub-blocks, weights)
    span = parts.max(-1) - np.minimum(parts.min(-1), 0) if fmt != "Q6_K" else 2 * np.abs(parts).max(-1)
    step = span / levels  # (rows, sub-blocks): the step its own quants need
    # a sub-block's step is its super-block's d times a whole scale (6 bits, Q6_K's 7): up to one d coarser, and a
    # little more where the minimum and the float16 scales round up; a weight out of place would be off by far more
    d = step.reshape(6, 2, -1).max(-1, keepdims=True) / (127 if fmt == "Q6_K" else 63)  # (rows, 2, 1)
    coarsest = (step.reshape(6, 2, -1) + d).reshape(step.shape)[..., None]  # (rows, sub-blocks, 1)
    assert np.all(np.abs(y - x).reshape(parts.shape) <= 0.6 * coarsest + 1e-6)
    assert np.all(y[1, 256:] == 0)
    with pytest.raises(ValueError, match=f"{fmt} needs rows of a multiple of 256 weights, not 576"):
        quantise(np.zeros((1, 576), np.float32), fmt)


def test_a_q4_k_m_file_mixes_formats_as_llama_cpps_quantiser_does(tmp_path):
    """Q6_K for the attention values and MLP down products of llama.cpp's chosen layers and for the tied output rows,
    Q4_K elsewhere; rows of 576 weights (no multiple of 256) fall back as llama.cpp's do (Q4_K to Q5_0, Q6_K to
    Q8_0)."""
    import gguf

    from playground.models.loader import embedded_gguf
    from playground.models.requantise import more_bits, requantise

    assert [layer for layer in range(30) if more_bits(layer, 30)] == [0, 1, 2, 5, 8, 11, 14, 17, 20, 23, 26, 27, 28,
                                                                      29]
    path = tmp_path / "q4_k_m.gguf"
    assert requantise(embedded_gguf(), path, "Q4_K_M") == {"F32": 61, "Q5_0": 166, "Q8_0": 15, "Q4_K": 16, "Q6_K": 14}
    kinds = {t.name: t.tensor_type.name for t in gguf.GGUFReader(path).tensors}
    assert kinds["blk.0.ffn_down.weight"] == "Q6_K" and kinds["blk.3.ffn_down.weight"] == "Q4_K"
    assert kinds["blk.0.attn_v.weight"] == "Q8_0" and kinds["blk.3.attn_v.weight"] == "Q5_0"
    assert kinds["token_embd.weight"] == "Q8_0"
