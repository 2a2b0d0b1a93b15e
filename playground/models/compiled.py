"""`--forwards compiled`: the static forwards (`models.forwards`) with each layer's work around attention in two
functions compiled by `torch.compile` (Inductor). PyTorch's ops run a layer as some thirty kernels, each a launch
and a pass over memory: the norms (several ops each), RoPE's four, SwiGLU's activation and product, the residual
adds. Compiled, that elementwise work fuses with its neighbours into fewer kernels; the products stay the vendor's
(cuBLAS on a GPU), the cache writes and attention stay eager. A CUDA graph (`graphs`) removes the launches' host
work but still runs every kernel one after another, a few microseconds each however small, so on a GPU the
forward's time in graphs is about its kernels times that: fewer kernels is what makes it shorter
(`scripts/gpu_check.py` counts them both ways).

The functions take tensors only (weights as arguments), so one compiled graph serves every layer. They compile on
first use, and again for an input shape not seen before (from the second, one graph for any such shape); with one
width (`forwards.one_width`) all of an engine's decode forwards have one shape, while a batching engine's buckets
and each model it runs (a draft, EAGLE's head) add graphs (`GRAPHS`). Layers the native CPU kernel runs keep it.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from ..kv import AttentionLayout, KVCache
from .transformer import Attend, Block, apply_rope, rms_norm


def attention_in(x: torch.Tensor, norm: torch.Tensor, eps: float, qkv_weight: torch.Tensor,
                 qkv_bias: torch.Tensor | None, q_norm: torch.Tensor | None, k_norm: torch.Tensor | None,
                 cos: torch.Tensor, sin: torch.Tensor, heads: int, kv_heads: int, head_dim: int) -> torch.Tensor:
    """x (B, T, E) -> its queries and keys (rotated, and normed per head where q_norm and k_norm are given) and its
    values, (B, T, H + 2*Hkv, D)."""
    b, t, _ = x.shape
    qkv = F.linear(rms_norm(x, norm, eps), qkv_weight, qkv_bias).view(b, t, heads + 2 * kv_heads, head_dim)
    q, k, v = qkv.split((heads, kv_heads, kv_heads), dim=2)
    if q_norm is not None and k_norm is not None:
        q, k = rms_norm(q, q_norm, eps), rms_norm(k, k_norm, eps)
    return torch.cat((apply_rope(torch.cat((q, k), dim=2), cos, sin), v), dim=2)


def mlp_block(x: torch.Tensor, attended: torch.Tensor, o_weight: torch.Tensor, norm: torch.Tensor, eps: float,
              gate_up_weight: torch.Tensor, down_weight: torch.Tensor) -> torch.Tensor:
    """The rest of the layer: x (B, T, E) plus the output projection of attended (B, T, H*D), plus the SwiGLU MLP
    of that normed. Returns (B, T, E)."""
    x = x + F.linear(attended, o_weight)
    gate, up = F.linear(rms_norm(x, norm, eps), gate_up_weight).chunk(2, dim=-1)
    return x + F.linear(F.silu(gate) * up, down_weight)


# graphs each function may keep: it serves every layer of every model an engine runs (the target, a draft, EAGLE's
# head), and per model a batch of one row and a width of one token are each specialised, each shape first compiled
# static and then generalised: more than dynamo's default of 8 for a batching engine with a draft, and with
# fullgraph, running out is a hard error
GRAPHS = 64


@functools.cache
def compiled() -> tuple:
    """The two functions compiled, once per process (the compiler's work happens at their first calls); raises
    dynamo's process-wide recompile limit to GRAPHS where it is lower."""
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, GRAPHS)
    return torch.compile(attention_in, fullgraph=True), torch.compile(mlp_block, fullgraph=True)


def layer(block: Block, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cache: KVCache,
          layout: AttentionLayout, attend: Attend) -> torch.Tensor:
    """`Block.forward` with its work around attention compiled: x (B, T, E) -> (B, T, E)."""
    attn, mlp = block.self_attn, block.mlp
    h, hkv, d = attn.num_heads, attn.num_kv_heads, attn.head_dim
    first, rest = compiled()
    q_norm, k_norm = ((None, None) if attn.q_norm is None or attn.k_norm is None
                      else (attn.q_norm.weight, attn.k_norm.weight))
    qkv = first(x, block.input_layernorm.weight, block.input_layernorm.eps, attn.qkv_proj.weight, attn.qkv_proj.bias,
                q_norm, k_norm, cos, sin, h, hkv, d)  # (B, T, H + 2*Hkv, D)
    attended = attn.attend(qkv[:, :, : h + hkv], qkv[:, :, h + hkv :], cache, layout, attend)  # (B, T, H*D)
    norm = block.post_attention_layernorm
    return rest(x, attended, attn.o_proj.weight, norm.weight, norm.eps, mlp.gate_up_proj.weight,
                mlp.down_proj.weight)
