"""Paged KV cache: block tables, slot mapping, prefix sharing, copy on write, and greedy equality with the
contiguous cache for every algorithm. Allocator and cache invariants are checked by hypothesis."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from playground.config import GenerationParams
from playground.decoding.medusa import MedusaParams
from playground.decoding.registry import build_proposer
from playground.decoding.speculative import SpeculativeParams
from playground.kv import ContiguousKVCache, OutOfBlocksError, PagedKVCache
from playground.kv.blocks import BlockKey

from .prompts import NEW_TOKENS, assert_greedy_exact

LAYERS = 2


def paged(num_blocks: int = 8, block_size: int = 4) -> PagedKVCache:
    return PagedKVCache(num_layers=LAYERS, num_kv_heads=1, head_dim=1, num_blocks=num_blocks, block_size=block_size)


def write(cache, seq: int, values: list[int]) -> torch.Tensor:
    """Append one token per value (k = value, v = -value) to `seq` in one forward; the keys layer 0 reads."""
    layout = cache.prepare((seq,), len(values))
    k = torch.tensor(values, dtype=torch.float32).view(1, 1, len(values), 1)  # (1, Hkv, T, D)
    keys = [cache.update(layer, layout, k, -k)[0] for layer in range(LAYERS)]
    return keys[0]


def contents(cache: PagedKVCache, seq: int) -> list[int]:
    """The keys of a sequence in logical order, read straight from the pool through its block table."""
    bs, table = cache.block_size, cache.blocks.table(seq)
    slots = [table[j // bs] * bs + j % bs for j in range(cache.length(seq))]
    for layer in range(LAYERS):
        assert torch.equal(cache.v[layer, slots], -cache.k[layer, slots])
    return [int(x) for x in cache.k[LAYERS - 1, slots, 0, 0].tolist()]


def test_slot_mapping_reads_keys_in_logical_order() -> None:
    cache = paged()
    keys = write(cache, 0, [10, 11, 12, 13, 14, 15])
    assert keys.flatten().tolist() == [10, 11, 12, 13, 14, 15]
    assert len(cache.blocks.table(0)) == 2 and contents(cache, 0) == [10, 11, 12, 13, 14, 15]
    keys = write(cache, 0, [16])
    assert keys.flatten().tolist() == [10, 11, 12, 13, 14, 15, 16]
    memory = cache.memory()
    assert (memory.tokens, memory.blocks_used, memory.blocks_total) == (7, 2, 8)
    assert memory.bytes_reserved == 8 * memory.bytes_per_token and memory.bytes_wasted == memory.bytes_per_token


def test_truncate_releases_blocks_and_keep_moves_slots_across_blocks() -> None:
    cache = paged()
    write(cache, 0, list(range(10)))
    cache.truncate(0, 5)
    assert len(cache.blocks.table(0)) == 2 and cache.blocks.num_free == 6
    write(cache, 0, [50, 51, 52, 53, 54])  # slots 5..9
    cache.keep(0, 5, [0, 2, 4])  # 50, 52, 54 move to slots 5, 6, 7
    assert contents(cache, 0) == [0, 1, 2, 3, 4, 50, 52, 54]
    assert cache.blocks.num_free == 6
    with pytest.raises(ValueError, match="outside"):
        cache.keep(0, 6, [2])
    with pytest.raises(ValueError, match="cannot truncate"):
        cache.truncate(0, 9)


def test_rows_of_different_lengths_share_the_contiguous_mask() -> None:
    cache, reference = paged(), ContiguousKVCache(num_layers=LAYERS, num_kv_heads=1, head_dim=1, max_len=8,
                                                  max_seqs=2)
    for c in (cache, reference):
        write(c, 0, [1, 2, 3])
    layout, expected = cache.prepare((0, 1), 1), reference.prepare((0, 1), 1)
    assert torch.equal(layout.mask, expected.mask) and layout.starts == (3, 0)
    k = torch.tensor([7.0, 8.0]).view(2, 1, 1, 1)
    keys, _ = cache.update(0, layout, k, -k)  # (2, 1, 4, 1)
    assert keys[0].flatten().tolist() == [1, 2, 3, 7] and keys[1, 0, 0, 0] == 8


def test_prefix_blocks_are_shared_and_copied_on_write() -> None:
    cache = paged()
    prompt = [1, 2, 3, 4, 5, 6, 7, 8, 9]
    assert cache.blocks.add_sequence(0, prompt) == 0
    write(cache, 0, prompt)
    # A second prompt with the same first 8 tokens reuses both full blocks and computes from token 8 on.
    assert cache.blocks.add_sequence(1, prompt[:8] + [99, 98]) == 8
    assert cache.blocks.table(1) == cache.blocks.table(0)[:2]
    write(cache, 1, [99, 98])
    memory = cache.memory()
    assert memory.blocks_shared == 2 and memory.blocks_used == 4 and memory.tokens == 9 + 2
    # The same prompt again: every full block hits, but its last token is recomputed for its logits, which
    # writes into a shared block: that block is copied first and the other holders keep theirs.
    same = prompt[:8]
    assert cache.blocks.add_sequence(2, same) == 7
    shared_before = cache.blocks.table(0)[1]
    write(cache, 2, [8])
    assert cache.blocks.table(2)[1] != shared_before and cache.blocks.table(0)[1] == shared_before
    assert contents(cache, 2) == prompt[:8] and contents(cache, 0) == prompt and contents(cache, 1)[-2:] == [99, 98]


def test_prefix_blocks_reports_blocks_still_being_computed_as_promised() -> None:
    cache = paged()
    prompt = [1, 2, 3, 4, 5, 6, 7, 8, 9]
    assert cache.blocks.prefix_blocks(prompt) == (0, 0)
    cache.blocks.add_sequence(0, prompt)  # its two full blocks are promised until written
    assert cache.blocks.prefix_blocks(prompt) == (0, 2)
    assert cache.blocks.prefix_blocks(prompt[:4] + [0, 0, 0, 0]) == (0, 1)  # the chain stops at the first difference
    write(cache, 0, prompt[:6])  # the first block is written (and registered), the second not yet
    assert cache.blocks.prefix_blocks(prompt) == (1, 2)
    write(cache, 0, prompt[6:])
    assert cache.blocks.prefix_blocks(prompt) == (2, 2)
    assert cache.blocks.add_sequence(1, prompt) == 8
    cache.blocks.free(0)
    cache.blocks.free(1)
    assert cache.blocks.prefix_blocks(prompt) == (2, 2)  # freed blocks stay findable until handed out
    cache.blocks.add_sequence(2, [7, 7, 7, 7])
    cache.blocks.free(2)  # freed before writing: nothing is promised any more
    assert cache.blocks.prefix_blocks([7, 7, 7, 7]) == (0, 0)


def test_a_freed_prefix_stays_reusable_until_its_blocks_are_handed_out() -> None:
    cache = paged(num_blocks=3)
    cache.blocks.add_sequence(0, [1, 2, 3, 4, 5])
    write(cache, 0, [1, 2, 3, 4, 5])
    cache.blocks.free(0)
    assert cache.blocks.num_free == 3
    assert cache.blocks.add_sequence(1, [1, 2, 3, 4, 5, 6]) == 4
    write(cache, 1, [5, 6])
    assert contents(cache, 1) == [1, 2, 3, 4, 5, 6]
    cache.blocks.free(1)
    write(cache, 2, list(range(12)))  # takes every block, the cached prefix included
    assert cache.blocks.add_sequence(3, [1, 2, 3, 4, 5]) == 0


def test_a_hash_hit_with_other_tokens_is_refused() -> None:
    cache = paged()
    cache.blocks.add_sequence(0, [1, 2, 3, 4])
    write(cache, 0, [1, 2, 3, 4])
    cache.blocks.add_sequence(1, [9])  # registers seq 0's block
    (block,) = cache.blocks.table(0)
    key = cache.blocks.allocator._key_of[block]
    assert cache.blocks.allocator.lookup(key) == block
    assert cache.blocks.allocator.lookup(BlockKey(key.hash, key.parent, (4, 3, 2, 1))) is None


def test_running_out_of_blocks_changes_nothing() -> None:
    cache = paged(num_blocks=2)
    write(cache, 0, [1, 2, 3, 4, 5])
    with pytest.raises(OutOfBlocksError, match="needs 1 more KV blocks; 0 of 2 are free"):
        write(cache, 0, [6, 7, 8, 9])
    assert cache.length(0) == 5 and contents(cache, 0) == [1, 2, 3, 4, 5]


OPS = st.lists(st.tuples(st.sampled_from(["add", "add", "write", "truncate", "free"]), st.integers(0, 4),
                         st.lists(st.integers(1, 2), min_size=1, max_size=7)), max_size=40)


@settings(max_examples=300, deadline=None)
@given(OPS)
def test_random_operations_keep_the_cache_consistent(ops) -> None:
    """Sequences draw tokens from a tiny alphabet so prefixes repeat; a token's key is its id, so every
    sequence must read back exactly its own tokens whether its blocks are its own or shared."""
    cache = paged(num_blocks=12, block_size=2)
    model: dict[int, list[int]] = {}
    for op, seq, tokens in ops:
        if op == "add" and seq not in model:
            cached = cache.blocks.add_sequence(seq, tokens)  # a prompt: its first forward writes the rest of it
            assert cached <= len(tokens) - 1 and contents(cache, seq) == tokens[:cached]
            try:
                write(cache, seq, tokens[cached:])
            except OutOfBlocksError:
                cache.blocks.free(seq)
            else:
                model[seq] = list(tokens)
        elif op == "write" and (seq in model or not cache.blocks.has_sequence(seq)):
            try:
                write(cache, seq, tokens)
            except OutOfBlocksError:
                assert cache.length(seq) == len(model.get(seq, []))
            else:
                model.setdefault(seq, []).extend(tokens)
        elif op == "truncate" and seq in model:
            cut = len(model[seq]) // 2
            cache.truncate(seq, cut)
            del model[seq][cut:]
        elif op == "free" and seq in model:
            cache.blocks.free(seq)
            del model[seq]
        for s, expected in model.items():
            assert contents(cache, s) == expected
        holders: dict[int, int] = {}
        for s in model:
            table = cache.blocks.table(s)
            assert len(table) == -(-len(model[s]) // cache.block_size)
            for block in table:
                holders[block] = holders.get(block, 0) + 1
        assert all(cache.blocks.allocator.refs[b] == holders.get(b, 0) for b in range(12))
        assert cache.blocks.num_free == 12 - len(holders)
    for s in list(model):
        cache.blocks.free(s)
    assert cache.blocks.num_free == 12 and not any(cache.blocks.allocator.refs)


GREEDY_PAGED = GenerationParams(max_new_tokens=NEW_TOKENS, kv="paged", block_size=4)


@pytest.mark.parametrize("algo", ["ar", "speculative", "prompt-lookup", "lookahead", "medusa"])
def test_every_algorithm_is_greedy_exact_on_the_paged_cache(target, noisy_draft, plain_outputs, algo) -> None:
    params = {"speculative": SpeculativeParams(gamma=3), "medusa": MedusaParams(tree="small")}.get(algo)
    proposer = build_proposer(target, algo, params, draft=noisy_draft if algo == "speculative" else None)
    assert_greedy_exact(target, proposer, plain_outputs, GREEDY_PAGED)
