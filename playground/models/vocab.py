"""Reduced output vocabularies: a proposer (Medusa heads, a draft model) that scores only the rows of an output
projection for the tokens a target actually writes pays len(ids) / V of the full product, which for a small
proposer over a 49k vocabulary is a large share of its step (most of the Medusa heads', 40% of the shipped
draft's). A token outside the ids is never proposed; the target still emits it when it chooses it, so greedy
output stays exact and sampling stays lossless (q is zero there).

The ids are stored as an int64 safetensors tensor named `vocab_ids` (never pickled)."""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from torch import nn

from . import native
from .linear import linear, product_bytes
from .loader import LoadedModel, ModelLoadError
from .transformer import Transformer

VOCAB_IDS = "vocab_ids"  # the tensor listing the token ids a proposer scores, ascending
# Beside a draft's Hugging Face weights, written by `python -m playground.train draft`; transformers ignores it.
PROPOSAL_VOCAB = "proposal_vocab.safetensors"


@dataclass(frozen=True, slots=True)
class OutputRows:
    """The rows of a model's output projection for some token ids."""

    ids: torch.Tensor  # (V',) int64 ascending, on the model's device
    weight: torch.Tensor  # (V', E)
    packed: native.Panels | torch.Tensor | None  # `weight` prepacked for the CPU (see linear.pack), or None

    def __len__(self) -> int:
        return len(self.ids)

    @property
    def nbytes(self) -> int:
        """Bytes a product over these rows reads."""
        return product_bytes(self.weight, self.packed)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Logits (..., V') over `ids`, in float32, for hidden states (..., E)."""
        return linear(hidden, self.weight, packed=self.packed).float()

    def full_logits(self, hidden: torch.Tensor, vocab_size: int) -> torch.Tensor:
        """Logits (..., V) over the whole vocabulary, -inf outside `ids`: sampling and argmax never pick those."""
        scored = self.logits(hidden)  # (..., V')
        full = scored.new_full((*scored.shape[:-1], vocab_size), float("-inf"))  # (..., V)
        return full.index_copy_(-1, self.ids, scored)


def rows_of(output_weight: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """The rows (V', E) of an output projection (V, E) for `ids` (the projection itself when ids cover it)."""
    if len(ids) == len(output_weight):
        return output_weight
    return output_weight[ids.to(output_weight.device)].contiguous()


def output_rows(model: Transformer, ids: torch.Tensor) -> OutputRows:
    """The model's output rows for checked `ids`, packed where the model packs its own projection: from its GGUF
    blocks (and in the same arithmetic) where it was packed from them."""
    weight = rows_of(model.output_weight, ids)
    if weight is model.output_weight:
        packed = model.packed_output
    elif model.output_blocks is not None and isinstance(model.packed_output, native.Panels):
        kind, blocks = model.output_blocks
        packed = native.pack_blocks(blocks[ids.cpu()], kind, weight.shape[1], model.packed_output.kernel,
                                    model.integer_products)
    else:
        packed = model.pack_like_own(weight)
    return OutputRows(ids.to(model.device), weight, packed)


def save_with_vocab(module: nn.Module, path: str, dtype: torch.dtype, ids: torch.Tensor) -> None:
    """A proposer's weights in `dtype` and the (V',) token ids it scores, as one safetensors file."""
    tensors = {k: v.detach().to(dtype).contiguous() for k, v in module.state_dict().items()}
    save_file({**tensors, VOCAB_IDS: ids.to(torch.int64).contiguous()}, path)


def check_vocab_ids(ids: torch.Tensor, vocab: int, where: str) -> None:
    """Reduced-vocabulary ids must be distinct, ascending int64 token ids of the model."""
    ok = (ids.dtype == torch.int64 and ids.dim() == 1 and 1 <= len(ids) <= vocab
          and int(ids.min()) >= 0 and int(ids.max()) < vocab and bool((ids.diff() > 0).all()))
    if not ok:
        raise ModelLoadError(f"{where} holds a malformed {VOCAB_IDS!r} tensor; it must list 1 to {vocab} distinct "
                             f"ascending int64 token ids in [0, {vocab})")


# Per loaded model, dropped with it, the rows of each vocabulary file read for it: every decoder built over a model
# (the app builds one per run, the bench two) shares its rows instead of reading the file and copying and packing
# ~6 MB of weights again.
_PROPOSALS: weakref.WeakKeyDictionary[Transformer, dict[Path, OutputRows | None]] = weakref.WeakKeyDictionary()


def proposal_rows(draft: LoadedModel) -> OutputRows | None:
    """The draft's proposal vocabulary from `proposal_vocab.safetensors` in its folder, or None (no such file:
    the draft scores every token); read once per loaded draft."""
    return vocabulary_rows(draft.model, draft.folder / PROPOSAL_VOCAB, "draft")


def vocabulary_rows(model: Transformer, path: Path, who: str) -> OutputRows | None:
    """The model's output rows for the token ids of a vocabulary file (`save_with_vocab`'s `vocab_ids`), or None
    where there is no such file; read once per loaded model and file. who: whose file it is, for the message."""
    read = _PROPOSALS.setdefault(model, {})
    if path not in read:
        read[path] = read_vocabulary_rows(model, path, who)
    return read[path]


def read_vocabulary_rows(model: Transformer, path: Path, who: str) -> OutputRows | None:
    if not path.is_file():
        return None
    tensors = load_file(str(path))
    if VOCAB_IDS not in tensors:
        raise ModelLoadError(f"{who}: {path} has no {VOCAB_IDS!r} tensor")
    check_vocab_ids(tensors[VOCAB_IDS], model.config.vocab_size, f"{who}: {path}")
    return output_rows(model, tensors[VOCAB_IDS])
