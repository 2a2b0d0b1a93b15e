"""GGUF weights read as the file stores them: the kernel's Q8_0 and Q4_1 panels sum each block apart (the bits of a
reference of that arithmetic, the same on the AVX2 build, nearer the exact product than the float32 panels of gguf's
dequantisation), the embedded model reads its blocks by default with plain decoding's tokens unchanged, and every way
of asking for them that cannot work says why in one line."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize

from playground.config import ConfigError, GenerationParams, ModelSpec, SamplingParams
from playground.decoding.costs import machine_key
from playground.decoding.registry import build_proposer
from playground.decoding.tree import ancestor_mask
from playground.engine import generate
from playground.kv import ContiguousKVCache
from playground.models import ModelLoadError, load_model, native
from playground.models.gguf import BLOCKS_FILE, BlocksError, save_blocks
from playground.models.loader import load_weights, read_hf_config
from playground.models.vocab import output_rows

from .prompts import PROMPTS
from .test_native import forwards

SIZES = {"Q8_0": 34, "Q4_1": 20}


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


def random_blocks(kind: str, out: int, in_features: int, seed: int) -> torch.Tensor:
    """(out, in / 32 * block bytes) uint8: scales over float16's range (zero, subnormal, large; either sign),
    minimums likewise, every quant value."""
    g = torch.Generator().manual_seed(seed)
    count = out * in_features // 32
    scales = torch.randn(count, generator=g) * torch.logspace(-7, 1, count)[torch.randperm(count, generator=g)]
    scales[::17] = 0.0
    scales[5::23] = 2.0 ** -20  # subnormal in float16
    halves = [scales.half().view(torch.uint8).view(count, 2)]
    if kind == "Q4_1":
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
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for rows in (1, 2, 3, 4, 5, 7, kernel.rows_per_pass, kernel.rows_per_pass + 1, len(x)):
            assert torch.equal(native.panel_linear(x[:rows], panels), want[:rows]), rows
    finally:
        torch.set_num_threads(previous)


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


def test_the_embedded_model_reads_its_blocks(kernel, target, float32):
    """By default (weights auto) every product of the embedded model reads the file's blocks, about 96 MB instead
    of 538; its forwards (a prompt, steps, a tree) give the same bits with the stack in one call and layer by layer,
    and the float32 model's logits to within a thousandth of their spread."""
    assert target.weights == "gguf" and float32.weights == "float32"
    assert set(native.formats_read(target.model).split(" (")[0].split(" and ")) == {"Q4_1", "Q8_0 blocks"}
    q8, q41 = native.GGUF_FORMATS["Q8_0"][0], native.GGUF_FORMATS["Q4_1"][0]
    assert target.model.packed_output.format == q8
    assert set(target.model.native_stack.formats) == {q41}
    read = sum(p.nbytes for _, p in target.model.packed_products())
    assert 90e6 < read < 100e6 and sum(p.nbytes for _, p in float32.model.packed_products()) > 5 * read
    assert machine_key(target.model) != machine_key(float32.model)  # each format has its own cost curve
    cfg = target.model.config
    tree = ancestor_mask([-1, 0, 0, 2])  # (4, 4)
    steps = [((0,), 9, None, {}), ((0,), 1, None, {}), ((0,), 4, tree, {}), ((0,), 1, None, {0: 11})]
    runs = [forwards(model.model, stack, ContiguousKVCache(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, 32), steps)
            for model, stack in ((target, True), (target, False), (float32, True))]
    for got, layer_by_layer, float32_got in zip(*runs):
        assert torch.equal(got, layer_by_layer)
        assert (got - float32_got).abs().max() <= 1e-3 * float32_got.std()


def test_some_output_rows_are_packed_from_the_blocks(kernel, target, float32):
    """A proposer's reduced output rows (the EAGLE head's, the Medusa heads') read the projection's Q8_0 blocks on
    the blocks model: about a quarter of float32's bytes, the bits of the whole projection's logits at those ids."""
    ids = torch.tensor([0, 2, 7, 100, 4000, 31000, 49151])
    rows, wide = output_rows(target.model, ids), output_rows(float32.model, ids)
    assert rows.packed.format == native.GGUF_FORMATS["Q8_0"][0] and rows.packed.nbytes < wide.packed.nbytes / 3
    hidden = torch.randn(3, target.model.config.hidden_size, generator=torch.Generator().manual_seed(0))  # (3, E)
    assert torch.equal(rows.logits(hidden), native.panel_linear(hidden, target.model.packed_output)[:, ids])


def test_a_proposer_is_priced_by_the_bytes_its_forward_reads(kernel, target, float32):
    """Before measuring, a draft's forward is priced at the bytes it reads over the target's: the blocks model as its
    own draft costs one forward; the float32 model, with as many weights, reads more than five times its bytes."""
    assert build_proposer(target, "speculative", draft=target).estimate_cost() == pytest.approx(1)
    assert build_proposer(target, "speculative", draft=float32).estimate_cost() > 5
    assert build_proposer(float32, "speculative", draft=target).estimate_cost() < 1 / 5


def test_plain_decoding_on_blocks_equals_float32_on_every_prompt(kernel, target, float32, plain_outputs):
    """The blocks' logits differ from float32's in their last bits: not enough to change a greedy token here."""
    generation = GenerationParams(max_new_tokens=24)
    for prompt in PROMPTS:
        assert generate(float32, prompt, None, SamplingParams(), generation)[0].token_ids == plain_outputs[prompt]


@pytest.mark.parametrize("algo", ["speculative", "prompt-lookup", "lookahead", "medusa", "eagle"])
def test_every_algorithm_on_blocks_emits_plain_decoding(kernel, target, float32, plain_outputs, algo):
    """Each proposer on the blocks (either cache) reproduces plain decoding on the blocks (and so float32's)."""
    generation = {kv: GenerationParams(max_new_tokens=24, kv=kv) for kv in ("contiguous", "paged")}
    proposer = build_proposer(target, algo)
    for i, prompt in enumerate(PROMPTS[:6]):
        out = generate(target, prompt, proposer, SamplingParams(), generation[("contiguous", "paged")[i % 2]])[0]
        assert out.token_ids == plain_outputs[prompt], prompt


def test_the_blocks_are_kept_beside_the_converted_weights(target):
    """Written once into the cached folder, then read from there by every later load."""
    kept = target.folder / BLOCKS_FILE
    written = kept.stat().st_mtime_ns
    assert load_model(ModelSpec(device="cpu", weights="gguf")).weights == "gguf"
    assert kept.stat().st_mtime_ns == written


def test_blocks_that_are_not_the_weights_are_refused(target, tmp_path):
    from playground.models.loader import embedded_gguf

    tensors = load_weights(target.folder)
    tensors["model.layers.3.mlp.down_proj.weight"] = tensors["model.layers.3.mlp.down_proj.weight"] * 2
    with pytest.raises(BlocksError, match="blk.3.ffn_down.weight .* do not dequantise to "
                                          "model.layers.3.mlp.down_proj.weight"):
        save_blocks(embedded_gguf(), tmp_path, tensors, read_hf_config(target.folder))


@pytest.mark.parametrize("spec, message", [
    ({"weights": "gguf", "dtype": "bfloat16"}, "weights: gguf needs the CPU (--device cpu), dtype float32"),
    ({"weights": "gguf", "quant": "int8"}, "weights: gguf needs the CPU"),
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
    with pytest.raises(ModelLoadError, match="weights: gguf needs the native kernel with AVX2 or AVX-512"):
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
