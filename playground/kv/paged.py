"""Paged KV cache: one pool of fixed-size blocks per layer, per-sequence block tables, prefix caching.

Logical slot j of a sequence lives in physical slot table[j // block_size] * block_size + j % block_size. The
model sees the same interface as the contiguous cache: `prepare` turns block tables into the physical slots
the new tokens are written to (slot mapping) and the slots every row reads its keys from, and `update` writes
with one `index_copy_` and reads with one `index_select` per layer (gather-based attention; the same tensor
code runs on CPU and GPU). Keys come back in logical order, so masks are the ones the contiguous cache builds.

Prefix caching: `add_sequence` looks the prompt's full blocks up by chained hash (token ids rechecked) and
shares the blocks it finds; the blocks a prompt fills itself are registered once they are written (until then
`prefix_blocks` reports them as promised, so a scheduler can wait for them rather than compute them twice). A
write into a block another sequence also holds copies it first (copy on write).
"""

from __future__ import annotations

from collections.abc import Iterator

import torch

from ..waits import to_device
from .base import AttentionLayout, KVCache, KVMemory, build_attention_mask
from .blocks import ROOT_HASH, BlockAllocator, BlockKey, OutOfBlocksError, block_hash


def blocks_for(num_tokens: int, block_size: int) -> int:
    return -(-num_tokens // block_size)


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
        self.allocator = BlockAllocator(num_blocks, block_size)
        self.block_size = block_size
        # k, v: (layers, slots, Hkv, D); per-layer views (slots, Hkv, D). The last slot is no block's: a static-shape
        # forward writes its padding there.
        self.scratch_slot = num_blocks * block_size
        self._allocate((num_layers, self.scratch_slot + 1, num_kv_heads, head_dim), num_kv_heads, head_dim, dtype,
                       device)
        self.k[:, self.scratch_slot].zero_()
        self.v[:, self.scratch_slot].zero_()
        self._tables: dict[int, list[int]] = {}
        self._lengths: dict[int, int] = {}
        # Prompt blocks this sequence fills itself: (index in its table, key), registered once written.
        self._pending: dict[int, list[tuple[int, BlockKey]]] = {}

    @property
    def capacity(self) -> int:
        return self.scratch_slot  # every block of the pool

    # -- sequences ---------------------------------------------------------------------------------------------

    def add_sequence(self, seq_id: int, prompt_ids: list[int]) -> int:
        """Start a sequence that will hold `prompt_ids` first, sharing every cached full block of that prompt.

        Returns how many prompt tokens already have their KV (the sequence's length now). At least the last
        prompt token is left to compute, since its logits are needed.
        """
        if seq_id in self._lengths:
            raise ValueError(f"sequence {seq_id} is already in the KV cache")
        self._register_written()
        table: list[int] = []
        pending: list[tuple[int, BlockKey]] = []
        for i, key in enumerate(self._prompt_block_keys(prompt_ids)):
            block = self.allocator.lookup(key) if len(table) == i else None
            if block is None:
                pending.append((i, key))
            else:
                self.allocator.share(block)
                table.append(block)
        self._tables[seq_id] = table
        self._lengths[seq_id] = min(len(table) * self.block_size, len(prompt_ids) - 1) if prompt_ids else 0
        self._pending[seq_id] = pending
        return self._lengths[seq_id]

    def prefix_blocks(self, prompt_ids: list[int]) -> tuple[int, int]:
        """(cached, promised): leading full blocks of this prompt that `add_sequence` would share now, and that it
        could share once the sequences now computing the rest of them have written them."""
        self._register_written()
        pending = {key for keys in self._pending.values() for _, key in keys}
        cached = promised = 0
        for key in self._prompt_block_keys(prompt_ids):
            found = self.allocator.lookup(key) is not None
            if not found and key not in pending:
                break
            if found and cached == promised:
                cached += 1
            promised += 1
        return cached, promised

    def _prompt_block_keys(self, prompt_ids: list[int]) -> Iterator[BlockKey]:
        """The chained keys of the prompt's full blocks, first block first."""
        bs = self.block_size
        parent = ROOT_HASH
        for i in range(len(prompt_ids) // bs):
            tokens = tuple(prompt_ids[i * bs : (i + 1) * bs])
            key = BlockKey(block_hash(parent, tokens), parent, tokens)
            yield key
            parent = key.hash

    def free(self, seq_id: int) -> None:
        """Release every block of a sequence and forget it."""
        self.truncate(seq_id, 0)
        del self._tables[seq_id], self._lengths[seq_id], self._pending[seq_id]

    def has_sequence(self, seq_id: int) -> bool:
        return seq_id in self._lengths

    def block_table(self, seq_id: int) -> list[int]:
        return list(self._tables[seq_id])

    def blocks_needed(self, seq_id: int, num_new: int) -> int:
        """Free blocks a forward of `num_new` tokens on this sequence would take (new blocks and copies)."""
        if seq_id not in self._lengths:
            return blocks_for(num_new, self.block_size)
        start = self._lengths[seq_id]
        table = self._tables[seq_id]
        grow = max(0, blocks_for(start + num_new, self.block_size) - len(table))
        return grow + len(self._shared_in(table, start, min(start + num_new, len(table) * self.block_size)))

    @property
    def num_free_blocks(self) -> int:
        return self.allocator.num_free

    def block_map(self) -> tuple[list[int], list[int]]:
        owners = [-1] * self.allocator.num_blocks
        for seq in sorted(self._tables, reverse=True):
            for block in self._tables[seq]:
                owners[block] = seq
        return owners, [block for block, refs in enumerate(self.allocator.refs) if refs > 1]

    # -- the KVCache interface ---------------------------------------------------------------------------------

    def length(self, seq_id: int) -> int:
        return self._lengths.get(seq_id, 0)

    def truncate(self, seq_id: int, length: int) -> None:
        current = self._lengths.get(seq_id, 0)
        if not 0 <= length <= current:
            raise ValueError(f"cannot truncate sequence {seq_id} of length {current} to {length}")
        if seq_id not in self._lengths:
            return
        self._register_written()  # a prompt block written before a rollback or free stays reusable
        table = self._tables[seq_id]
        keep = blocks_for(length, self.block_size)
        for block in table[keep:]:
            self.allocator.release(block)
        del table[keep:]
        if length < current:
            # Blocks not fully written by now may be written with other tokens than the prompt promised.
            self._pending[seq_id] = []
        self._lengths[seq_id] = length

    def keep(self, seq_id: int, start: int, offsets: list[int]) -> None:
        length = self._lengths.get(seq_id, 0)
        if any(o < 0 or start + o >= length for o in offsets):
            raise ValueError(f"offsets {offsets} from slot {start} are outside sequence {seq_id} of length {length}")
        if offsets != list(range(len(offsets))):
            table = self._tables[seq_id]
            self._make_writable(seq_id, start, start + len(offsets))
            source = self._slots(table, [start + o for o in offsets])  # (n,)
            target = self._slots(table, range(start, start + len(offsets)))  # (n,)
            for pool in (self.k, self.v):
                # index_select copies, so moving slots over each other is safe
                pool.index_copy_(1, target, pool.index_select(1, source))
        self.truncate(seq_id, start + len(offsets))

    def reserve(self, seq_ids: tuple[int, ...], num_new: int) -> tuple[int, ...]:
        self._register_written()
        needed = sum(self.blocks_needed(s, num_new) for s in seq_ids)
        if needed > self.allocator.num_free:
            raise OutOfBlocksError(f"this forward needs {needed} more KV blocks; {self.allocator.num_free} of "
                                   f"{self.allocator.num_blocks} are free")
        starts = []
        for s in seq_ids:
            if s not in self._lengths:
                self._tables[s], self._lengths[s], self._pending[s] = [], 0, []
            start = self._lengths[s]
            table = self._tables[s]
            grow = blocks_for(start + num_new, self.block_size) - len(table)
            if grow > 0:
                table.extend(self.allocator.allocate(grow))
            self._make_writable(s, start, start + num_new)
            self._lengths[s] = start + num_new
            starts.append(start)
        return tuple(starts)

    def prepare(
        self, seq_ids: tuple[int, ...], num_new: int, attn_mask: torch.Tensor | None = None
    ) -> AttentionLayout:
        starts = self.reserve(seq_ids, num_new)
        key_len = max(starts) + num_new
        write, read = [], []
        for s, start in zip(seq_ids, starts):
            table = self._tables[s]
            write.append(self._slots(table, range(start, start + num_new)))
            # Keys past a shorter row's own tokens are masked; any valid slot serves as their index.
            read.append(self._slots(table, [min(j, start + num_new - 1) for j in range(key_len)]))
        mask = build_attention_mask(starts, num_new, key_len, attn_mask, self.device)
        return AttentionLayout(tuple(seq_ids), starts, num_new, key_len, mask,
                               write_slots=torch.cat(write), read_slots=torch.stack(read))

    def static_tables(self, seq_ids: tuple[int, ...], key_len: int) -> list[list[int]]:
        blocks = blocks_for(key_len, self.block_size)
        return [(self._tables[s] + [0] * blocks)[:blocks] for s in seq_ids]

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
        bs = self.block_size
        filled: dict[int, int] = {}  # block -> slots holding tokens (the most any holder has written)
        for seq, table in self._tables.items():
            length = self._lengths[seq]
            for i, block in enumerate(table):
                filled[block] = max(filled.get(block, 0), min(bs, length - i * bs))
        tokens = sum(filled.values())
        used = self.allocator.num_used
        return KVMemory(tokens * self._bytes_per_token, used * bs * self._bytes_per_token, tokens,
                        self._bytes_per_token, blocks_total=self.allocator.num_blocks, blocks_used=used,
                        blocks_shared=self.allocator.num_shared)

    # -- internals ---------------------------------------------------------------------------------------------

    def _slots(self, table: list[int], positions) -> torch.Tensor:
        bs = self.block_size
        return to_device([table[j // bs] * bs + j % bs for j in positions], self.device)

    def _shared_in(self, table: list[int], first: int, end: int) -> list[int]:
        """Indexes in `table` of blocks covering slots [first, end) that another sequence also holds."""
        bs = self.block_size
        return [i for i in range(first // bs, blocks_for(end, bs)) if self.allocator.refs[table[i]] > 1]

    def _make_writable(self, seq_id: int, first: int, end: int) -> None:
        """Before slots [first, end) are written: copy shared blocks, and unregister blocks whose contents were
        promised to a prefix hash."""
        table = self._tables[seq_id]
        for i in range(first // self.block_size, blocks_for(end, self.block_size)):
            block = table[i]
            if self.allocator.refs[block] > 1:
                (copy,) = self.allocator.allocate(1)
                bs = self.block_size
                for pool in (self.k, self.v):
                    pool[:, copy * bs : (copy + 1) * bs] = pool[:, block * bs : (block + 1) * bs]
                self.allocator.release(block)
                table[i] = copy
            elif self.allocator.is_registered(block):
                self.allocator.unregister(block)

    def _register_written(self) -> None:
        """Register the prompt blocks that sequences have finished writing, so later prompts can share them."""
        for seq, pending in self._pending.items():
            if not pending:
                continue
            written = self._lengths[seq] // self.block_size
            table = self._tables[seq]
            for i, key in pending:
                if i < written:
                    self.allocator.register(table[i], key)
            self._pending[seq] = [(i, key) for i, key in pending if i >= written]


__all__ = ["OutOfBlocksError", "PagedKVCache", "blocks_for"]
