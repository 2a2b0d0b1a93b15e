"""A native decoder-only transformer for the Llama family (Llama 2/3, Mistral, Qwen2, Qwen3, SmolLM2).

Native rather than a wrapper around `transformers` so that the KV layout, tree masks and positions are ours.
The module holds weights only; the KV cache and the attention layout are passed in on every call.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from functools import partial
from typing import Any, cast

import torch
import torch.nn.functional as F
from torch import nn

from ..kv import AttentionLayout, KVCache
from . import native
from .linear import Linear, can_pack, linear, pack

SUPPORTED_ARCHITECTURES = ("llama", "mistral", "qwen2", "qwen3")
# RoPE variants whose frequencies do not depend on the sequence length; transformers computes them for us.
STATIC_ROPE_TYPES = ("default", "linear", "llama3", "yarn")
# One forward's attention: (q (B, Hkv, G*T, D), keys (B, Hkv, L, D), values (B, Hkv, L, D)) -> (B, Hkv, G*T, D).
Attend = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]
# A block's forward run another way: (block, x, cos, sin, cache, layout, attend) -> x, as `Block.forward`.
Layer = Callable[..., torch.Tensor]


# config.json's sizes the model is built from; the optional ones default to hidden_size / num_attention_heads and
# num_attention_heads
SIZES = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
         "num_key_value_heads", "max_position_embeddings", "head_dim")
OPTIONAL_SIZES = ("num_key_value_heads", "head_dim")
MAX_SIZE = 1 << 24


class UnsupportedModelError(ValueError):
    """The checkpoint is not a Llama-family decoder this module implements."""


def check_sizes(config: dict[str, Any], required: bool) -> None:
    """config.json's sizes (`SIZES`) are positive integers, or nothing can be built from them (transformers itself
    divides by some of them). required: the ones not in OPTIONAL_SIZES must be there (once the architecture is
    known to be supported); else only those given are checked."""
    for name in SIZES:
        value = config.get(name)
        if value is None and (not required or name in OPTIONAL_SIZES):
            continue
        if isinstance(value, bool) or not isinstance(value, int) or not 0 < value <= MAX_SIZE:
            raise UnsupportedModelError(f"model: config.json {name} must be an integer in [1, {MAX_SIZE}], "
                                        f"got {str(value)[:40]}")


@dataclass(frozen=True, slots=True)
class TransformerConfig:
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool  # Qwen2
    qk_norm: bool  # Qwen3: RMSNorm over head_dim on q and k before RoPE
    sliding_window: int | None  # Mistral; longer sequences are refused rather than attended wrongly

    def __post_init__(self) -> None:
        if self.num_heads % self.num_kv_heads:
            raise UnsupportedModelError(
                f"model: config.json num_attention_heads ({self.num_heads}) must be a multiple of num_key_value_heads "
                f"({self.num_kv_heads})")

    @classmethod
    def from_hf(cls, hf_config: Any) -> TransformerConfig:
        model_type = getattr(hf_config, "model_type", None)
        if model_type not in SUPPORTED_ARCHITECTURES:
            raise UnsupportedModelError(
                f"model: architecture {model_type!r} is not supported; supported: "
                f"{', '.join(SUPPORTED_ARCHITECTURES)} (Llama 2/3, Mistral, Qwen2, Qwen3, SmolLM2)")
        check_sizes({name: getattr(hf_config, name, None) for name in SIZES}, required=True)
        num_heads = hf_config.num_attention_heads
        kv_heads = getattr(hf_config, "num_key_value_heads", None) or num_heads
        head_dim = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // num_heads
        if not head_dim:
            raise UnsupportedModelError(f"model: config.json hidden_size ({hf_config.hidden_size}) is smaller than "
                                        f"num_attention_heads ({num_heads})")
        sliding = getattr(hf_config, "sliding_window", None)
        if model_type in ("qwen2", "qwen3") and not getattr(hf_config, "use_sliding_window", False):
            sliding = None
        return cls(
            model_type=model_type,
            vocab_size=hf_config.vocab_size,
            hidden_size=hf_config.hidden_size,
            intermediate_size=hf_config.intermediate_size,
            num_layers=hf_config.num_hidden_layers,
            num_heads=num_heads,
            num_kv_heads=kv_heads,
            head_dim=head_dim,
            rms_norm_eps=float(hf_config.rms_norm_eps),
            max_position_embeddings=hf_config.max_position_embeddings,
            tie_word_embeddings=bool(getattr(hf_config, "tie_word_embeddings", False)),
            qkv_bias=model_type == "qwen2" or bool(getattr(hf_config, "attention_bias", False)),
            qk_norm=model_type == "qwen3",
            sliding_window=sliding,
        )


def rope_frequencies(hf_config: Any) -> tuple[torch.Tensor, float]:
    """Inverse frequencies (D/2,) and the cos/sin scale of the checkpoint's RoPE variant."""
    params = dict(getattr(hf_config, "rope_parameters", None) or {})
    rope_type = params.get("rope_type", "default")
    if rope_type not in STATIC_ROPE_TYPES:
        raise UnsupportedModelError(
            f"model: RoPE type {rope_type!r} is not supported; supported: {', '.join(STATIC_ROPE_TYPES)}")
    if rope_type == "default":
        theta = float(params.get("rope_theta", getattr(hf_config, "rope_theta", 10000.0)))
        dim = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // hf_config.num_attention_heads
        inv_freq = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
        return inv_freq, 1.0
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    inv_freq, scale = ROPE_INIT_FUNCTIONS[rope_type](hf_config, torch.device("cpu"))
    return inv_freq.float(), float(scale)


class RMSNorm(nn.Module):
    # the native kernel, set by `Transformer.pack_linears` where it serves this weight
    kernel: native.Kernel | None = None

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.kernel is not None and x.dtype == torch.float32 and not torch.is_grad_enabled():
            return native.rms_norm(self.kernel, x, self.weight, self.eps)
        return rms_norm(x, self.weight, self.eps)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over the last dimension in PyTorch's ops; in 16 bits normalised in float32 and scaled in the model
    dtype, as the reference implementation does."""
    if x.dtype == torch.float32:
        return F.rms_norm(x, (x.shape[-1],), weight, eps)
    return weight * F.rms_norm(x.float(), (x.shape[-1],), eps=eps).to(x.dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin_signed: torch.Tensor) -> torch.Tensor:
    """x * cos + rotate_half(x) * sin, where rotate_half(x) = cat(-x2, x1) = roll(x, D/2) * cat(-1, +1).

    The sign lives in `sin_signed` (= cat(-sin, sin) per half), so one roll replaces two slices, a negation
    and a concatenation; the products are bit-identical to the reference formula.
    """
    return x * cos + x.roll(x.shape[-1] // 2, dims=-1) * sin_signed


class Attention(nn.Module):
    def __init__(self, cfg: TransformerConfig, layer: int) -> None:
        super().__init__()
        self.layer = layer
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        # q, k and v in one matrix: one weight read and one kernel launch instead of three.
        self.qkv_proj = Linear(cfg.hidden_size, (cfg.num_heads + 2 * cfg.num_kv_heads) * cfg.head_dim,
                                  bias=cfg.qkv_bias)
        self.o_proj = Linear(cfg.num_heads * cfg.head_dim, cfg.hidden_size, bias=False)
        self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cache: KVCache,
                layout: AttentionLayout, attend: Attend) -> torch.Tensor:
        b, t, _ = x.shape
        h, hkv, d = self.num_heads, self.num_kv_heads, self.head_dim
        qkv = self.qkv_proj(x).view(b, t, h + 2 * hkv, d)  # (B, T, H + 2*Hkv, D)
        if self.q_norm is not None and self.k_norm is not None:
            qk = torch.cat((self.q_norm(qkv[:, :, :h]), self.k_norm(qkv[:, :, h : h + hkv])), dim=2)
        else:
            qk = qkv[:, :, : h + hkv]
        qk = apply_rope(qk, cos, sin)  # q and k rotated together: (B, T, H + Hkv, D)
        return self.o_proj(self.attend(qk, qkv[:, :, h + hkv :], cache, layout, attend))

    def attend(self, qk: torch.Tensor, v: torch.Tensor, cache: KVCache, layout: AttentionLayout,
               attend: Attend) -> torch.Tensor:
        """Store the new keys and values and attend: qk (B, T, H + Hkv, D) rotated queries and keys, v (B, T, Hkv,
        D). Returns (B, T, H*D), before the output projection."""
        b, t = qk.shape[:2]
        h, hkv, d = self.num_heads, self.num_kv_heads, self.head_dim
        k, v = qk[:, :, h:].transpose(1, 2), v.transpose(1, 2)  # (B, Hkv, T, D)
        keys, values = cache.update(self.layer, layout, k, v)  # (B, Hkv, L, D)
        # Grouped-query attention without copying K/V: the G query heads sharing a KV head become G*T rows.
        q = qk[:, :, :h].transpose(1, 2).reshape(b, hkv, (h // hkv) * t, d)  # (B, Hkv, G*T, D)
        out = attend(q, keys, values)  # (B, Hkv, G*T, D)
        # reshape, not view: GPU attention kernels may return (B, Hkv, G*T, D) with permuted strides.
        return out.reshape(b, h, t, d).transpose(1, 2).reshape(b, t, h * d)  # (B, T, H*D)


class MLP(nn.Module):
    def __init__(self, cfg: TransformerConfig) -> None:
        super().__init__()
        self.intermediate = cfg.intermediate_size
        self.gate_up_proj = Linear(cfg.hidden_size, 2 * cfg.intermediate_size, bias=False)
        self.down_proj = Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).split(self.intermediate, dim=-1)  # SwiGLU: silu(gate) * up
        return self.down_proj(F.silu(gate) * up)


class Block(nn.Module):
    # the native kernel, set by `Transformer.pack_linears` where it can run this layer's halves (see `fusable`)
    kernel: native.Kernel | None = None

    def __init__(self, cfg: TransformerConfig, layer: int) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg, layer)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)

    def fusable(self) -> bool:
        """Whether the native kernel can run the work around attention: every product packed for it, both norms
        served by it, no q/k norms (Qwen3), a head that fits its RoPE buffer."""
        attn, mlp = self.self_attn, self.mlp
        products = (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj)
        # bitsandbytes layers (int8, nf4) have no packed weight
        return (all(isinstance(getattr(p, "packed", None), native.Panels) for p in products)
                and attn.o_proj.bias is None
                and self.input_layernorm.kernel is not None and self.post_attention_layernorm.kernel is not None
                and attn.q_norm is None and attn.head_dim % 2 == 0
                and attn.head_dim <= native.MAX_HEAD_VECTORS * self.input_layernorm.kernel.vector_width)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cache: KVCache,
                layout: AttentionLayout, attend: Attend) -> torch.Tensor:
        """x (B, T, E) -> (B, T, E). Through the native kernel (float32, no gradients) x must be the forward's own
        contiguous residual stream: it is updated in place and returned."""
        if self.kernel is not None and x.dtype == torch.float32 and not torch.is_grad_enabled():
            return self.fused_forward(x, cos, sin, cache, layout, attend)
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, cache, layout, attend)
        return x + self.mlp(self.post_attention_layernorm(x))

    def fused_forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cache: KVCache,
                      layout: AttentionLayout, attend: Attend) -> torch.Tensor:
        """The same layer in two native calls around attention: on a 2-core CPU the ~20 PyTorch ops between the
        products of a layer cost more than its attention."""
        attn, mlp, kernel = self.self_attn, self.mlp, self.kernel
        assert kernel is not None  # `forward` checked it
        b, t, _ = x.shape
        h, hkv, d = attn.num_heads, attn.num_kv_heads, attn.head_dim
        norm = self.input_layernorm
        qkv = native.attention_in(kernel, x, norm.weight, norm.eps, panels(attn.qkv_proj), attn.qkv_proj.bias, cos,
                                  sin, h + hkv, d).view(b, t, h + 2 * hkv, d)  # (B, T, H + 2*Hkv, D), q, k rotated
        out = attn.attend(qkv[:, :, : h + hkv], qkv[:, :, h + hkv :], cache, layout, attend)  # (B, T, H*D)
        norm = self.post_attention_layernorm
        native.mlp_block(kernel, x, out, panels(attn.o_proj), norm.weight, norm.eps, panels(mlp.gate_up_proj),
                         panels(mlp.down_proj))
        return x


def panels(product: Linear) -> native.Panels:
    """A product's weights as the native kernel packed them (`Block.fusable` checked every one of a fused layer's)."""
    assert isinstance(product.packed, native.Panels)
    return product.packed


class Transformer(nn.Module):
    def __init__(self, cfg: TransformerConfig, inv_freq: torch.Tensor, rope_scale: float = 1.0) -> None:
        super().__init__()
        self.config = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(Block(cfg, i) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = None if cfg.tie_word_embeddings else Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.register_buffer("inv_freq", inv_freq, persistent=False)  # (D/2,)
        self.rope_scale = rope_scale
        self.packed_output: native.Panels | torch.Tensor | None = None  # output projection, see pack_linears
        # its GGUF blocks (format, (V, bytes) uint8) if packed from them (see vocab)
        self.output_blocks: tuple[str, torch.Tensor] | None = None
        self.integer_products = False  # whether the products read GGUF blocks against 8-bit activations
        self.native_attention = True  # False: PyTorch's attention where the kernel would serve (forward_costs.py)
        # every layer's weights for one native call per forward (see pack_linears); None runs layer by layer
        self.native_stack: native.LayerStack | None = None
        # static forwards' shapes (cache storage, CUDA graphs) no cache is using, by cache shape (`models.forwards`)
        self.static_shelf: dict[tuple, list] = {}

    @property
    def blocks(self) -> list[Block]:
        """The decoder layers (`layers`), typed."""
        return cast(list[Block], list(self.layers))

    @property
    def output_weight(self) -> torch.Tensor:
        return self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight  # (V, E)

    @property
    def device(self) -> torch.device:
        return self.embed_tokens.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.embed_tokens.weight.dtype

    @property
    def rows_per_pass(self) -> int | None:
        """Tokens a forward's matrix products serve per pass over the weights when the native CPU kernel runs
        them (see `native.Kernel`); None where PyTorch's kernels do (GPU, quantised or unpacked weights)."""
        packed = self.blocks[0].self_attn.qkv_proj.packed if len(self.layers) else None
        return packed.kernel.rows_per_pass if isinstance(packed, native.Panels) else None

    def packed_products(self) -> list[tuple[torch.Tensor, native.Panels]]:
        """Every matrix product the native kernel runs for this model, as (weight, its panels), each once: the
        linears' and the output projection's (which a tied embedding has no linear for); empty where PyTorch's
        kernels run them."""
        pairs = [(module.weight, module.packed) for module in self.modules()
                 if isinstance(module, Linear) and isinstance(module.packed, native.Panels)]
        if isinstance(self.packed_output, native.Panels) and all(p is not self.packed_output for _, p in pairs):
            pairs.append((self.output_weight, self.packed_output))
        return pairs

    def formats_read(self) -> str:
        """What its matrix products read, in words (`native.formats_read`)."""
        return native.formats_read([panels for _, panels in self.packed_products()])

    def rope(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and signed sin (see `apply_rope`), each (B, T, 1, D) to broadcast over heads."""
        freqs = positions.unsqueeze(-1).float() * cast(torch.Tensor, self.inv_freq)  # (B, T, D/2)
        cos = torch.cat((freqs, freqs), dim=-1).cos() * self.rope_scale  # (B, T, D)
        sin = freqs.sin() * self.rope_scale  # (B, T, D/2)
        sin_signed = torch.cat((-sin, sin), dim=-1)  # (B, T, D)
        return cos.to(dtype).unsqueeze(2), sin_signed.to(dtype).unsqueeze(2)

    def check_window(self, key_len: int) -> None:
        """Refuse a sequence longer than a sliding window (Mistral) rather than attend over it wrongly."""
        window = self.config.sliding_window
        if window is not None and key_len > window:
            raise ValueError(f"sequence of {key_len} tokens exceeds the model's sliding window ({window}); "
                             "sliding-window attention is not implemented")

    def attention_kernel(self) -> native.Kernel | None:
        """The native kernel where its attention serves this forward (float32 on a CPU that built it, no gradients:
        it has no backward), else None."""
        kernel = native.kernel() if self.native_attention and self.device.type == "cpu" else None
        if (kernel is not None and not torch.is_grad_enabled()
                and kernel.attends(self.config.head_dim, self.dtype, self.device)):
            return kernel
        return None

    def attention(self, layout: AttentionLayout) -> Attend:
        """How this forward's layers attend, decided once: the native kernel where it serves, which gives a token
        the same bits in any forward; else PyTorch's attention with the visibility as an additive mask."""
        cfg = self.config
        b, t, key_len = len(layout.seq_ids), layout.num_new, layout.key_len
        mask = layout.mask  # (B, 1, T, L) bool, or None: every key visible
        kernel = self.attention_kernel()
        if kernel is not None:
            return partial(native.attention, kernel, visible=None if mask is None else mask[:, 0], new_tokens=t)
        if mask is not None:
            # Additive, built once: attention would convert a boolean mask to this form on every call, 30 per forward.
            mask = torch.zeros(mask.shape, dtype=self.dtype, device=mask.device).masked_fill_(~mask, float("-inf"))
            group = cfg.num_heads // cfg.num_kv_heads
            mask = mask.unsqueeze(2).expand(b, 1, group, t, key_len).reshape(b, 1, group * t, -1)  # (B, 1, G*T, L)
        return partial(F.scaled_dot_product_attention, attn_mask=mask)

    def project(self, hidden: torch.Tensor) -> torch.Tensor:
        """Output logits (..., V) in float32 for hidden states (..., E)."""
        return linear(hidden, self.output_weight, packed=self.packed_output).float()  # (..., V)

    def pack_like_own(self, weight: torch.Tensor) -> native.Panels | torch.Tensor | None:
        """A prepacked copy of `weight` (out, in) for a product run beside this model's own (reduced output rows,
        Medusa blocks): packed where the model packed its weights and `weight` can be, else None; quantised to Q8_0
        blocks for integer products where the model's products are integer ones."""
        return self._pack_own(weight) if self.packed_output is not None and can_pack(weight) else None

    def serve_like_own(self, module: nn.Module) -> None:
        """Run `module` (an EAGLE head beside this model) as this model runs its own layers: where the model packed
        its weights, `module`'s products prepacked (as `pack_like_own` packs them) and its norms and decoder layers
        in the native kernel where it serves them; else unchanged."""
        if self.packed_output is not None:
            _serve(module, native.kernel(), lambda name, weight: self._pack_own(weight))

    def _pack_own(self, weight: torch.Tensor) -> native.Panels | torch.Tensor:
        kernel = native.kernel()
        if self.integer_products and kernel is not None and weight.shape[1] % native.BLOCK == 0:
            return native.pack_blocks(native.quantise_q8_0(weight), "Q8_0", weight.shape[1], kernel, integer=True)
        return pack(weight)

    def pack_linears(self, blocks: Mapping[str, list[tuple[str, torch.Tensor]]] | None = None,
                     integer: bool = False, quantise: bool = False) -> None:
        """Prepack every float32 CPU weight of a matrix product (see `pack`) and hand the native kernel to the
        norms it serves; the model must stay on its device and keep its weights afterwards. Costs a second copy of
        those weights in memory (half of one for weights exactly 16-bit, see `native.pack_panels`). A weight named
        in `blocks` (its rows' parts, each (format, GGUF blocks)) is packed from them (`native.pack_parts`), for
        integer products on 8-bit activations where `integer`; with `quantise` (and `integer`), every other weight
        whose inputs come in blocks of 32 is quantised to Q8_0 blocks first (a proposer beside such a target)."""
        kernel = native.kernel()
        blocks = dict(blocks) if blocks and kernel is not None and (integer or kernel.gguf) else {}
        quantise = quantise and integer and kernel is not None
        self.integer_products = integer and (bool(blocks) or quantise)

        def packed(name: str, weight: torch.Tensor) -> native.Panels | torch.Tensor:
            if quantise and name not in blocks and weight.shape[1] % native.BLOCK == 0:
                blocks[name] = [("Q8_0", native.quantise_q8_0(weight))]
            if name in blocks:
                assert kernel is not None  # `blocks` is empty without one
                return native.pack_parts(blocks[name], weight.shape[1], kernel, integer)
            return pack(weight)

        _serve(self, kernel, packed)
        if kernel is not None and self.layers and all(block.kernel is not None for block in self.blocks):
            cfg = self.config
            self.native_stack = native.layer_stack(kernel, [
                (b.input_layernorm.weight, panels(b.self_attn.qkv_proj), b.self_attn.qkv_proj.bias,
                 panels(b.self_attn.o_proj), b.post_attention_layernorm.weight, panels(b.mlp.gate_up_proj),
                 panels(b.mlp.down_proj)) for b in self.blocks], cfg.num_heads, cfg.num_kv_heads, cfg.head_dim,
                cfg.rms_norm_eps)
        if can_pack(self.output_weight):
            self.packed_output = (self.lm_head.packed if self.lm_head is not None
                                  else packed("embed_tokens.weight", self.output_weight))
            output = blocks.get("embed_tokens.weight" if self.lm_head is None else "lm_head.weight")
            self.output_blocks = output[0] if output else None  # one part: the output rows are one matrix

    def forward(
        self,
        token_ids: torch.Tensor,
        positions: torch.Tensor,
        cache: KVCache,
        seq_ids: tuple[int, ...] | list[int],
        attn_mask: torch.Tensor | None = None,
        num_logits: int | None = None,
        layout: AttentionLayout | None = None,
        layer: Layer | None = None,
        taps: tuple[int, ...] = (),
        skip: frozenset[int] = frozenset(),
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Run T new tokens per row through the model and store their K/V.

        token_ids, positions: (B, T) int64; positions feed RoPE only (tree nodes share depths).
        attn_mask: (T, T) or (B, T, T) bool visibility among the new tokens; None means causal.
        num_logits: compute logits for the last n tokens only (prefill needs one); 0 computes none, for a caller
        that scores the hidden states itself (see models.vocab).
        layout: where the tokens are written and read, made by the caller instead of `cache.prepare` (the static
        shapes of `models.forwards`, whose tensors stay the same from call to call); seq_ids and attn_mask unused.
        layer: with a static layout, what runs each block that the native kernel does not (`models.compiled.layer`);
        None runs the block.
        taps: layers whose input (the residual stream entering them) is returned beside the final-norm states.
        skip: layers not run (a target drafting with its other layers, `decoding.self_speculative`): the residual
        stream passes them by and they store no K/V.
        Returns logits (B, T or n, V) float32 and final-norm hidden states (B, T, E), followed along the last
        dimension by the tapped layers' inputs in the order of `taps`: (B, T, (1 + len(taps)) E).
        """
        b, t = token_ids.shape
        cfg = self.config
        static = layout is not None
        if layout is None:  # a static layout pads its keys: its caller checks the real length
            layout = cache.prepare(tuple(seq_ids), t, attn_mask)
            self.check_window(layout.key_len)
        x = self.embed_tokens(token_ids)  # (B, T, E), a new tensor: fused layers update it in place
        cos, sin = self.rope(positions, x.dtype)
        native_ready = not static and self.native_stack is not None and self.attention_kernel() is not None
        slabs = cache.contiguous_rows(layout) if native_ready else None
        pools = cache.slot_pools(layout) if native_ready and slabs is None else None
        tapped: dict[int, torch.Tensor] = {}  # layer -> its input (B, T, E)
        if slabs is not None or pools is not None:
            stack = self.native_stack
            assert stack is not None  # `native_ready`
            mask = layout.mask  # (B, 1, T, L) bool, or None: every key visible
            keys, values = slabs or cast(tuple[torch.Tensor, torch.Tensor], pools)  # (layers, ...) each
            slots = None if pools is None else cast(tuple[torch.Tensor, torch.Tensor],
                                                    (layout.write_slots, layout.read_slots))  # a pool's own
            # one native call per run of layers between taps and skipped layers (a skipped layer is a run alone)
            cuts = sorted({0, cfg.num_layers, *taps, *skip, *(i + 1 for i in skip)})
            for first, end in zip(cuts, cuts[1:]):
                if first in taps:
                    tapped[first] = x.clone()  # the native call updates x in place
                if first in skip:
                    continue
                native.layers(stack.part(first, end) if len(cuts) > 2 else stack, x, cos, sin,
                              keys[first:end], values[first:end], layout.starts, layout.key_len,
                              None if mask is None else mask[:, 0], slots)
        else:
            attend = self.attention(layout)
            for i, block in enumerate(self.blocks):
                if i in taps:
                    tapped[i] = x.clone()  # fused layers update x in place
                if i in skip:
                    continue
                if layer is not None and static and block.kernel is None:
                    x = layer(block, x, cos, sin, cache, layout, attend)
                else:
                    x = block(x, cos, sin, cache, layout, attend)
        hidden = self.norm(x)  # (B, T, E)
        logits = hidden.new_empty(b, 0, cfg.vocab_size, dtype=torch.float32)
        if num_logits != 0:
            logits = self.project(hidden if num_logits is None else hidden[:, -num_logits:])  # (B, T or n, V)
        if taps:
            hidden = torch.cat([hidden, *(tapped[i] for i in taps)], -1)  # (B, T, (1 + len(taps)) E)
        return logits, hidden


def _serve(module: nn.Module, kernel: native.Kernel | None,
           packed: Callable[[str, torch.Tensor], native.Panels | torch.Tensor]) -> None:
    """Prepack every float32 CPU weight of `module`'s matrix products (packed(name, weight)), and hand `kernel` to
    the norms it serves and to the decoder layers it can then run whole (`Block.fusable`)."""
    for name, sub in module.named_modules():
        if isinstance(sub, Linear) and can_pack(sub.weight):
            sub.packed = packed(f"{name}.weight", sub.weight)
        if isinstance(sub, RMSNorm) and kernel is not None and kernel.normalises(sub.weight):
            sub.kernel = kernel
    for block in module.modules():
        if isinstance(block, Block):
            block.kernel = kernel if kernel is not None and block.fusable() else None
