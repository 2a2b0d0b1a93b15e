"""Contiguous KV cache: one preallocated (rows x max_len) slab per layer, position-indexed.

Slot j of a row holds that row's j-th token, so rolling back rejected tokens is just moving the length. Its book
(`Rows`) gives a sequence row i where it is i, unless a scheduler gave it a row with `add_sequence` (the engine
does): then whole rows are booked as the paged cache's blocks are, each reserved for one sequence from its start to
its end.
"""

from __future__ import annotations

import torch

from ..waits import to_device
from .base import AttentionLayout, KVCache, KVMemory, build_attention_mask
from .blocks import Blocks


def consecutive(seq_ids: tuple[int, ...]) -> slice | None:
    """The slab rows of `seq_ids` as a slice where they are consecutive and in order (a view, no copy), else None."""
    first = seq_ids[0]
    if seq_ids != tuple(range(first, first + len(seq_ids))):
        return None
    return slice(first, first + len(seq_ids))


class Rows(Blocks):
    """The contiguous cache's book: a row per sequence, each row's length. A row counts as one block."""

    def __init__(self, max_seqs: int, max_len: int) -> None:
        self.max_len = max_len
        self.lengths = [0] * max_seqs  # per row
        self._rows: dict[int, int] = {}  # sequence id -> its row, for sequences added with `add_sequence`

    def row(self, seq_id: int) -> int:
        return self._rows.get(seq_id, seq_id)

    def add_sequence(self, seq_id: int, prompt_ids: list[int]) -> int:
        """Give a sequence a free row of its own; nothing of its prompt is cached (0 tokens)."""
        if seq_id in self._rows:
            raise ValueError(f"sequence {seq_id} is already in the KV cache")
        row = min(set(range(len(self.lengths))) - set(self._rows.values()))
        self._rows[seq_id], self.lengths[row] = row, 0
        return 0

    def free(self, seq_id: int) -> None:
        self.lengths[self._rows.pop(seq_id)] = 0

    def has_sequence(self, seq_id: int) -> bool:
        return seq_id in self._rows

    def prefix_blocks(self, prompt_ids: list[int]) -> tuple[int, int]:
        """No prompt is shared between rows: nothing cached, nothing promised."""
        return 0, 0

    def blocks_needed(self, seq_id: int, num_new: int) -> int:
        """Rows a forward of `num_new` tokens would take: none while they fit the sequence's row, which it holds
        from its start; more than there are past its end."""
        return 0 if self.length(seq_id) + num_new <= self.max_len else len(self.lengths) + 1

    @property
    def num_free(self) -> int:
        return len(self.lengths) - len(self._rows)

    def length(self, seq_id: int) -> int:
        return self.lengths[self.row(seq_id)]

    def truncate(self, seq_id: int, length: int) -> None:
        row = self.row(seq_id)
        if not 0 <= length <= self.lengths[row]:
            raise ValueError(f"cannot truncate sequence {seq_id} of length {self.lengths[row]} to {length}")
        self.lengths[row] = length

    def reserve(self, seq_ids: tuple[int, ...], num_new: int) -> tuple[tuple[int, ...], list[tuple[int, int]]]:
        rows = tuple(self.row(s) for s in seq_ids)
        starts = tuple(self.lengths[r] for r in rows)
        if max(starts) + num_new > self.max_len:
            raise ValueError(f"KV cache holds {self.max_len} tokens per sequence; this forward needs "
                             f"{max(starts) + num_new}")
        for r in rows:
            self.lengths[r] += num_new
        return starts, []


class ContiguousKVCache(KVCache):
    def __init__(
        self,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        max_len: int,
        max_seqs: int = 1,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
    ) -> None:
        if max_len < 1 or max_seqs < 1:
            raise ValueError(f"max_len and max_seqs must be >= 1, got {max_len} and {max_seqs}")
        self.max_len = max_len
        # k, v: (layers, S, Hkv, Tmax + 1, D); per-layer views (S, Hkv, Tmax + 1, D). Slot Tmax is no token's: a
        # static-shape forward writes its padding there.
        self._allocate((num_layers, max_seqs, num_kv_heads, max_len + 1, head_dim), num_kv_heads, head_dim, dtype,
                       device)
        self.blocks: Rows = Rows(max_seqs, max_len)

    @property
    def capacity(self) -> int:
        return self.max_len

    def keep(self, seq_id: int, start: int, offsets: list[int]) -> None:
        self._check_kept(seq_id, start, offsets)
        row = self.blocks.row(seq_id)
        if offsets != list(range(len(offsets))):
            source = to_device(offsets, self.device) + start  # (n,)
            for cache in (self.k, self.v):
                slots = cache[:, row]  # (layers, Hkv, Tmax, D)
                # index_select copies, so moving slots over each other is safe
                slots[:, :, start : start + len(offsets)] = slots.index_select(2, source)
        self.blocks.truncate(seq_id, start + len(offsets))

    def reserve(self, seq_ids: tuple[int, ...], num_new: int) -> tuple[int, ...]:
        return self.blocks.reserve(seq_ids, num_new)[0]

    def prepare(
        self, seq_ids: tuple[int, ...], num_new: int, attn_mask: torch.Tensor | None = None
    ) -> AttentionLayout:
        starts = self.reserve(seq_ids, num_new)
        key_len = max(starts) + num_new
        mask = build_attention_mask(starts, num_new, key_len, attn_mask, self.device)
        return AttentionLayout(tuple(self.blocks.row(s) for s in seq_ids), starts, num_new, key_len, mask)  # names rows

    def static_slots(self, tables: torch.Tensor, starts: torch.Tensor, widths: torch.Tensor, width: int,
                     key_len: int) -> tuple[torch.Tensor, torch.Tensor]:
        """One row only (an engine's contiguous cache has one): its keys are read from its first slots."""
        if len(self.blocks.lengths) != 1:
            raise ValueError(f"static shapes need a one-row contiguous cache, got {len(self.blocks.lengths)} rows")
        offsets = torch.arange(width, device=starts.device)  # (W,)
        write = torch.where(offsets < widths[0], starts[0] + offsets, self.max_len)  # (W,)
        # keys past the row's own tokens are masked, but a masked NaN still poisons the sum: read its last slot there
        read = torch.arange(key_len, device=starts.device).clamp(max=starts[0] + widths[0] - 1)  # (L,)
        return write, read.unsqueeze(0)  # (W,), (1, L)

    def update(
        self, layer: int, layout: AttentionLayout, k: torch.Tensor, v: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        t, key_len = layout.num_new, layout.key_len
        k_layer, v_layer = self._k_layers[layer], self._v_layers[layer]
        if layout.write_slots is not None:  # static shapes: the one row, its new tokens and keys at the slots named
            k_layer.index_copy_(2, layout.write_slots, k)  # k: (1, Hkv, T, D)
            v_layer.index_copy_(2, layout.write_slots, v)
            assert layout.read_slots is not None  # named with the writes
            read = layout.read_slots[0]  # (L,)
            return k_layer.index_select(2, read), v_layer.index_select(2, read)  # (1, Hkv, L, D)
        for row, (seq, start) in enumerate(zip(layout.seq_ids, layout.starts)):
            k_layer[seq, :, start : start + t] = k[row]  # (Hkv, T, D)
            v_layer[seq, :, start : start + t] = v[row]
        rows = consecutive(layout.seq_ids)
        if rows is not None:
            return k_layer[rows, :, :key_len], v_layer[rows, :, :key_len]
        index = to_device(layout.seq_ids, self.device)
        return (k_layer.index_select(0, index)[:, :, :key_len],
                v_layer.index_select(0, index)[:, :, :key_len])  # (B, Hkv, L, D)

    def contiguous_rows(self, layout: AttentionLayout) -> tuple[torch.Tensor, torch.Tensor] | None:
        rows = consecutive(layout.seq_ids)
        if rows is None:
            return None
        return self.k[:, rows], self.v[:, rows]  # (layers, B, Hkv, Tmax, D)

    def memory(self) -> KVMemory:
        tokens = sum(self.blocks.lengths)
        reserved = self.k.shape[1] * self.max_len * self._bytes_per_token
        return KVMemory(tokens * self._bytes_per_token, reserved, tokens, self._bytes_per_token)
