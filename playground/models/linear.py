"""The matrix product every layer runs: through a prepacked copy of the weight on the CPU (the native kernel's
panels, else oneDNN's), else split for the few rows of a decode or verify step, else PyTorch's `F.linear`."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from . import native

# Up to this many rows, a CPU matrix product is memory-bound and runs as split batched matrix-vector products.
SMALL_ROWS = 32
# From this many rows, a prepacked oneDNN weight beats the split batched matrix-vector products (see `pack`).
PACKED_MIN_ROWS = 3


def can_pack(weight: torch.Tensor) -> bool:
    """Whether `pack` can prepack this weight: float32 on a CPU with the native kernel (see `native`) or a
    PyTorch build with oneDNN's linear."""
    return (weight.is_cpu and weight.dtype == torch.float32
            and (native.kernel() is not None or (torch.backends.mkldnn.is_available()
                                                  and hasattr(torch.ops.mkldnn, "_reorder_linear_weight"))))


def pack(weight: torch.Tensor) -> native.Panels | torch.Tensor:
    """A prepacked copy of a (out, in) float32 CPU weight for `linear(..., packed=)`: panels for the native kernel
    where it is built (every row count then runs there), else oneDNN's layout (opaque to other ops), which serves
    `PACKED_MIN_ROWS` rows and more while fewer keep the split bmm (docs/results.md has the measurements)."""
    kernel = native.kernel()
    if kernel is not None:
        return native.pack_panels(weight, kernel)
    return torch.ops.mkldnn._reorder_linear_weight(weight, 16)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
           packed: native.Panels | torch.Tensor | None = None) -> torch.Tensor:
    """x (..., in) @ weight (out, in)^T (+ bias): through the packed copy of the weight when there is one (the
    native kernel's panels for any row count; oneDNN's for `PACKED_MIN_ROWS` rows or more, see `pack`), else fast
    for the few rows of a decode or verify step on the CPU.

    Measured on a 2-core CPU, for 1-32 rows MKL runs F.linear as a single-threaded GEMV (or a poorly parallel
    GEMM) at ~14 GB/s; splitting the weight into one block of rows per thread and calling bmm streams the weight
    at ~29 GB/s. Large row counts (prefill) and GPUs keep F.linear. Inputs that need gradients bypass the
    native kernel.
    """
    if isinstance(packed, native.Panels):
        if not x.requires_grad:
            return native.panel_linear(x, packed, bias)
        packed = None  # the native kernel has no backward: gradients go through PyTorch's products
    out_features, in_features = weight.shape
    rows = x.numel() // in_features
    splits = torch.get_num_threads()
    can_split = x.is_cpu and rows <= SMALL_ROWS and splits > 1 and out_features % splits == 0
    if packed is not None and (rows >= PACKED_MIN_ROWS or (rows > 1 and not can_split)):
        return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")
    if not can_split:
        return F.linear(x, weight, bias)
    # Every op here costs microseconds of dispatch, ~120 times per decode step: keep the chain short.
    blocks = weight.view(splits, out_features // splits, in_features)  # (S, out/S, in)
    # The input must have contiguous rows (for several rows the previous ops' output may not, and MKL's bmm then
    # takes a much slower path); copying N x in values is negligible.
    cols = x.reshape(rows, in_features).contiguous().t().expand(splits, in_features, rows)  # (S, in, N)
    y = torch.bmm(blocks, cols)  # (S, out/S, N)
    if rows > 1:
        # Contiguous again: attention's fused CPU kernel refuses queries whose last dimension is strided and falls
        # back to the unfused one (2x slower on a batch of 4 decode rows).
        y = y.reshape(out_features, rows).t().contiguous()  # (N, out)
    y = y.reshape(*x.shape[:-1], out_features)
    return y if bias is None else y + bias


def product_bytes(weight: torch.Tensor, packed: native.Panels | torch.Tensor | None) -> int:
    """Bytes one product with `weight` reads: its panels' where the native kernel runs it (16-bit floats or GGUF
    blocks, where it packed them so), else the weight's own."""
    return packed.nbytes if isinstance(packed, native.Panels) else weight.numel() * weight.element_size()


def weights_read(module: nn.Module) -> int:
    """Bytes a forward through `module` reads from its parameters: each `Linear`'s as `product_bytes`."""
    products = {id(m.weight): product_bytes(m.weight, m.packed) for m in module.modules() if isinstance(m, Linear)}
    return sum(products.get(id(p), p.numel() * p.element_size()) for p in module.parameters())


class Linear(nn.Linear):
    """nn.Linear with the same weights and names, routed through `linear` (and its packed weight, once packed).

    `packed` is a plain attribute, not a buffer: it stays out of state dicts, and `pack_linears` builds it
    after the weights are on their device.
    """

    packed: native.Panels | torch.Tensor | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias, self.packed)
