"""The one KV-cache interface the model talks to, and the attention mask both caches share."""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch

from ..waits import to_device
from .blocks import Blocks


@dataclass(frozen=True, slots=True)
class AttentionLayout:
    """Where one forward's new tokens are written and which keys each of them may read.

    Keys come back from `KVCache.update` in logical slot order (slot j of row b holds the j-th token that row
    committed or is verifying), so the mask is in slot coordinates whatever the physical layout.
    """

    seq_ids: tuple[int, ...]
    starts: tuple[int, ...]  # first slot of the new tokens, per row
    num_new: int  # T, new tokens per row
    key_len: int  # L, key slots returned per row
    mask: torch.Tensor | None  # (B, 1, T, L) bool, True = may attend; None = every returned key is visible
    # Paged cache: the physical slot of each new token (B*T,) and of each returned key (B, L). Contiguous cache,
    # static shapes only (see `KVCache.static_slots`): the same in the one row, (T,) and (1, L).
    write_slots: torch.Tensor | None = None
    read_slots: torch.Tensor | None = None


@dataclass(frozen=True, slots=True)
class KVMemory:
    """A snapshot of cache memory: what holds live tokens, what is allocated, and what that allocation wastes."""

    bytes_used: int
    bytes_reserved: int
    tokens: int  # slots holding live tokens (a block shared by several sequences counts once)
    bytes_per_token: int
    # Paged cache only: blocks in the pool, held by at least one sequence, held by more than one.
    blocks_total: int = 0
    blocks_used: int = 0
    blocks_shared: int = 0

    @property
    def bytes_wasted(self) -> int:
        return self.bytes_reserved - self.bytes_used


class KVCache(ABC):
    """Contiguous and paged caches implement this: the model's view (where a forward's keys go and come from) and
    the engine's (trimming rejected tokens, memory). Their `blocks` is the scheduler's view, plain Python: the
    sequences, their lengths and the blocks they hold (a contiguous cache counts a row as one block)."""

    blocks: Blocks

    def _allocate(self, shape: tuple[int, ...], num_kv_heads: int, head_dim: int, dtype: torch.dtype,
                  device: torch.device | str) -> None:
        """K and V storage of `shape` (layers first), its per-layer views, and the bytes one token takes.

        Uninitialised: slots are always written before they are read, and untouched pages cost no RAM. The
        per-layer views are indexed once here rather than on every write of every decode step.
        """
        self.device = torch.device(device)
        self.k = torch.empty(shape, dtype=dtype, device=self.device)
        self.v = torch.empty(shape, dtype=dtype, device=self.device)
        self._k_layers, self._v_layers = self.k.unbind(0), self.v.unbind(0)
        # 2 (K and V) x layers x kv_heads x head_dim x bytes per element
        self._bytes_per_token = 2 * shape[0] * num_kv_heads * head_dim * self.k.element_size()

    @property
    @abstractmethod
    def capacity(self) -> int:
        """The most tokens one sequence can hold."""

    def share_storage(self, k: torch.Tensor, v: torch.Tensor) -> None:
        """Hold keys and values in k and v, a cache's of this one's shape that is no longer used (static forwards
        keep graphs that write and read them, `models.forwards.Shapes`); what they hold is never read unwritten."""
        if k is self.k:
            return
        if k.shape != self.k.shape or k.dtype != self.k.dtype or k.device != self.k.device or v.shape != k.shape:
            raise ValueError(f"storage of shape {tuple(k.shape)} cannot serve a cache of {tuple(self.k.shape)}")
        self.k, self.v = k, v
        self._k_layers, self._v_layers = k.unbind(0), v.unbind(0)

    @abstractmethod
    def reserve(self, seq_ids: tuple[int, ...], num_new: int) -> tuple[int, ...]:
        """Book `num_new` slots after each row's current length (blocks, copies on write, lengths): the rows' first
        new slots. `prepare` is this and the tensors of an eager forward."""

    def static_tables(self, seq_ids: tuple[int, ...], key_len: int) -> list[list[int]]:
        """Paged: each row's block table over its first key_len slots, padded with block 0 (static shapes, see
        `models.forwards`); a contiguous row has none."""
        return [[] for _ in seq_ids]

    @abstractmethod
    def static_slots(self, tables: torch.Tensor, starts: torch.Tensor, widths: torch.Tensor, width: int,
                     key_len: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The slots of a static-shape forward, from tensors on the device (`models.forwards` captures this):
        tables (B, blocks) as `static_tables` gives them, starts (B,) each row's first new slot, widths (B,) its
        tokens (0: a padding row), `width` tokens and `key_len` keys per row. Returns where each token is written
        (B*W,), padding to a scratch slot that no row reads, and where each row's keys are read from (B, L)."""

    @abstractmethod
    def prepare(
        self, seq_ids: tuple[int, ...], num_new: int, attn_mask: torch.Tensor | None = None
    ) -> AttentionLayout:
        """Reserve `num_new` slots after each row's current length and build the attention mask.

        attn_mask: (T, T) or (B, T, T) bool visibility among the new tokens (a tree); None means causal.
        """

    @abstractmethod
    def update(
        self, layer: int, layout: AttentionLayout, k: torch.Tensor, v: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Store k, v (B, Hkv, T, D) of `layer` and return all keys and values (B, Hkv, L, D) to attend over."""

    def contiguous_rows(self, layout: AttentionLayout) -> tuple[torch.Tensor, torch.Tensor] | None:
        """K and V (layers, B, Hkv, Tmax, D) of the forward's rows where they are consecutive rows of one slab,
        slot j of a row holding its j-th token (the whole-stack native forward writes and reads them there; the
        new tokens not yet stored); None where the layout is otherwise, and every write goes through `update`."""
        return None

    def slot_pools(self, layout: AttentionLayout) -> tuple[torch.Tensor, torch.Tensor] | None:
        """K and V (layers, slots, Hkv, D) of a cache whose tokens sit at the slots `layout.write_slots` and
        `layout.read_slots` name (the whole-stack native forward writes and reads them there); None otherwise."""
        return None

    def length(self, seq_id: int) -> int:
        """Number of committed slots of a sequence."""
        return self.blocks.length(seq_id)

    def truncate(self, seq_id: int, length: int) -> None:
        """Drop every slot of `seq_id` from `length` on (rejected draft tokens)."""
        self.blocks.truncate(seq_id, length)

    def _check_kept(self, seq_id: int, start: int, offsets: list[int]) -> None:
        """`keep`'s offsets must name slots the sequence holds."""
        length = self.length(seq_id)
        if any(o < 0 or start + o >= length for o in offsets):
            raise ValueError(f"offsets {offsets} from slot {start} are outside sequence {seq_id} of length {length}")

    @abstractmethod
    def keep(self, seq_id: int, start: int, offsets: list[int]) -> None:
        """Keep only some of the tokens from slot `start` on: slot start + offsets[i] moves to start + i and the
        sequence ends after them (the accepted path of a tree or of one of several candidates)."""

    @abstractmethod
    def memory(self) -> KVMemory:
        """Current memory accounting, read by traces and metrics."""


def build_attention_mask(
    starts: tuple[int, ...], num_new: int, key_len: int, attn_mask: torch.Tensor | None, device: torch.device
) -> torch.Tensor | None:
    """Visibility of key slots for the new tokens: the whole prefix, then `attn_mask` (default causal). A row
    shorter than the longest sees nothing past its own new tokens (those slots hold other lengths' data).

    Returns (B, 1, T, L) bool, or None when every returned key is visible (one row, one new token).
    """
    batch = len(starts)
    if attn_mask is None and num_new == 1 and batch == 1 and starts[0] + 1 == key_len:
        return None
    if attn_mask is None:
        attn_mask = torch.ones(num_new, num_new, dtype=torch.bool, device=device).tril()
    if attn_mask.dim() == 2:
        attn_mask = attn_mask.unsqueeze(0).expand(batch, num_new, num_new)  # (B, T, T)
    if attn_mask.shape != (batch, num_new, num_new):
        raise ValueError(f"attn_mask must be ({num_new}, {num_new}) or ({batch}, {num_new}, {num_new}), "
                         f"got {tuple(attn_mask.shape)}")
    return visibility(to_device(starts, device), to_device(attn_mask.bool(), device), key_len)


def visibility(starts: torch.Tensor, among_new: torch.Tensor, key_len: int) -> torch.Tensor:
    """Which of L key slots each new token sees: every slot before its row's start, and from there the new tokens
    `among_new` lets it see. starts (B,) int64, among_new (B, T, T) bool, on one device; returns (B, 1, T, L) bool.
    Tensor ops only, so that a captured forward can build it on the device."""
    batch, num_new = among_new.shape[:2]
    rel = torch.arange(key_len, device=starts.device).view(1, key_len) - starts.view(batch, 1)  # (B, L) from start
    in_prefix = (rel < 0).unsqueeze(1)  # (B, 1, L)
    in_new = ((rel >= 0) & (rel < num_new)).unsqueeze(1)  # (B, 1, L)
    index = rel.clamp(0, num_new - 1).unsqueeze(1).expand(batch, num_new, key_len)  # (B, T, L)
    return (in_prefix | (in_new & among_new.gather(2, index))).unsqueeze(1)  # (B, 1, T, L)
