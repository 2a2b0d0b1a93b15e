"""Contiguous KV cache: slot writes, truncation, masks and memory accounting."""

from __future__ import annotations

import pytest
import torch

from playground.kv import ContiguousKVCache, build_attention_mask


def test_causal_mask_over_prefix_and_new_tokens() -> None:
    mask = build_attention_mask((2,), 3, 5, None, torch.device("cpu"))
    assert mask.shape == (1, 1, 3, 5)
    assert mask[0, 0].int().tolist() == [[1, 1, 1, 0, 0], [1, 1, 1, 1, 0], [1, 1, 1, 1, 1]]
    assert build_attention_mask((4,), 1, 5, None, torch.device("cpu")) is None


def test_tree_mask_keeps_prefix_visible() -> None:
    tree = torch.tensor([[1, 0, 0], [1, 1, 0], [1, 0, 1]], dtype=torch.bool)
    mask = build_attention_mask((2,), 3, 5, tree, torch.device("cpu"))
    assert mask[0, 0].int().tolist() == [[1, 1, 1, 0, 0], [1, 1, 1, 1, 0], [1, 1, 1, 0, 1]]


def test_write_read_truncate_and_memory() -> None:
    cache = ContiguousKVCache(num_layers=2, num_kv_heads=1, head_dim=4, max_len=8, max_seqs=2)
    layout = cache.prepare((0,), 3)
    k = torch.arange(12.0).view(1, 1, 3, 4)
    keys, values = cache.update(0, layout, k, -k)
    assert torch.equal(keys, k) and torch.equal(values, -k)
    assert cache.length(0) == 3 and cache.length(1) == 0
    memory = cache.memory()
    assert memory.bytes_per_token == 2 * 2 * 1 * 4 * 4
    assert memory.bytes_used == 3 * memory.bytes_per_token
    assert memory.bytes_reserved == 2 * 8 * memory.bytes_per_token
    cache.truncate(0, 1)
    layout = cache.prepare((0,), 1)
    assert layout.starts == (1,) and layout.key_len == 2
    keys, _ = cache.update(0, layout, torch.full((1, 1, 1, 4), 9.0), torch.zeros(1, 1, 1, 4))
    assert keys[0, 0, 1].tolist() == [9.0] * 4 and keys[0, 0, 0].tolist() == [0.0, 1.0, 2.0, 3.0]
    with pytest.raises(ValueError):
        cache.truncate(0, 5)


def test_rows_of_different_lengths_do_not_see_each_others_slots() -> None:
    cache = ContiguousKVCache(num_layers=1, num_kv_heads=1, head_dim=2, max_len=8, max_seqs=2)
    cache.prepare((0,), 3)
    layout = cache.prepare((0, 1), 1)
    assert layout.starts == (3, 0) and layout.key_len == 4
    assert layout.mask[:, 0, 0].int().tolist() == [[1, 1, 1, 1], [1, 0, 0, 0]]


def test_overflow_is_refused() -> None:
    cache = ContiguousKVCache(num_layers=1, num_kv_heads=1, head_dim=2, max_len=4)
    with pytest.raises(ValueError, match="holds 4 tokens"):
        cache.prepare((0,), 5)


def test_keep_moves_chosen_slots_into_place() -> None:
    cache = ContiguousKVCache(num_layers=2, num_kv_heads=1, head_dim=1, max_len=10, max_seqs=2)
    values = torch.arange(7.0).view(1, 1, 7, 1)  # slot j holds j
    layout = cache.prepare((1,), 7)
    for layer in range(2):
        cache.update(layer, layout, values, -values)
    cache.keep(1, 2, [0, 3, 4])  # keep slot 2, then slots 5 and 6
    assert cache.length(1) == 5
    assert cache.k[:, 1, 0, :5, 0].tolist() == [[0, 1, 2, 5, 6]] * 2
    assert cache.v[:, 1, 0, :5, 0].tolist() == [[0, -1, -2, -5, -6]] * 2
    with pytest.raises(ValueError, match="outside"):
        cache.keep(1, 2, [3])
