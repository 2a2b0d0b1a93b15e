"""The block allocator of the paged KV cache: plain Python that never sees a tensor.

Blocks are numbered 0..num_blocks-1. A block in use has a reference count (one per sequence whose block table
holds it); at zero it returns to the free list. Full blocks of prompt tokens can be registered under a chained
hash (the hash of the previous block's hash and this block's token ids), so a later sequence with the same
prefix reuses them. A freed block keeps its registration until it is handed out again, so a prefix stays
reusable after the sequence that computed it has finished; free blocks are handed out least recently freed
first, which keeps recently used prefixes around the longest.
"""

from __future__ import annotations

from collections import OrderedDict
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
