"""The EAGLE head (Li et al. 2024): a draft that reads the target's own features.

At position t the head reads f_t, the target's final hidden state there, and the embedding of the token x_{t+1}
drawn from it; an FC layer mixes the two and one decoder layer of the target's kind (with its own keys and values
over the positions before) predicts f_{t+1}, which the target's frozen output projection reads as the next token's
distribution. Drafting runs the head on its own predicted features: (f^_{t+1}, x^_{t+2}) -> f^_{t+2}, and so on.
A head may read the target's low, middle and high layers instead of f_t (as EAGLE-3, Li et al. 2025): the residual
stream entering each of its `taps`, each scaled to unit RMS at each position, mixed by a learned linear map into one
feature; it then learns the next tokens only, and deeper drafting reads its own predictions as it reads that mix.
The head scores a reduced vocabulary (the target's output rows for the tokens it writes), as the draft and the
Medusa heads do. Stored as safetensors plus config.json beside them (never pickled).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from functools import partial
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import load_file
from torch import nn

from . import native
from .linear import Linear
from .loader import LoadedModel, ModelLoadError
from .transformer import Block, RMSNorm, Transformer, TransformerConfig
from .vocab import VOCAB_IDS, OutputRows, check_vocab_ids, output_rows, save_with_vocab

EMBEDDED_EAGLE = Path(__file__).resolve().parents[2] / "assets" / "eagle-smollm2-135m"
WEIGHTS, CONFIG = "eagle.safetensors", "config.json"
FEATURES = "final-norm hidden state"  # what a head without taps reads and predicts, recorded in config.json
TAPPED = "inputs of the tapped layers, each scaled to unit RMS, mixed"  # what a head with taps reads


class _PastKeys:
    """What a head forward attends over: the first L keys and values of the storage given (B, Hkv, L', D), and the
    forward's own, which it keeps (`k`, `v`) for the caller to store. Where the storage has room (L' >= L + T) the
    forward's own are written into it at [L, L + T), else joined to a copy. Stands in for a KV cache in the layer's
    attention."""

    def __init__(self, k: torch.Tensor, v: torch.Tensor, length: int) -> None:
        self.past_k, self.past_v, self.length = k, v, length
        self.k = self.v = k[:, :, :0]

    def update(self, layer: int, layout: object, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        n, end = self.length, self.length + k.shape[2]
        if self.past_k.shape[2] >= end:
            self.past_k[:, :, n:end], self.past_v[:, :, n:end] = k, v
            self.k, self.v = self.past_k[:, :, n:end], self.past_v[:, :, n:end]  # (B, Hkv, T, D)
            return self.past_k[:, :, :end], self.past_v[:, :, :end]  # (B, Hkv, L + T, D)
        self.k, self.v = k, v
        return torch.cat((self.past_k[:, :, :n], k), 2), torch.cat((self.past_v[:, :, :n], v), 2)


class EagleHead(nn.Module):
    """fc([e(x_{t+1}); f_t]) -> one decoder layer -> RMSNorm: the predicted f_{t+1} (final-norm, as the target's).
    With `taps`, f_t is `read` from the tapped layers' inputs."""

    def __init__(self, config: TransformerConfig, taps: tuple[int, ...] = ()) -> None:
        super().__init__()
        self.config, self.taps = config, taps
        self.fc = Linear(2 * config.hidden_size, config.hidden_size, bias=False)
        self.layer = Block(config, 0)
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mix = Linear(len(taps) * config.hidden_size, config.hidden_size, bias=False) if taps else None

    def read(self, hidden: torch.Tensor) -> torch.Tensor:
        """The feature f_t (..., E) the head reads from the target's hidden states (..., (1 + len(taps)) E): the
        final-norm state, or the tapped layers' inputs scaled and mixed."""
        e = self.config.hidden_size
        if self.mix is None:
            return hidden[..., :e]
        layers = hidden[..., e:].unflatten(-1, (len(self.taps), e)).float()  # (..., taps, E)
        scaled = layers * layers.pow(2).mean(-1, keepdim=True).add(self.config.rms_norm_eps).rsqrt()
        return self.mix(scaled.flatten(-2).to(hidden.dtype))  # (..., E)

    def forward(self, embeddings: torch.Tensor, features: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                past_k: torch.Tensor, past_v: torch.Tensor,
                visible: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Predicted features (B, T, E) for T new positions, and their keys and values (B, Hkv, T, D).

        embeddings, features: (B, T, E) the next tokens' input embeddings and the features before them; cos, sin:
        the target's RoPE at the new positions (`Transformer.rope`); visible: (B, T, L + T) bool, which keys each new
        position sees; past_k, past_v: (B, Hkv, L', D) storage whose first L places hold the keys and values before,
        L' >= L; where L' >= L + T the new keys and values are written at [L, L + T) (no copy; the storage must not
        need gradients)."""
        cfg = self.config
        x = self.fc(torch.cat((embeddings, features), dim=-1))  # (B, T, E)
        b, t, _ = x.shape
        kernel = self.layer.kernel  # set where the target's native kernel runs this layer (`serve_like_own`)
        if kernel is not None and not torch.is_grad_enabled() and kernel.attends(cfg.head_dim, x.dtype, x.device):
            attend = partial(native.attention, kernel, visible=visible, new_tokens=t)
        else:
            group = cfg.num_heads // cfg.num_kv_heads
            additive = torch.zeros(visible.shape, dtype=x.dtype, device=x.device).masked_fill_(~visible, -torch.inf)
            additive = additive.unsqueeze(1).expand(b, group, t, -1).reshape(b, 1, group * t, -1)  # (B, 1, G*T, L+T)
            attend = partial(F.scaled_dot_product_attention, attn_mask=additive)
        keys = _PastKeys(past_k, past_v, visible.shape[2] - t)
        x = self.layer(x, cos, sin, keys, None, attend)
        return self.norm(x), keys.k, keys.v


@dataclass(frozen=True)
class LoadedEagle:
    head: EagleHead
    folder: Path
    target_name: str
    output: OutputRows  # the target's output projection rows for the token ids the head scores

    @property
    def vocab_ids(self) -> torch.Tensor:
        return self.output.ids  # (V',) int64 ascending

    def empty_keys(self, room: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Storage for keys and values (Hkv, room, D), in the head's device and dtype."""
        cfg, weight = self.head.config, self.head.fc.weight
        shape = (cfg.num_kv_heads, room, cfg.head_dim)
        return weight.new_zeros(shape), weight.new_zeros(shape)


def head_config(target: Transformer) -> TransformerConfig:
    """The target's layer shape for the head's one layer."""
    return replace(target.config, num_layers=1)


def save_head(head: EagleHead, folder: Path, target: LoadedModel, dtype: torch.dtype, vocab_ids: torch.Tensor) -> None:
    """Weights in `dtype` plus the (V',) token ids the head scores, and config.json."""
    folder.mkdir(parents=True, exist_ok=True)
    save_with_vocab(head, str(folder / WEIGHTS), dtype, vocab_ids)
    cfg = target.model.config
    config = {"features": TAPPED if head.taps else FEATURES, **({"taps": list(head.taps)} if head.taps else {}),
              "hidden_size": cfg.hidden_size, "num_heads": cfg.num_heads,
              "num_kv_heads": cfg.num_kv_heads, "head_dim": cfg.head_dim,
              "intermediate_size": cfg.intermediate_size, "vocab_size": cfg.vocab_size,
              "head_vocab_size": len(vocab_ids), "target": target.name}
    (folder / CONFIG).write_text(json.dumps(config, indent=2))


def default_head(target_source: str) -> str | None:
    """The shipped head for a target spec, if the project has one."""
    if target_source == "embedded" and (EMBEDDED_EAGLE / WEIGHTS).is_file():
        return str(EMBEDDED_EAGLE)
    return None


def read_head(folder: Path, target: LoadedModel) -> tuple[EagleHead, torch.Tensor, str]:
    """A head's float32 weights from a folder (config.json + eagle.safetensors), checked against the target's shape,
    the (V',) token ids it scores and the name of the target it was trained for."""
    if not (folder / WEIGHTS).is_file() or not (folder / CONFIG).is_file():
        raise ModelLoadError(f"eagle head: {str(folder)!r} is not a folder with {CONFIG} and {WEIGHTS}")
    try:
        config = json.loads((folder / CONFIG).read_text())
        shape = {name: int(config[name]) for name in ("hidden_size", "num_heads", "num_kv_heads", "head_dim",
                                                       "intermediate_size", "vocab_size")}
        taps = tuple(int(layer) for layer in config.get("taps", ()))
    except (ValueError, KeyError, TypeError) as exc:
        raise ModelLoadError(f"eagle head: {folder / CONFIG} is malformed ({exc})") from exc
    cfg = target.model.config
    own = {name: getattr(cfg, name) for name in shape}
    if shape != own or config.get("features") != (TAPPED if taps else FEATURES):
        raise ModelLoadError(f"eagle head: made for a target of {shape} reading {config.get('features')!r}; this "
                             f"target has {own}")
    if not all(0 <= layer < cfg.num_layers for layer in taps) or len(set(taps)) != len(taps):
        raise ModelLoadError(f"eagle head: {folder / CONFIG} taps layers {list(taps)}; this target's layers are 0.."
                             f"{cfg.num_layers - 1}, each tapped once")
    head = EagleHead(head_config(target.model), taps)
    tensors = load_file(str(folder / WEIGHTS))
    vocab_ids = tensors.pop(VOCAB_IDS, torch.arange(cfg.vocab_size))
    try:
        head.load_state_dict({k: v.float() for k, v in tensors.items()}, strict=True)
    except RuntimeError as exc:
        raise ModelLoadError(f"eagle head: {folder / WEIGHTS} does not match its config ({exc})") from exc
    check_vocab_ids(vocab_ids, cfg.vocab_size, f"eagle head: {folder / WEIGHTS}")
    return head, vocab_ids, str(config.get("target", ""))


def load_head(source: str | None, target: LoadedModel) -> LoadedEagle:
    """A head from a folder (config.json + eagle.safetensors), checked against the target's shape, ready to draft
    beside it; None means the shipped head of the embedded target."""
    source = source or default_head(target.spec.source)
    if not source:
        raise ModelLoadError("eagle head: none ships for this target; train one with `python -m playground.train "
                             "eagle --model SPEC --out FOLDER` and pass --eagle-head FOLDER")
    folder = Path(source).expanduser()
    head, vocab_ids, target_name = read_head(folder, target)
    model = target.model
    head = head.to(device=model.device, dtype=model.dtype).eval().requires_grad_(False)
    model.serve_like_own(head)  # it runs beside the target: in the native kernel where the target's layers do
    return LoadedEagle(head, folder, target_name, output_rows(model, vocab_ids))
