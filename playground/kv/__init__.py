"""KV caches: one interface (`KVCache`), a contiguous and a paged implementation, each with its plain-Python book
(`Blocks`) that the scheduler keeps."""

from .base import AttentionLayout, KVCache, KVMemory, build_attention_mask
from .blocks import BlockAllocator, BlockManager, Blocks, OutOfBlocksError, blocks_for
from .contiguous import ContiguousKVCache, Rows
from .paged import PagedKVCache

__all__ = ["AttentionLayout", "BlockAllocator", "BlockManager", "Blocks", "ContiguousKVCache", "KVCache", "KVMemory",
           "OutOfBlocksError", "PagedKVCache", "Rows", "blocks_for", "build_attention_mask"]
