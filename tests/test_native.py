"""The native CPU matrix product: built once, exact to float32 rounding, row-independent, optional."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

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


def test_a_rows_product_does_not_depend_on_the_other_rows(kernel: native.Kernel) -> None:
    """Each output sums over the input in the same order whatever the batch: a token's logits in a verify forward
    are bit-identical to its logits in a forward of its own (up to the rest of the model)."""
    torch.manual_seed(0)
    weight = torch.randn(200, 96)
    panels = native.pack_panels(weight, kernel)
    x = torch.randn(30, 96)
    together = native.panel_linear(x, panels)
    for i in range(30):
        assert torch.equal(together[i], native.panel_linear(x[i : i + 1], panels)[0])


def test_non_contiguous_input(kernel: native.Kernel) -> None:
    weight = torch.randn(64, 48)
    x = torch.randn(48, 9).t()  # (9, 48), a transposed view
    torch.testing.assert_close(native.panel_linear(x, native.pack_panels(weight, kernel)), x @ weight.t(),
                               atol=1e-4, rtol=1e-4)


def test_inputs_needing_gradients_go_through_pytorch(kernel: native.Kernel) -> None:
    from playground.models.transformer import linear

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


def test_a_failing_build_is_reported_not_raised(monkeypatch: pytest.MonkeyPatch, tmp_path) -> None:
    broken = tmp_path / "gemm.c"
    broken.write_text("this is not C\n")
    monkeypatch.setattr(native, "SOURCE", broken)
    monkeypatch.setattr(native, "default_cache_dir", lambda: tmp_path / "cache")
    kernel, status = native._try_kernel()
    assert kernel is None and status.startswith("unavailable (the C build failed: ")
