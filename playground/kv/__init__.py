"""KV caches: one interface (`KVCache`), a contiguous implementation now, a paged one later."""

from .base import AttentionLayout, KVCache, KVMemory, build_attention_mask
from .contiguous import ContiguousKVCache

__all__ = ["AttentionLayout", "ContiguousKVCache", "KVCache", "KVMemory", "build_attention_mask"]
