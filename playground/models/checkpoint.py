"""A Hugging Face Llama-family checkpoint's tensor names in this project's (`transformer.Transformer`): q, k and v
stacked as one product, gate and up as another."""

from __future__ import annotations

from collections.abc import Mapping

import torch

from .transformer import TransformerConfig, UnsupportedModelError


def hf_state_to_native(cfg: TransformerConfig, tensors: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Rename a Hugging Face Llama-family state dict to `Transformer`'s names, fusing qkv and gate/up."""
    def get(name: str) -> torch.Tensor:
        if name not in tensors:
            raise UnsupportedModelError(f"model: checkpoint has no tensor {name!r}")
        return tensors[name]

    out = {"embed_tokens.weight": get("model.embed_tokens.weight"), "norm.weight": get("model.norm.weight")}
    if not cfg.tie_word_embeddings:
        out["lm_head.weight"] = get("lm_head.weight")
    for i in range(cfg.num_layers):
        src, dst = f"model.layers.{i}.", f"layers.{i}."
        attn = src + "self_attn."
        for name, parts in layer_products(i).items():  # a product of one part keeps its tensor (no copy)
            out[name] = get(parts[0]) if len(parts) == 1 else torch.cat([get(part) for part in parts], dim=0)
        if cfg.qkv_bias:
            out[dst + "self_attn.qkv_proj.bias"] = torch.cat([get(attn + f"{p}_proj.bias") for p in "qkv"])
        if cfg.qk_norm:
            out[dst + "self_attn.q_norm.weight"] = get(attn + "q_norm.weight")
            out[dst + "self_attn.k_norm.weight"] = get(attn + "k_norm.weight")
        out[dst + "input_layernorm.weight"] = get(src + "input_layernorm.weight")
        out[dst + "post_attention_layernorm.weight"] = get(src + "post_attention_layernorm.weight")
    return out


def layer_products(i: int) -> dict[str, list[str]]:
    """Layer i's matrix products by `Transformer`'s names, each with the Hugging Face weights whose rows it stacks."""
    src, dst = f"model.layers.{i}.", f"layers.{i}."
    return {dst + "self_attn.qkv_proj.weight": [src + f"self_attn.{p}_proj.weight" for p in "qkv"],
            dst + "self_attn.o_proj.weight": [src + "self_attn.o_proj.weight"],
            dst + "mlp.gate_up_proj.weight": [src + "mlp.gate_proj.weight", src + "mlp.up_proj.weight"],
            dst + "mlp.down_proj.weight": [src + "mlp.down_proj.weight"]}
