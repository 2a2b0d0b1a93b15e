"""KV caches: one interface (`KVCache`), a contiguous and a paged implementation."""

from .base import AttentionLayout, KVCache, KVMemory, build_attention_mask
from .blocks import BlockAllocator, OutOfBlocksError
from .contiguous import ContiguousKVCache
from .paged import PagedKVCache, blocks_for

__all__ = ["AttentionLayout", "BlockAllocator", "ContiguousKVCache", "KVCache", "KVMemory", "OutOfBlocksError",
           "PagedKVCache", "blocks_for", "build_attention_mask"]
