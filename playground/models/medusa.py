"""Medusa heads (Cai et al. 2024): K small residual blocks on the target's final hidden state; head k guesses
the token k + 2 positions ahead (the target's own logits give the token 1 ahead), through the target's frozen
output projection. Unlike Medusa-1, each head also reads the embedding of that next token: it is decided before
the heads run, so knowing it costs nothing, and it spares the heads guessing it (the input EAGLE, Li et al.
2024, feeds its draft). The heads may score a reduced vocabulary: the rows of the output projection for the tokens
the target actually writes, which makes proposing and training several times cheaper (a token outside it can only
come from the target's own prediction, never from a head). Stored as safetensors plus a config.json beside them
(never pickled)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import cast

import torch
import torch.nn.functional as F
from safetensors.torch import load_file
from torch import nn

from .linear import linear
from .loader import LoadedModel, ModelLoadError
from .native import Panels
from .transformer import Transformer
from .vocab import VOCAB_IDS, OutputRows, check_vocab_ids, output_rows, save_with_vocab

EMBEDDED_MEDUSA = Path(__file__).resolve().parents[2] / "assets" / "medusa-smollm2-135m"
WEIGHTS, CONFIG = "medusa.safetensors", "config.json"
# What a head reads, recorded in config.json: heads saved before the next-token embedding was an input cannot load.
INPUTS = "hidden+next_embedding"


class MedusaHeads(nn.Module):
    """Head k: (h, e) -> h + silu(W_k [h; e] + b_k), then the target's output projection, where h is the final
    hidden state that predicted the next token and e the target's input embedding of that token. Zero-initialised
    W_k makes every head start as a copy of the target's next-token prediction, which training then shifts
    further ahead."""

    def __init__(self, hidden_size: int, num_heads: int) -> None:
        super().__init__()
        blocks = [nn.Linear(2 * hidden_size, hidden_size) for _ in range(num_heads)]
        for block in blocks:
            nn.init.zeros_(block.weight)
            nn.init.zeros_(block.bias)
        self.blocks = nn.ModuleList(blocks)

    @property
    def num_heads(self) -> int:
        return len(self.blocks)

    def head(self, k: int, hidden: torch.Tensor, next_embedding: torch.Tensor) -> torch.Tensor:
        """Head k's state (..., E) from final-norm states (..., E) and the input embeddings (..., E) of the tokens
        they predicted, to project with the target's head."""
        both = torch.cat((hidden, next_embedding), dim=-1)  # (..., 2E)
        return hidden + F.silu(self.blocks[k](both))

    def forward(self, hidden: torch.Tensor, next_embedding: torch.Tensor) -> torch.Tensor:
        """Every head's state: (K, ..., E) for the (..., E) inputs of `head`."""
        return torch.stack([self.head(k, hidden, next_embedding) for k in range(self.num_heads)])


@dataclass(frozen=True, slots=True)
class FusedBlocks:
    """Every head's block as one product for decoding: W_0..W_K-1 stacked (K*E, 2E) and their biases (K*E,),
    packed where the target packs its own weights: a decode step's single row makes each small product pay mostly
    for its call, so one product over the stacked weights beats four."""

    weight: torch.Tensor
    bias: torch.Tensor
    packed: Panels | torch.Tensor | None

    @classmethod
    def of(cls, heads: MedusaHeads, pack_like: Transformer) -> "FusedBlocks":
        blocks = cast(list[nn.Linear], list(heads.blocks))
        weight = torch.cat([block.weight for block in blocks])  # (K*E, 2E)
        bias = torch.cat([block.bias for block in blocks])  # (K*E,)
        return cls(weight, bias, pack_like.pack_like_own(weight))


@dataclass(frozen=True)
class LoadedHeads:
    heads: MedusaHeads
    folder: Path
    target_name: str
    output: OutputRows  # the target's output projection rows for the token ids the heads score
    blocks: FusedBlocks  # heads.blocks as one product, what decoding runs

    @property
    def vocab_ids(self) -> torch.Tensor:
        return self.output.ids  # (V',) int64 ascending

    @property
    def vocab_size(self) -> int:
        return len(self.output)

    def logits(self, hidden: torch.Tensor, next_embedding: torch.Tensor, depth: int | None = None) -> torch.Tensor:
        """The first `depth` heads' logits (D, ..., V') over `vocab_ids` (every head's when None), in float32, for
        the inputs of `MedusaHeads.head` (the same states, from the fused blocks). The projection onto the
        vocabulary is the costly part, so heads past `depth` skip it."""
        blocks, heads = self.blocks, self.heads.num_heads
        both = torch.cat((hidden, next_embedding), dim=-1)  # (..., 2E)
        mixed = linear(both, blocks.weight, blocks.bias, packed=blocks.packed)  # (..., K*E)
        states = hidden.unsqueeze(-2) + F.silu(mixed.unflatten(-1, (heads, hidden.shape[-1])))  # (..., K, E)
        return self.output.logits(states[..., :depth, :].movedim(-2, 0))  # (D, ..., V')


def save_heads(heads: MedusaHeads, folder: Path, target: LoadedModel, dtype: torch.dtype,
               vocab_ids: torch.Tensor) -> None:
    """Weights in `dtype` plus the (V',) token ids they score, and config.json."""
    folder.mkdir(parents=True, exist_ok=True)
    save_with_vocab(heads, str(folder / WEIGHTS), dtype, vocab_ids)
    config = {"num_heads": heads.num_heads, "inputs": INPUTS, "hidden_size": target.model.config.hidden_size,
              "vocab_size": target.model.config.vocab_size, "head_vocab_size": len(vocab_ids), "target": target.name}
    (folder / CONFIG).write_text(json.dumps(config, indent=2))


def default_heads(target_source: str) -> str | None:
    """The shipped heads for a target spec, if the project has them."""
    if target_source == "embedded" and (EMBEDDED_MEDUSA / WEIGHTS).is_file():
        return str(EMBEDDED_MEDUSA)
    return None


def load_heads(source: str | None, target: LoadedModel) -> LoadedHeads:
    """Heads from a folder (config.json + medusa.safetensors), checked against the target's sizes; None means
    the shipped heads of the embedded target."""
    source = source or default_heads(target.spec.source)
    if not source:
        raise ModelLoadError("medusa heads: none ship for this target; train them with `python -m playground.train "
                             "medusa --model SPEC --out FOLDER` and pass --medusa-heads FOLDER")
    folder = Path(source).expanduser()
    if not (folder / WEIGHTS).is_file() or not (folder / CONFIG).is_file():
        raise ModelLoadError(f"medusa heads: {source!r} is not a folder with {CONFIG} and {WEIGHTS}")
    try:
        config = json.loads((folder / CONFIG).read_text())
        num_heads, hidden, vocab = int(config["num_heads"]), int(config["hidden_size"]), int(config["vocab_size"])
    except (ValueError, KeyError, TypeError) as exc:
        raise ModelLoadError(f"medusa heads: {folder / CONFIG} is malformed ({exc})") from exc
    if config.get("inputs") != INPUTS:
        raise ModelLoadError(f"medusa heads: {folder} holds heads that read only the hidden state (an earlier "
                             "format); retrain them with `python -m playground.train medusa`")
    tcfg = target.model.config
    if (hidden, vocab) != (tcfg.hidden_size, tcfg.vocab_size):
        raise ModelLoadError(f"medusa heads: made for hidden size {hidden} and vocabulary {vocab}, the target has "
                             f"{tcfg.hidden_size} and {tcfg.vocab_size}")
    if not 1 <= num_heads <= 16:
        raise ModelLoadError(f"medusa heads: num_heads must be in [1, 16], got {num_heads}")
    heads = MedusaHeads(hidden, num_heads)
    tensors = load_file(str(folder / WEIGHTS))
    # heads saved before reduced vocabularies existed score the whole vocabulary
    vocab_ids = tensors.pop(VOCAB_IDS, torch.arange(vocab))
    try:
        heads.load_state_dict({k: v.float() for k, v in tensors.items()}, strict=True)
    except RuntimeError as exc:
        raise ModelLoadError(f"medusa heads: {folder / WEIGHTS} does not match its config ({exc})") from exc
    check_vocab_ids(vocab_ids, vocab, f"medusa heads: {folder / WEIGHTS}")
    model = target.model
    heads = heads.to(device=model.device, dtype=model.dtype).eval().requires_grad_(False)
    return LoadedHeads(heads, folder, str(config.get("target", "")), output_rows(model, vocab_ids),
                       FusedBlocks.of(heads, model))
