"""Paged KV cache: one pool of fixed-size blocks per layer, read and written through the block tables of its
`BlockManager` (plain Python, booked by the scheduler).

The model sees the same interface as the contiguous cache: `prepare` turns block tables into the physical slots the
new tokens are written to (slot mapping) and the slots every row reads its keys from, and `update` writes with one
`index_copy_` and reads with one `index_select` per layer (gather-based attention; the same tensor code runs on CPU
and GPU). Keys come back in logical order, so masks are the ones the contiguous cache builds. The storage makes the
copies the manager's copy on write asks for.
"""

from __future__ import annotations

import torch

from ..waits import to_device
from .base import AttentionLayout, KVCache, KVMemory, build_attention_mask
from .blocks import BlockManager, blocks_for


class PagedKVCache(KVCache):
    def __init__(
        self,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        num_blocks: int,
        block_size: int = 16,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
    ) -> None:
        self.blocks: BlockManager = BlockManager(num_blocks, block_size)
        self.block_size = block_size
        # k, v: (layers, slots, Hkv, D); per-layer views (slots, Hkv, D). The last slot is no block's: a static-shape
        # forward writes its padding there.
        self.scratch_slot = num_blocks * block_size
        self._allocate((num_layers, self.scratch_slot + 1, num_kv_heads, head_dim), num_kv_heads, head_dim, dtype,
                       device)
        self.k[:, self.scratch_slot].zero_()
        self.v[:, self.scratch_slot].zero_()

    @property
    def capacity(self) -> int:
        return self.scratch_slot  # every block of the pool

    def keep(self, seq_id: int, start: int, offsets: list[int]) -> None:
        self._check_kept(seq_id, start, offsets)
        if offsets != list(range(len(offsets))):
            self._copy(self.blocks.make_writable(seq_id, start, start + len(offsets)))
            slots = self._sequence_slots(seq_id)
            source = to_device(slots[[start + o for o in offsets]], self.device)  # (n,)
            target = to_device(slots[start : start + len(offsets)], self.device)  # (n,)
            for pool in (self.k, self.v):
                # index_select copies, so moving slots over each other is safe
                pool.index_copy_(1, target, pool.index_select(1, source))
        self.blocks.truncate(seq_id, start + len(offsets))

    def reserve(self, seq_ids: tuple[int, ...], num_new: int) -> tuple[int, ...]:
        starts, copies = self.blocks.reserve(seq_ids, num_new)
        self._copy(copies)
        return starts

    def prepare(
        self, seq_ids: tuple[int, ...], num_new: int, attn_mask: torch.Tensor | None = None
    ) -> AttentionLayout:
        starts = self.reserve(seq_ids, num_new)
        key_len = max(starts) + num_new
        write, read = [], []
        for s, start in zip(seq_ids, starts):
            slots, end = self._sequence_slots(s), start + num_new
            write.append(slots[start:end])
            # Keys past a shorter row's own tokens are masked; its last slot serves as their index.
            read.append(torch.cat([slots[:end], slots[end - 1 : end].expand(key_len - end)]))
        mask = build_attention_mask(starts, num_new, key_len, attn_mask, self.device)
        return AttentionLayout(tuple(seq_ids), starts, num_new, key_len, mask,
                               write_slots=to_device(torch.cat(write), self.device),
                               read_slots=to_device(torch.stack(read), self.device))

    def static_tables(self, seq_ids: tuple[int, ...], key_len: int) -> list[list[int]]:
        blocks = blocks_for(key_len, self.block_size)
        return [(self.blocks.table(s) + [0] * blocks)[:blocks] for s in seq_ids]

    def static_slots(self, tables: torch.Tensor, starts: torch.Tensor, widths: torch.Tensor, width: int,
                     key_len: int) -> tuple[torch.Tensor, torch.Tensor]:
        bs = self.block_size
        last = (starts + widths - 1).clamp(min=0).unsqueeze(1)  # (B, 1): a row's last new slot

        def slots(logical: torch.Tensor) -> torch.Tensor:  # (B, n) logical slots -> physical, through the tables
            return tables.gather(1, logical // bs) * bs + logical % bs

        new = starts.unsqueeze(1) + torch.arange(width, device=starts.device)  # (B, W)
        real = torch.arange(width, device=starts.device) < widths.unsqueeze(1)  # (B, W)
        write = torch.where(real, slots(torch.minimum(new, last)), self.scratch_slot)  # (B, W)
        # keys past a row's own tokens are masked; its last slot serves as their index (padding rows: the scratch)
        read = slots(torch.minimum(torch.arange(key_len, device=starts.device), last))  # (B, L)
        read = torch.where(widths.unsqueeze(1) > 0, read, self.scratch_slot)
        return write.view(-1), read

    def slot_pools(self, layout: AttentionLayout) -> tuple[torch.Tensor, torch.Tensor]:
        return self.k, self.v  # (layers, slots, Hkv, D)

    def update(
        self, layer: int, layout: AttentionLayout, k: torch.Tensor, v: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        b, hkv, t, d = k.shape
        key_len, writes, reads = layout.key_len, layout.write_slots, layout.read_slots
        assert writes is not None and reads is not None  # `prepare` and the static layouts name the slots
        out = []
        for pool, new in ((self._k_layers[layer], k), (self._v_layers[layer], v)):
            pool.index_copy_(0, writes, new.transpose(1, 2).reshape(b * t, hkv, d))  # (B*T, Hkv, D)
            gathered = pool.index_select(0, reads.view(-1))  # (B*L, Hkv, D)
            out.append(gathered.view(b, key_len, hkv, d).transpose(1, 2))  # (B, Hkv, L, D)
        return out[0], out[1]

    def memory(self) -> KVMemory:
        tokens, allocator = self.blocks.filled(), self.blocks.allocator
        used = allocator.num_used
        return KVMemory(tokens * self._bytes_per_token, used * self.block_size * self._bytes_per_token, tokens,
                        self._bytes_per_token, blocks_total=allocator.num_blocks, blocks_used=used,
                        blocks_shared=allocator.num_shared)

    # -- internals ---------------------------------------------------------------------------------------------

    def _sequence_slots(self, seq_id: int) -> torch.Tensor:
        """The pool slot of every position its blocks hold, in order: (blocks * block_size,) int64 on the host, built
        with tensor ops rather than a Python list per position (every forward's layout reads it)."""
        bs = self.block_size
        table = torch.tensor(self.blocks.table(seq_id), dtype=torch.int64)  # (blocks,)
        return (table.unsqueeze(1) * bs + torch.arange(bs)).view(-1)  # (blocks * bs,)

    def _copy(self, copies: list[tuple[int, int]]) -> None:
        """Copy each (source, copy) block's keys and values, as the manager's copy on write asked."""
        bs = self.block_size
        for block, copy in copies:
            for pool in (self.k, self.v):
                pool[:, copy * bs : (copy + 1) * bs] = pool[:, block * bs : (block + 1) * bs]


__all__ = ["PagedKVCache"]
