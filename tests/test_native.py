"""The native CPU kernels: built once, exact to float32 rounding, a row's result independent of the other rows,
optional."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from playground.decoding.tree import ancestor_mask
from playground.models import native


@pytest.fixture(scope="module")
def kernel() -> native.Kernel:
    built = native.kernel()
    if built is None:
        pytest.skip(f"native kernel {native.status()}")
    return built


@pytest.mark.parametrize("shape", [(960, 576), (100, 64), (7, 5), (33, 48)], ids=str)
@pytest.mark.parametrize("rows", [0, 1, 2, 5, 11, 12, 13, 25, 40])
def test_panel_linear_matches_f_linear(kernel: native.Kernel, shape: tuple[int, int], rows: int) -> None:
    """Any row count (several register blocks, a partial one, none), any output size (the last panel padded)."""
    out, in_features = shape
    torch.manual_seed(rows)
    weight, bias = torch.randn(out, in_features), torch.randn(out)
    panels = native.pack_panels(weight, kernel)
    assert panels.data.shape == (-(-out // kernel.panel_width), in_features, kernel.panel_width)
    x = torch.randn(2, rows, in_features)
    got = native.panel_linear(x, panels, bias)
    assert got.shape == (2, rows, out)
    torch.testing.assert_close(got, F.linear(x, weight, bias), atol=1e-4, rtol=1e-4)


def test_rows_per_pass_is_what_the_registers_hold(kernel: native.Kernel, target) -> None:
    """12 rows with 32 vector registers (AVX-512), 6 with 16; the embedded model's forwards report it."""
    assert kernel.rows_per_pass == (12 if kernel.vector_width == 16 else 6)
    assert target.model.rows_per_pass == kernel.rows_per_pass


@pytest.mark.parametrize("threads", [1, 2, 3])
@pytest.mark.parametrize("out", [200, 83, 16])
def test_a_rows_product_does_not_depend_on_the_other_rows(kernel: native.Kernel, out: int, threads: int) -> None:
    """Each output sums over the input in the same order whatever the batch: a token's logits in a verify forward
    are bit-identical to its logits in a forward of its own (up to the rest of the model). Every row count up to
    two and a half register blocks runs a different plan (panels per pass, rows per pass, passes per panel), and
    the output sizes and thread counts leave threads a whole number of panel groups, a remainder or one panel."""
    torch.manual_seed(out)
    weight = torch.randn(out, 96)
    panels = native.pack_panels(weight, kernel)
    x = torch.randn(2 * kernel.rows_per_pass + 3, 96)
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        alone = torch.cat([native.panel_linear(x[i : i + 1], panels) for i in range(len(x))])  # (N, out)
        for rows in range(2, len(x) + 1):
            assert torch.equal(native.panel_linear(x[:rows], panels), alone[:rows]), rows
    finally:
        torch.set_num_threads(previous)
    torch.testing.assert_close(alone, x @ weight.t(), atol=1e-4, rtol=1e-4)


def test_non_contiguous_input(kernel: native.Kernel) -> None:
    weight = torch.randn(64, 48)
    x = torch.randn(48, 9).t()  # (9, 48), a transposed view
    torch.testing.assert_close(native.panel_linear(x, native.pack_panels(weight, kernel)), x @ weight.t(),
                               atol=1e-4, rtol=1e-4)


def test_inputs_needing_gradients_go_through_pytorch(kernel: native.Kernel) -> None:
    from playground.models.linear import linear

    weight = torch.randn(64, 48)
    x = torch.randn(5, 48, requires_grad=True)
    y = linear(x, weight, packed=native.pack_panels(weight, kernel))
    y.sum().backward()
    torch.testing.assert_close(x.grad, weight.sum(0).expand(5, 48))


def test_build_is_cached_per_source_and_cpu(kernel: native.Kernel, tmp_path) -> None:
    first = native.build(tmp_path, "cc")
    stamp = first.stat().st_mtime_ns
    assert native.build(tmp_path, "cc") == first and first.stat().st_mtime_ns == stamp
    assert list(tmp_path.iterdir()) == [first]  # no build leftovers
    assert native.load(first).panel_width == kernel.panel_width


def test_without_a_compiler_or_when_switched_off_pytorch_kernels_stay(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CC", "no-such-compiler-here")
    kernel, status = native._try_kernel()
    assert kernel is None and "no C compiler 'no-such-compiler-here'" in status and "PyTorch's kernels" in status
    monkeypatch.setenv(native.SWITCH_ENV, "0")
    kernel, status = native._try_kernel()
    assert kernel is None and status.startswith("off (PLAYGROUND_NATIVE=0)")


def test_the_arch_variable_builds_for_that_architecture(monkeypatch: pytest.MonkeyPatch, tmp_path) -> None:
    """PLAYGROUND_NATIVE_ARCH=haswell builds the AVX2 path on any x86 CPU that runs it (how the suite checks, on an
    AVX-512 host, the code an AVX2-only machine runs); a value that is not a -march name is refused, not compiled."""
    from pathlib import Path

    monkeypatch.setattr(native, "default_cache_dir", lambda: tmp_path / "cache")
    monkeypatch.setenv(native.ARCH_ENV, "haswell; rm -rf /")
    kernel, status = native._try_kernel()
    assert kernel is None and "PLAYGROUND_NATIVE_ARCH='haswell; rm -rf /' is not a -march name" in status
    if not {"avx2", "fma", "f16c"} <= set(Path("/proc/cpuinfo").read_text().split()):
        pytest.skip("this CPU does not run AVX2 with FMA and F16C")
    monkeypatch.setenv(native.ARCH_ENV, "haswell")
    assert "-march=haswell" in native.flags() and "-march=native" not in native.flags()
    kernel, status = native._try_kernel()
    assert kernel is not None and (kernel.vector_width, kernel.panel_width, kernel.rows_per_pass) == (8, 16, 6)
    assert status.endswith("built for -march=haswell by PLAYGROUND_NATIVE_ARCH)")


def test_a_failing_build_is_reported_not_raised(monkeypatch: pytest.MonkeyPatch, tmp_path) -> None:
    broken = tmp_path / "kernels.c"
    broken.write_text("this is not C\n")
    monkeypatch.setattr(native, "SOURCE", broken)
    monkeypatch.setattr(native, "default_cache_dir", lambda: tmp_path / "cache")
    kernel, status = native._try_kernel()
    assert kernel is None and status.startswith("unavailable (the C build failed: ")


def reference_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, visible: torch.Tensor | None,
                        new_tokens: int) -> torch.Tensor:
    """PyTorch's attention on the kernel's layout: q (B, Hkv, G*T, D), visible (B, T, L) or None."""
    b, hkv, rows, _ = q.shape
    mask = None
    if visible is not None:  # row r of q is new token r % T
        mask = visible.unsqueeze(1).expand(b, rows // new_tokens, new_tokens, -1).reshape(b, 1, rows, -1)
    return F.scaled_dot_product_attention(q, keys, values, attn_mask=mask)


def random_tree(new_tokens: int, generator: torch.Generator) -> torch.Tensor:
    """Visibility (T, T) among the new tokens of a random tree: each sees its ancestors and itself."""
    parents = [-1] + [int(torch.randint(-1, i, (1,), generator=generator)) for i in range(1, new_tokens)]
    return ancestor_mask(parents)  # a forest: any node may have no parent among the new tokens


def cache_views(batch: int, hkv: int, key_len: int, d: int, layout: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys and values as the caches hand them over: slices of a longer contiguous cache, or the paged cache's
    gathered (B, L, Hkv, D) read as (B, Hkv, L, D)."""
    if layout == "contiguous":
        full = torch.randn(2, batch, hkv, key_len + 13, d)
        return full[0, :, :, :key_len], full[1, :, :, :key_len]
    full = torch.randn(2, batch, key_len, hkv, d)
    return full[0].transpose(1, 2), full[1].transpose(1, 2)


@pytest.mark.parametrize("layout", ["contiguous", "paged"])
@pytest.mark.parametrize("shape", [(1, 3, 3, 1, 300, 64), (1, 3, 3, 7, 301, 64), (2, 2, 2, 5, 40, 32),
                                   (1, 1, 4, 33, 70, 128), (1, 2, 1, 3, 3, 16)],
                         ids=lambda s: "B{}-Hkv{}-G{}-T{}-L{}-D{}".format(*s))
@pytest.mark.parametrize("visibility", ["all", "causal", "tree"])
def test_attention_matches_pytorch(kernel: native.Kernel, shape, layout: str, visibility: str) -> None:
    batch, hkv, group, new_tokens, key_len, d = shape
    generator = torch.Generator().manual_seed(key_len + new_tokens)
    torch.manual_seed(key_len)
    keys, values = cache_views(batch, hkv, key_len, d, layout)
    q = torch.randn(batch, hkv, group * new_tokens, d)
    visible = None
    if visibility != "all":
        among = (torch.ones(new_tokens, new_tokens, dtype=torch.bool).tril() if visibility == "causal"
                 else random_tree(new_tokens, generator))
        visible = torch.ones(batch, new_tokens, key_len, dtype=torch.bool)
        visible[:, :, key_len - new_tokens :] = among
    assert kernel.attends(d, torch.float32, torch.device("cpu"))
    got = native.attention(kernel, q, keys, values, visible, new_tokens)
    torch.testing.assert_close(got, reference_attention(q, keys, values, visible, new_tokens), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("vectors, prefix, padded", [(1, 45, False), (3, 150, False), (4, 150, False),
                                                     (4, 61, False), (8, 150, False), (4, 150, True)])
def test_a_querys_attention_depends_on_its_visible_keys_alone(kernel: native.Kernel, vectors: int, prefix: int,
                                                              padded: bool) -> None:
    """A tree node's result in one call with other nodes, hidden keys between its ancestors and a second sequence
    in the batch is bit-identical to its own call over the prefix, its ancestors and itself: what a plain decode
    step would attend to after accepting that path. Head sizes of 1 to 8 vectors (rows go two at a time over the
    keys they both see in full where registers allow, else one by one), prefixes in and off the key blocks; padded:
    the call's keys lie further apart than a head (as in a wider cache row), so its scores read every key through a
    pointer where the calls alone read whole groups of keys in place."""
    generator = torch.Generator().manual_seed(prefix)
    torch.manual_seed(vectors)
    hkv, group, new_tokens, d = 3, 3, 11, vectors * kernel.vector_width
    key_len = prefix + new_tokens
    among = random_tree(new_tokens, generator)
    width = d + kernel.vector_width if padded else d
    keys, values = torch.randn(2, hkv, key_len, width)[..., :d], torch.randn(2, hkv, key_len, width)[..., :d]
    q = torch.randn(2, hkv, group * new_tokens, d)
    visible = torch.ones(2, new_tokens, key_len, dtype=torch.bool)
    visible[0, :, prefix:] = among
    visible[1, :, prefix - 40 :] = False  # the other sequence: shorter, with one token of its own
    visible[1, :, prefix - 40] = True
    together = native.attention(kernel, q, keys, values, visible, new_tokens)  # (2, Hkv, G*T, D)
    rows = q[0].view(hkv, group, new_tokens, d)
    for node in range(new_tokens):
        seen = torch.cat([torch.arange(prefix), prefix + among[node].nonzero().flatten()])  # in key order
        alone = native.attention(kernel, rows[:, :, node].unsqueeze(0).contiguous(), keys[:1, :, seen],
                                 values[:1, :, seen], None, 1)  # (1, Hkv, G, D)
        assert torch.equal(alone[0], together[0].view(hkv, group, new_tokens, d)[:, :, node])
    other = torch.arange(prefix - 40 + 1)
    alone = native.attention(kernel, q[1:, :, :1].contiguous(), keys[1:, :, other], values[1:, :, other], None, 1)
    assert torch.equal(alone[0, :, 0], together[1, :, 0])


def test_attention_serves_float32_cpu_heads_of_whole_vectors_only(kernel: native.Kernel) -> None:
    cpu, width = torch.device("cpu"), kernel.vector_width
    assert kernel.attends(4 * width, torch.float32, cpu)
    assert not kernel.attends(4 * width + width // 2, torch.float32, cpu)  # PyTorch's attention serves these
    assert not kernel.attends((native.MAX_HEAD_VECTORS + 1) * width, torch.float32, cpu)
    assert not kernel.attends(4 * width, torch.bfloat16, cpu)
    assert not kernel.attends(4 * width, torch.float32, torch.device("meta"))


def test_rms_norm_matches_pytorch_and_depends_on_its_row_alone(kernel: native.Kernel) -> None:
    torch.manual_seed(0)
    width = kernel.vector_width
    weight = torch.randn(36 * width)
    x = torch.randn(2, 7, 36 * width) * 3
    got = native.rms_norm(kernel, x, weight, 1e-5)
    assert got.shape == x.shape
    torch.testing.assert_close(got, F.rms_norm(x, (x.shape[-1],), weight, 1e-5), atol=1e-5, rtol=1e-5)
    for b in range(2):
        for t in range(7):
            assert torch.equal(native.rms_norm(kernel, x[b, t : t + 1], weight, 1e-5)[0], got[b, t])
    strided = x.transpose(0, 1)  # (7, 2, D), not contiguous
    assert torch.equal(native.rms_norm(kernel, strided, weight, 1e-5), got.transpose(0, 1))


def _rows_with_hard_cases(cols: int) -> torch.Tensor:
    """Random rows (8, cols), then rows with ties, NaNs and -inf in the vector body and in the scalar tail."""
    torch.manual_seed(cols)
    x = torch.randn(8, cols) * 4
    x[1, :] = 2.5  # all equal: the first wins
    x[2, cols // 3] = x[2, cols - 1] = 50.0  # a tie across body and tail
    x[3, :] = float("-inf")
    x[4, cols // 2 :] = float("-inf")
    x[5, cols - 1] = float("nan")
    x[6, [cols // 4, cols // 2]] = float("nan")  # the first NaN is the argmax
    x[7, 0] = float("inf")
    return x


@pytest.mark.parametrize("cols", [1, 7, 16, 33, 100, 49152])
def test_row_top_matches_torch_argmax_and_logsumexp(kernel: native.Kernel, cols: int) -> None:
    x = _rows_with_hard_cases(cols)
    argmax, top, total = native.row_top(kernel, x, True)
    assert argmax == x.argmax(-1).tolist()
    torch.testing.assert_close(top, x.max(-1).values, equal_nan=True)
    finite = torch.isfinite(top)
    torch.testing.assert_close(top[finite] + total[finite].log(), torch.logsumexp(x[finite], -1))
    assert torch.isnan(total[5:7]).all() and total[3] == 0
    assert native.row_top(kernel, x, False)[0] == argmax and native.row_top(kernel, x, False)[2] is None


def test_row_top_reads_strided_rows(kernel: native.Kernel) -> None:
    """Rows a whole buffer row apart (a slice of a wider tensor), and a column view that needs a copy."""
    wide = _rows_with_hard_cases(60)
    for view in (wide[:, :45], wide[::2], wide.t().contiguous().t()):
        assert native.row_top(kernel, view, False)[0] == view.argmax(-1).tolist()


def test_the_models_norms_run_natively_without_gradients_only(kernel: native.Kernel, target) -> None:
    """The loader's packing step hands the kernel to every norm it serves; with gradients on (training), the
    norms go through PyTorch, whose result agrees."""
    from playground.models.transformer import RMSNorm

    norms = [m for m in target.model.modules() if isinstance(m, RMSNorm)]
    assert norms and all(norm.kernel is kernel for norm in norms)
    assert not kernel.normalises(torch.ones(kernel.vector_width + 1))
    assert not kernel.normalises(torch.ones(kernel.vector_width, dtype=torch.bfloat16))
    norm = norms[0]
    x = torch.randn(3, norm.weight.shape[0])
    with torch.no_grad():
        fast = norm(x)
    with torch.enable_grad():
        reference = norm(x.requires_grad_())
    assert reference.requires_grad  # PyTorch's path, which has a backward
    torch.testing.assert_close(fast, reference.detach(), atol=1e-5, rtol=1e-5)


def test_attention_in_equals_norm_product_and_rope_bit_for_bit(kernel: native.Kernel) -> None:
    """The layer half before attention: the same bits as the native norm, the packed product (+ bias) and
    apply_rope (its products and sum rounded apart, no fused multiply-add), row by row."""
    from playground.models.transformer import apply_rope

    torch.manual_seed(0)
    width, heads, d, rope_heads = kernel.vector_width, 5, 16, 3
    hidden = 8 * width
    norm_weight = torch.randn(hidden)
    weight, bias = torch.randn(heads * d, hidden), torch.randn(heads * d)
    panels = native.pack_panels(weight, kernel)
    x = torch.randn(2, 7, hidden)
    angles = torch.rand(2, 7, d // 2) * 6
    cos = torch.cat((angles, angles), dim=-1).cos().unsqueeze(2)  # (B, T, 1, D)
    sin = torch.cat((-angles.sin(), angles.sin()), dim=-1).unsqueeze(2)
    for b in (None, bias):
        got = native.attention_in(kernel, x, norm_weight, 1e-5, panels, b, cos, sin, rope_heads, d)
        product = native.panel_linear(native.rms_norm(kernel, x, norm_weight, 1e-5), panels, b)
        product = product.view(2, 7, heads, d)
        expected = torch.cat((apply_rope(product[:, :, :rope_heads], cos, sin), product[:, :, rope_heads:]), dim=2)
        assert torch.equal(got.view(2, 7, heads, d), expected)
        alone = native.attention_in(kernel, x[1, 4:5].contiguous(), norm_weight, 1e-5, panels, b,
                                    cos[1, 4:5].contiguous(), sin[1, 4:5].contiguous(), rope_heads, d)
        assert torch.equal(alone[0], got[1, 4])
    with pytest.raises(ValueError, match="cos and sin need one row of 16 per row of x"):
        native.attention_in(kernel, x, norm_weight, 1e-5, panels, None, cos[:1], sin[:1], rope_heads, d)


EPS = torch.finfo(torch.float32).eps


def assert_within(got: torch.Tensor, exact: torch.Tensor, bound: torch.Tensor) -> None:
    """Every element of a float32 result within its error bound of the float64 result."""
    excess = (got.double() - exact).abs() - bound
    assert (excess <= 0).all(), (f"{int((excess > 0).sum())} of {excess.numel()} elements past their rounding bound, "
                                 f"worst by {excess.max().item():.3g}")


def test_mlp_block_is_exact_to_float32_rounding_and_depends_on_its_row_alone(kernel: native.Kernel) -> None:
    """The layer half after attention, in place: x + o_proj(attn), then + down(silu(gate) * up) of its norm.

    Compared with float64 under the forward error bound of each step (a sum of n products in float32 is off by at
    most n * eps times the sum of their magnitudes, in any order, with or without fused multiply-adds), carried
    through the chain. A fixed tolerance against PyTorch's float32 result cannot hold on every CPU: where gates are
    large (scaled x40 below) the down projection sums terms of ~1e4 to results of ~1e2, so the result's rounding is
    set by the terms, not by the result, and PyTorch's summation order differs from one CPU kind to another (an AMD
    Zen 4 host once put 3 of 1,280 elements 2e-4 apart relatively). Each row's bits depend on that row alone."""
    torch.manual_seed(0)
    width = kernel.vector_width
    hidden, inter, attn_dim = 8 * width, 12 * width + 3, 6 * width
    w_o, w_gate_up, w_down = torch.randn(hidden, attn_dim), torch.randn(2 * inter, hidden), torch.randn(hidden, inter)
    w_gate_up[:, :5] *= 40  # gates far into both tails of the sigmoid
    norm_weight = torch.randn(hidden)
    packs = [native.pack_panels(w, kernel) for w in (w_o, w_gate_up, w_down)]
    x, attn = torch.randn(2, 5, hidden), torch.randn(2, 5, attn_dim)
    got = x.clone()
    assert native.mlp_block(kernel, got, attn, packs[0], norm_weight, 1e-5, packs[1], packs[2]) is None
    assert torch.isfinite(got).all()
    # float64 reference, and the bound of each step's float32 rounding error (all tensors (2, 5, features))
    x, attn, w_o, w_gate_up, w_down, norm_weight = (t.double() for t in (x, attn, w_o, w_gate_up, w_down,
                                                                           norm_weight))
    mid = x + F.linear(attn, w_o)
    err_mid = attn_dim * EPS * (x.abs() + F.linear(attn.abs(), w_o.abs()))
    normed = F.rms_norm(mid, (hidden,), norm_weight, 1e-5)
    err_normed = hidden * EPS * normed.abs() + (normed / mid).abs().nan_to_num() * err_mid
    gate, up = F.linear(normed, w_gate_up).split(inter, dim=-1)
    err_gate, err_up = (hidden * EPS * F.linear(normed.abs(), w_gate_up.abs())
                        + F.linear(err_normed, w_gate_up.abs())).split(inter, dim=-1)
    sigmoid = torch.sigmoid(gate)
    silu, slope = gate * sigmoid, (sigmoid * (1 + gate * (1 - sigmoid))).abs()
    h = silu * up
    err_h = slope * err_gate * up.abs() + silu.abs() * err_up + 4 * EPS * h.abs()
    exact = mid + F.linear(h, w_down)
    bound = err_mid + F.linear(err_h, w_down.abs()) + inter * EPS * (mid.abs() + F.linear(h.abs(), w_down.abs()))
    assert_within(got, exact, bound)
    scale = mid.abs() + F.linear(h.abs(), w_down.abs())  # what a wrong weight or a lost row would be off by
    assert (bound <= 5e-3 * scale).all()  # the bound stays far below what such a bug would be off by
    row = x[0, 3:4].float().clone()
    native.mlp_block(kernel, row, attn[0, 3:4].float(), packs[0], norm_weight.float(), 1e-5, packs[1], packs[2])
    assert torch.equal(row[0], got[0, 3])


def test_the_models_layers_run_fused_without_gradients_only(kernel: native.Kernel, target, monkeypatch) -> None:
    """Without gradients, every layer of the embedded model runs natively: all of them in one call over a contiguous
    cache, else each layer's halves; with gradients on, the same layers go through PyTorch's ops and agree; a layer
    the kernel cannot run (q/k norms) keeps PyTorch's ops."""
    from playground.config import GenerationParams, ModelSpec
    from playground.decoding.base import new_cache
    from playground.models import load_model

    model = target.model
    assert all(block.kernel is kernel for block in model.layers)
    assert model.native_stack is not None and model.native_stack.num_layers == len(model.layers)
    calls: list[str] = []
    for name in ("mlp_block", "layers"):
        monkeypatch.setattr(native, name, lambda *args, _name=name, _run=getattr(native, name):
                            calls.append(_name) or _run(*args))
    tokens = torch.tensor([[100 + 7 * i for i in range(12)]])  # (1, T)
    logits, counted = {}, {}
    stack = model.native_stack
    for setting in ("stack", "halves", "gradients"):
        cache = new_cache(model, 16, GenerationParams())
        calls.clear()
        model.native_stack = None if setting == "halves" else stack
        try:
            with torch.set_grad_enabled(setting == "gradients"):
                logits[setting] = model(tokens, torch.arange(12).unsqueeze(0), cache, (0,))[0].detach()  # (1, T, V)
        finally:
            model.native_stack = stack
        counted[setting] = calls.copy()
    assert counted == {"stack": ["layers"], "halves": ["mlp_block"] * len(model.layers), "gradients": []}
    assert torch.equal(logits["stack"], logits["halves"])
    # PyTorch's ops multiply float32 weights by float32 activations: the blocks against float32 activations agree
    # closely (the integer products' 8-bit activations move further: test_gguf measures how far)
    float_blocks = load_model(ModelSpec(device="cpu", weights="gguf")).model
    with torch.no_grad():
        fused = float_blocks(tokens, torch.arange(12).unsqueeze(0), new_cache(float_blocks, 16, GenerationParams()),
                             (0,))[0]
    with torch.enable_grad():
        unfused = float_blocks(tokens, torch.arange(12).unsqueeze(0),
                               new_cache(float_blocks, 16, GenerationParams()), (0,))[0].detach()
    torch.testing.assert_close(fused, unfused, atol=2e-4, rtol=1e-4)
    block = model.layers[0]
    block.self_attn.q_norm = torch.nn.Identity()  # as a Qwen3 layer has
    try:
        assert not block.fusable()
    finally:
        block.self_attn.q_norm = None
    assert block.fusable()


def forwards(model, stack: bool, cache, steps) -> list[torch.Tensor]:
    """Logits, hidden states and every row's cache contents after each forward of `steps`: (seq_ids, tokens per
    row, attn_mask or None, lengths to truncate rows to first)."""
    saved = model.native_stack
    model.native_stack = saved if stack else None
    out = []
    try:
        with torch.inference_mode():
            for seq_ids, new, mask, lengths in steps:
                for row, length in lengths.items():
                    cache.truncate(row, length)
                ids = torch.randint(0, model.config.vocab_size, (len(seq_ids), new),
                                    generator=torch.Generator().manual_seed(new))  # (B, T)
                positions = torch.stack([torch.arange(cache.length(s), cache.length(s) + new) for s in seq_ids])
                logits, hidden = model(ids, positions, cache, seq_ids, attn_mask=mask)
                out += [logits, hidden]
                out += [row for s in seq_ids for row in cached_rows(cache, s)]
    finally:
        model.native_stack = saved
    return out


def cached_rows(cache, seq: int) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V (layers, Hkv, length, D) of one sequence, in token order, from a cache of either kind."""
    from playground.kv import PagedKVCache

    length = cache.length(seq)
    if not isinstance(cache, PagedKVCache):
        return cache.k[:, seq, :, :length].clone(), cache.v[:, seq, :, :length].clone()
    table, size = cache.blocks.table(seq), cache.block_size
    slots = torch.tensor([table[j // size] * size + j % size for j in range(length)])  # (length,)
    return cache.k[:, slots].transpose(1, 2).clone(), cache.v[:, slots].transpose(1, 2).clone()


def test_the_layer_stack_equals_the_layer_by_layer_forward_bit_for_bit(kernel: native.Kernel, target) -> None:
    """The whole-stack call gives the same logits, hidden states and cache contents as the layers one by one: a
    prompt, one-token steps, a chain, a tree, rows of different lengths (a shorter row sees nothing past its own
    new tokens), rows that are not consecutive (these keep the layer-by-layer path)."""
    from playground.kv import ContiguousKVCache

    model = target.model
    cfg = model.config
    tree = ancestor_mask([-1, 0, 0, 2])  # (4, 4)
    steps = [((0, 1), 9, None, {}), ((0, 1), 1, None, {}), ((0, 1), 5, None, {1: 6}), ((0, 1), 4, tree, {}),
             ((1,), 1, None, {}), ((2, 0), 3, None, {}), ((0,), 1, None, {})]
    results = []
    for stack in (True, False):
        cache = ContiguousKVCache(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, 64, max_seqs=3)
        results.append(forwards(model, stack, cache, steps))
    assert len(results[0]) == len(results[1])
    for got, want in zip(*results):
        assert torch.equal(got, want)


def test_the_layer_stack_runs_on_the_paged_pool_bit_for_bit(kernel: native.Kernel, target, monkeypatch) -> None:
    """Over the paged cache too, every layer runs in one native call, writing each token to its slot of the pool and
    reading each row's keys through its block table, and gives the bits of the layers one by one on the paged cache
    and of the stack on the contiguous cache: logits, hidden states and every row's keys and values, through the
    same prompts, steps, chain, tree, truncations and rows out of order as above."""
    from playground.kv import ContiguousKVCache, PagedKVCache

    model = target.model
    cfg = model.config
    tree = ancestor_mask([-1, 0, 0, 2])  # (4, 4)
    steps = [((0, 1), 9, None, {}), ((0, 1), 1, None, {}), ((0, 1), 5, None, {1: 6}), ((0, 1), 4, tree, {}),
             ((1,), 1, None, {}), ((2, 0), 3, None, {}), ((0,), 1, None, {})]
    calls: list[int] = []
    monkeypatch.setattr(native, "layers", lambda *args, _run=native.layers: calls.append(1) or _run(*args))
    results = []
    for stack, paged in ((True, True), (False, True), (True, False)):
        calls.clear()
        # blocks of 4 handed out in a shuffled order, so that no row's blocks are adjacent in the pool
        cache = (PagedKVCache(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, num_blocks=24, block_size=4) if paged
                 else ContiguousKVCache(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, 64, max_seqs=3))
        if paged:
            cache.blocks.allocator.allocate(24)
            for block in torch.randperm(24, generator=torch.Generator().manual_seed(0)).tolist():
                cache.blocks.allocator.release(block)
        results.append(forwards(model, stack, cache, steps))
        if paged:  # every forward in one call, rows out of order too (the contiguous cache runs those by layers)
            assert len(calls) == (len(steps) if stack else 0)
    for got, paged_layers, contiguous_stack in zip(*results):
        assert torch.equal(got, paged_layers)
        assert torch.equal(got, contiguous_stack)


def sixteen_bit(dtype: torch.dtype, out: int, in_features: int) -> torch.Tensor:
    """A float32 weight every value of which is exactly a `dtype` float: float16 values, or bfloat16 values beyond
    float16's range (so that they are not float16 too)."""
    weight = torch.randn(out, in_features, generator=torch.Generator().manual_seed(out))
    if dtype == torch.bfloat16:
        weight = weight * 1e6  # past float16's largest finite value, 65504
    return weight.to(dtype).float()


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("out", [200, 83, 16])
@pytest.mark.parametrize("threads", [1, 2])
def test_sixteen_bit_panels_give_the_float32_panels_bits(kernel: native.Kernel, dtype: torch.dtype, out: int,
                                                         threads: int) -> None:
    """A weight whose every value is exactly a float16 (or bfloat16) packs in that format, half the bytes, and every
    row count (each plan of passes and panel groups, partial last panels) gives the same bits as float32 panels."""
    if not kernel.halves:
        pytest.skip("this CPU's build serves float32 panels only (no AVX2 with F16C, no AVX-512)")
    weight = sixteen_bit(dtype, out, 96)
    narrow, wide = native.pack_panels(weight, kernel), native.pack_panels(weight, kernel, narrow=False)
    assert (narrow.data.dtype, wide.data.dtype) == (dtype, torch.float32)
    assert narrow.data.shape == wide.data.shape
    assert native.narrowest(weight) == dtype
    x = torch.randn(2 * kernel.rows_per_pass + 3, 96, generator=torch.Generator().manual_seed(1))
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for rows in range(1, len(x) + 1):
            assert torch.equal(native.panel_linear(x[:rows], narrow), native.panel_linear(x[:rows], wide)), rows
    finally:
        torch.set_num_threads(previous)


def test_weights_not_exactly_sixteen_bit_stay_float32(kernel: native.Kernel) -> None:
    """Packing never rounds: one value off a float16 keeps the whole weight in float32; `narrow=False`, or a build
    without 16-bit loads, keeps float32 too."""
    from dataclasses import replace

    weight = sixteen_bit(torch.float16, 40, 32)
    weight[3, 7] = 1 / 3  # a float32 that no 16-bit float holds
    assert native.narrowest(weight) == torch.float32
    assert native.pack_panels(weight, kernel).data.dtype == torch.float32
    exact = sixteen_bit(torch.float16, 40, 32)
    assert native.pack_panels(exact, kernel, narrow=False).data.dtype == torch.float32
    assert native.pack_panels(exact, replace(kernel, halves=False)).data.dtype == torch.float32


def test_the_shipped_draft_runs_on_sixteen_bit_panels_with_the_same_bits(kernel: native.Kernel, monkeypatch) -> None:
    """The draft ships in float16, so every product of its layers and its output projection packs in float16: its
    forwards (a prompt, steps, a tree; all layers in one call or layer by layer) give bit for bit what the same model
    on float32 panels gives, and the benchmark counts the bytes its panels hold."""
    from playground.bench.harness import weight_bytes_per_token
    from playground.config import ModelSpec
    from playground.kv import ContiguousKVCache
    from playground.models import load_model
    from playground.models.loader import default_draft

    if not kernel.halves:
        pytest.skip("this CPU's build serves float32 panels only (no AVX2 with F16C, no AVX-512)")
    spec = ModelSpec(source=default_draft("embedded"), device="cpu", dtype="float32")
    narrow = load_model(spec).model
    wide_pack = native.pack_panels
    monkeypatch.setattr(native, "pack_panels", lambda weight, built: wide_pack(weight, built, narrow=False))
    wide = load_model(spec).model
    monkeypatch.undo()
    assert narrow.native_stack is not None and wide.native_stack is not None
    assert {p.data.dtype for p in (narrow.layers[0].mlp.down_proj.packed, narrow.packed_output)} == {torch.float16}
    assert {p.data.dtype for p in (wide.layers[0].mlp.down_proj.packed, wide.packed_output)} == {torch.float32}
    assert list(narrow.native_stack.formats) == [native.FORMATS[torch.float16]] * (4 * len(narrow.layers))
    cfg = narrow.config
    tree = ancestor_mask([-1, 0, 0, 2])  # (4, 4)
    steps = [((0,), 9, None, {}), ((0,), 1, None, {}), ((0,), 4, tree, {}), ((0,), 1, None, {0: 11})]
    # the whole stack in one call and layer by layer (each half's products given their formats) on 16-bit panels,
    # against the stack on float32 panels
    results = [forwards(model, stack, ContiguousKVCache(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, 32), steps)
               for model, stack in ((narrow, True), (narrow, False), (wide, True))]
    for got, halves, want in zip(*results):
        assert torch.equal(got, want) and torch.equal(halves, want)
    products = [narrow.packed_output.data] + [m.packed.data for m in narrow.modules()
                                              if isinstance(getattr(m, "packed", None), native.Panels)]
    norms = [p for name, p in narrow.named_parameters() if "norm" in name]
    assert weight_bytes_per_token(narrow) == sum(t.numel() * 2 for t in products) + sum(p.numel() * 4 for p in norms)
    assert weight_bytes_per_token(narrow) < 0.6 * weight_bytes_per_token(wide)
