"""The book a scheduler keeps of a KV cache (`Blocks`), and the paged cache's (`BlockManager`, over a
`BlockAllocator`): plain Python that never sees a tensor.

Blocks are numbered 0..num_blocks-1. A block in use has a reference count (one per sequence whose block table
holds it); at zero it returns to the free list. Full blocks of prompt tokens can be registered under a chained
hash (the hash of the previous block's hash and this block's token ids), so a later sequence with the same
prefix reuses them. A freed block keeps its registration until it is handed out again, so a prefix stays
reusable after the sequence that computed it has finished; free blocks are handed out least recently freed
first, which keeps recently used prefixes around the longest.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections import OrderedDict
from collections.abc import Iterator
from dataclasses import dataclass

ROOT_HASH = 0  # parent hash of a sequence's first block


class OutOfBlocksError(RuntimeError):
    """The pool has fewer free blocks than an allocation needs (the engine preempts before this happens)."""


def block_hash(parent: int, tokens: tuple[int, ...]) -> int:
    """Chained hash of a full block: equal hashes mean equal prefixes up to collisions, which `lookup`
    rules out by comparing the parent hash and the token ids themselves."""
    return hash((parent, tokens))


@dataclass(frozen=True, slots=True)
class BlockKey:
    hash: int
    parent: int
    tokens: tuple[int, ...]


class BlockAllocator:
    def __init__(self, num_blocks: int, block_size: int) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"num_blocks and block_size must be >= 1, got {num_blocks} and {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.refs = [0] * num_blocks
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))  # oldest first
        self._key_of: dict[int, BlockKey] = {}
        self._block_of: dict[int, int] = {}  # hash -> block

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.num_blocks - len(self._free)

    @property
    def num_shared(self) -> int:
        return sum(1 for r in self.refs if r > 1)

    def allocate(self, count: int = 1) -> list[int]:
        """Hand out `count` free blocks with one reference each, or raise without handing out any."""
        if count > len(self._free):
            raise OutOfBlocksError(f"need {count} KV blocks, {len(self._free)} free of {self.num_blocks}")
        blocks = []
        for _ in range(count):
            block, _ = self._free.popitem(last=False)
            self.unregister(block)
            self.refs[block] = 1
            blocks.append(block)
        return blocks

    def share(self, block: int) -> None:
        """One more reference to a registered block (a prefix hit), taking it back from the free list if needed."""
        if self.refs[block] == 0:
            del self._free[block]
        self.refs[block] += 1

    def release(self, block: int) -> None:
        if self.refs[block] < 1:
            raise ValueError(f"KV block {block} released more often than it was allocated")
        self.refs[block] -= 1
        if self.refs[block] == 0:
            self._free[block] = None

    def register(self, block: int, key: BlockKey) -> None:
        """Make a full, written block findable by its prefix hash (the first block registered wins)."""
        if key.hash in self._block_of or block in self._key_of:
            return
        self._key_of[block] = key
        self._block_of[key.hash] = block

    def lookup(self, key: BlockKey) -> int | None:
        block = self._block_of.get(key.hash)
        if block is None or self._key_of[block] != key:
            return None
        return block

    def is_registered(self, block: int) -> bool:
        return block in self._key_of

    def unregister(self, block: int) -> None:
        """Forget a block's prefix hash (before its contents change, or when it is handed out anew)."""
        key = self._key_of.pop(block, None)
        if key is not None:
            del self._block_of[key.hash]


class Blocks(ABC):
    """The scheduler's book of a cache: which sequences it holds, how long each is and what more they would take.
    Plain Python, no tensors: the scheduler books through it, the cache's storage reads it to place a forward's
    keys. The paged cache's is a `BlockManager`; the contiguous cache books whole rows, a row counting as a block."""

    @abstractmethod
    def add_sequence(self, seq_id: int, prompt_ids: list[int]) -> int:
        """Start a sequence (with prefix caching, on the cached blocks of its prompt's prefix); returns the prompt
        tokens already cached."""

    @abstractmethod
    def free(self, seq_id: int) -> None:
        """End a sequence and release what it held."""

    @abstractmethod
    def has_sequence(self, seq_id: int) -> bool:
        """Whether the sequence holds slots here."""

    @abstractmethod
    def prefix_blocks(self, prompt_ids: list[int]) -> tuple[int, int]:
        """(cached, promised) leading blocks of a prompt: those adding it would share now, and those it could share
        once the sequences computing them have written them."""

    @abstractmethod
    def blocks_needed(self, seq_id: int, num_new: int) -> int:
        """Blocks a forward of `num_new` more tokens of the sequence would take (copies of shared ones included)."""

    @property
    @abstractmethod
    def num_free(self) -> int:
        """Blocks no sequence holds."""

    @abstractmethod
    def length(self, seq_id: int) -> int:
        """Committed slots of a sequence."""

    @abstractmethod
    def truncate(self, seq_id: int, length: int) -> None:
        """Drop every slot of `seq_id` from `length` on."""

    @abstractmethod
    def reserve(self, seq_ids: tuple[int, ...], num_new: int) -> tuple[tuple[int, ...], list[tuple[int, int]]]:
        """Book `num_new` slots after each row's length: the rows' first new slots, and the (source, copy) blocks
        whose contents the storage must copy before the forward writes (copy on write)."""

    def block_map(self) -> tuple[list[int], list[int]] | None:
        """For a view of the blocks: each block's owner (the lowest sequence id holding it, -1 free) and the blocks
        held by more than one sequence; None where there are no blocks to show."""
        return None


def blocks_for(num_tokens: int, block_size: int) -> int:
    return -(-num_tokens // block_size)


class BlockManager(Blocks):
    """Per-sequence block tables over one `BlockAllocator`, with prefix caching and copy on write.

    Logical slot j of a sequence lives in physical slot table[j // block_size] * block_size + j % block_size.
    `add_sequence` looks the prompt's full blocks up by chained hash (token ids rechecked) and shares the blocks it
    finds; the blocks a prompt fills itself are registered once they are written (until then `prefix_blocks`
    reports them as promised, so a scheduler can wait for them rather than compute them twice). A write into a
    block another sequence also holds goes to a copy of it (copy on write), which the storage makes.
    """

    def __init__(self, num_blocks: int, block_size: int) -> None:
        self.allocator = BlockAllocator(num_blocks, block_size)
        self.block_size = block_size
        self._tables: dict[int, list[int]] = {}
        self._lengths: dict[int, int] = {}
        # Prompt blocks this sequence fills itself: (index in its table, key), registered once written.
        self._pending: dict[int, list[tuple[int, BlockKey]]] = {}

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

    def table(self, seq_id: int) -> list[int]:
        """The sequence's block table (the blocks of its slots, in order); the manager's own list, not a copy."""
        return self._tables[seq_id]

    def blocks_needed(self, seq_id: int, num_new: int) -> int:
        if seq_id not in self._lengths:
            return blocks_for(num_new, self.block_size)
        start = self._lengths[seq_id]
        table = self._tables[seq_id]
        grow = max(0, blocks_for(start + num_new, self.block_size) - len(table))
        return grow + len(self._shared_in(table, start, min(start + num_new, len(table) * self.block_size)))

    @property
    def num_free(self) -> int:
        return self.allocator.num_free

    def block_map(self) -> tuple[list[int], list[int]]:
        owners = [-1] * self.allocator.num_blocks
        for seq in sorted(self._tables, reverse=True):
            for block in self._tables[seq]:
                owners[block] = seq
        return owners, [block for block, refs in enumerate(self.allocator.refs) if refs > 1]

    def filled(self) -> int:
        """Slots holding live tokens (a block several sequences hold counts once, as far as any has written it)."""
        bs = self.block_size
        filled: dict[int, int] = {}  # block -> slots written
        for seq, table in self._tables.items():
            length = self._lengths[seq]
            for i, block in enumerate(table):
                filled[block] = max(filled.get(block, 0), min(bs, length - i * bs))
        return sum(filled.values())

    # -- lengths -----------------------------------------------------------------------------------------------

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

    def reserve(self, seq_ids: tuple[int, ...], num_new: int) -> tuple[tuple[int, ...], list[tuple[int, int]]]:
        self._register_written()
        needed = sum(self.blocks_needed(s, num_new) for s in seq_ids)
        if needed > self.allocator.num_free:
            raise OutOfBlocksError(f"this forward needs {needed} more KV blocks; {self.allocator.num_free} of "
                                   f"{self.allocator.num_blocks} are free")
        starts, copies = [], []
        for s in seq_ids:
            if s not in self._lengths:
                self._tables[s], self._lengths[s], self._pending[s] = [], 0, []
            start = self._lengths[s]
            table = self._tables[s]
            grow = blocks_for(start + num_new, self.block_size) - len(table)
            if grow > 0:
                table.extend(self.allocator.allocate(grow))
            copies += self.make_writable(s, start, start + num_new)
            self._lengths[s] = start + num_new
            starts.append(start)
        return tuple(starts), copies

    def make_writable(self, seq_id: int, first: int, end: int) -> list[tuple[int, int]]:
        """Before slots [first, end) are written: give the sequence its own copy of each block another also holds,
        and unregister blocks whose contents were promised to a prefix hash. Returns the (source, copy) blocks whose
        contents the storage must copy."""
        table = self._tables[seq_id]
        copies = []
        for i in range(first // self.block_size, blocks_for(end, self.block_size)):
            block = table[i]
            if self.allocator.refs[block] > 1:
                (copy,) = self.allocator.allocate(1)
                self.allocator.release(block)
                table[i] = copy
                copies.append((block, copy))
            elif self.allocator.is_registered(block):
                self.allocator.unregister(block)
        return copies

    # -- internals ---------------------------------------------------------------------------------------------

    def _shared_in(self, table: list[int], first: int, end: int) -> list[int]:
        """Indexes in `table` of blocks covering slots [first, end) that another sequence also holds."""
        bs = self.block_size
        return [i for i in range(first // bs, blocks_for(end, bs)) if self.allocator.refs[table[i]] > 1]

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
