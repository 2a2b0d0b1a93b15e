"""Medusa: tree buffers against hand-computed trees (grafted copies too), the dynamic tree's choice by hand, greedy
exactness on every test prompt with the dynamic and three named trees, with copies and on both caches, the tree
samplers against the analytic distribution (synthetic and on the real model, named and dynamic trees, with and
without copies), typical acceptance lossy, bad settings."""

from __future__ import annotations

import heapq
import itertools
import json
import math
import random
import re
from itertools import combinations

import pytest
import torch
from safetensors.torch import load_file, save_file

from playground.config import ConfigError, GenerationParams, ModelSpec, SamplingParams
from playground.decoding import encode_prompt
from playground.decoding.base import new_cache
from playground.decoding.costs import ForwardCosts
from playground.decoding.medusa import CPU_DYNAMIC_NODES, GPU_DYNAMIC_NODES, MedusaParams, dynamic_nodes
from playground.decoding.prompt_lookup import PromptLookupParams
from playground.decoding.proposer import Proposer
from playground.decoding.registry import build_proposer
from playground.decoding.tree import COPY_PRIOR, TREES, best_first, build_tree, load_tree
from playground.engine import generate
from playground.metrics import compute
from playground.models import ModelLoadError, load_model
from playground.models.medusa import load_heads, save_heads

from .prompts import NEW_TOKENS, PROMPTS, assert_greedy_exact
from .stats import assert_follows_target

REPEATING = "red green blue red green blue red green"  # its continuation is mostly a copy of itself
COPIES = PromptLookupParams(max_ngram=3, branches=1)
FREE = ForwardCosts((1, 2), (1.0, 1.0))  # a wider forward costs what a one-token one does


@pytest.fixture(scope="module")
def heads(target):
    return load_heads(None, target)  # the heads shipped for the embedded model


def test_tree_buffers_of_a_small_tree_by_hand() -> None:
    # given out of order: nodes become 1 = (0,), 2 = (1,), 3 = (0, 0), 4 = (0, 1)
    tree = build_tree([[0, 1], [1], [0], [0, 0]])
    assert tree.paths == ((0,), (1,), (0, 0), (0, 1))
    assert tree.parents == (-1, 0, 0, 1, 1) and tree.depths == (0, 1, 1, 2, 2)
    assert tree.children == ((1, 2), (3, 4), (), (), ())
    assert tree.mask.int().tolist() == [[1, 0, 0, 0, 0],
                                        [1, 1, 0, 0, 0],
                                        [1, 0, 1, 0, 0],
                                        [1, 1, 0, 1, 0],
                                        [1, 1, 0, 0, 1]]
    assert tree.retrieve == ((0, 2), (0, 1, 3), (0, 1, 4))
    assert tree.top_k() == [2, 2] and tree.num_nodes == 4 and tree.depth == 2


def test_tree_buffers_of_a_chain_and_the_named_trees() -> None:
    chain = build_tree(TREES["chain"])
    assert chain.depths == (0, 1, 2, 3, 4) and chain.retrieve == ((0, 1, 2, 3, 4),)
    assert torch.equal(chain.mask, torch.ones(5, 5, dtype=torch.bool).tril())  # a chain is causal
    for name, paths in TREES.items():
        tree = build_tree(paths)
        assert tree.num_nodes == len(paths) and all(len(r) - 1 == tree.depths[r[-1]] for r in tree.retrieve)
        # every node appears on some root-to-leaf path, and sees exactly its depth + 1 tokens
        assert {n for r in tree.retrieve for n in r} == set(range(tree.num_nodes + 1)), name
        assert tree.mask.sum(1).tolist() == [d + 1 for d in tree.depths]


@pytest.mark.parametrize("paths, message", [
    ([], "a non-empty list of paths"),
    ([[0], [0]], "appears twice"),
    ([[0], [1, 0]], "needs its parent [1]"),
    ([[0], [-1]], "ranks in [0, 63]"),
    ([[0], []], "list of 1..16 ranks"),
    ("small", "a non-empty list of paths"),
])
def test_bad_trees_are_refused_with_the_reason(paths, message) -> None:
    with pytest.raises(ConfigError, match=re.escape(message)):
        build_tree(paths)


def test_custom_tree_from_a_json_file(tmp_path) -> None:
    path = tmp_path / "tree.json"
    path.write_text(json.dumps([[0], [1], [0, 0]]))
    assert load_tree(str(path)).paths == ((0,), (1,), (0, 0))
    path.write_text("{not json")
    with pytest.raises(ConfigError, match="is not a JSON list of paths"):
        load_tree(str(path))
    with pytest.raises(ConfigError, match="tree must be one of dynamic, chain, small, medium, wide"):
        load_tree("bushy")


# Two heads of two ranks: head 0 gives 10 (0.6) or 11 (0.25), head 1 gives 20 (0.5) or 21 (0.45).
LOGP = [[math.log(0.6), math.log(0.25)], [math.log(0.5), math.log(0.45)]]
TOKENS = [[10, 11], [20, 21]]


def test_the_dynamic_tree_takes_the_likeliest_candidates_by_hand() -> None:
    # estimates: (0,) 0.6, (0, 0) 0.3, (0, 1) 0.27, (1,) 0.25, (1, 0) 0.125, (1, 1) 0.1125
    assert best_first(LOGP, TOKENS, [], 3) == (((0,), (0, 0), (0, 1)), 0)
    assert best_first(LOGP, TOKENS, [], 4) == (((0,), (0, 0), (0, 1), (1,)), 0)
    assert best_first(LOGP, TOKENS, [], 10) == (((0,), (0, 0), (0, 1), (1,), (1, 0), (1, 1)), 0)  # all there are


def every_child_best_first(logp: list[list[float]], tokens: list[list[int]], copy: list[int],
                           nodes: int) -> tuple[tuple[tuple[int, ...], ...], int]:
    """The dynamic tree's choice as first written: every child of a chosen node on the heap at once (O(nodes x k)
    pushes). `best_first` reveals a head's ranks one at a time; both must choose the same nodes in the same order."""
    prior, order = math.log(COPY_PRIOR), itertools.count()
    frontier: list = []

    def offer(path: tuple[int, ...], score: float, on_copy: bool) -> None:
        depth = len(path)
        copied = copy[depth] if on_copy and depth < len(copy) else None
        if depth < len(logp):
            for rank, (lp, token) in enumerate(zip(logp[depth], tokens[depth])):
                lp = max(lp, prior) if token == copied else lp
                heapq.heappush(frontier, (-(score + lp), next(order), path + (rank,), token == copied))
        if copied is not None and (depth >= len(logp) or copied not in tokens[depth]):
            heapq.heappush(frontier, (-(score + prior), next(order), None, True))

    chosen, chain, copy_depth = [], 0, 0
    offer((), 0.0, True)
    while frontier and len(chosen) + chain < nodes:
        estimate, _, path, on_copy = heapq.heappop(frontier)
        if path is None:
            chain += 1
            if copy_depth + chain < len(copy):
                heapq.heappush(frontier, (estimate - prior, next(order), None, True))
            continue
        chosen.append(path)
        copy_depth = len(path) if on_copy else copy_depth
        offer(path, -estimate, on_copy)
    return tuple(chosen), chain


def test_the_dynamic_tree_ranks_a_copy_among_the_heads_candidates_by_hand() -> None:
    # The copy proposes 11, 30, 31. Token 11 is head 0's rank 1: as the copy's it is worth COPY_PRIOR 0.8. Token 30
    # is not among head 1's candidates, so the copy goes on as its own nodes below (1,): 0.64, then 0.512, with
    # nothing else below them. Order: (1,) 0.8, copy 0.64, (0,) 0.6, copy 0.512, (1, 0) 0.4, (1, 1) 0.36, ...
    assert best_first(LOGP, TOKENS, [11, 30, 31], 2) == (((1,),), 1)
    assert best_first(LOGP, TOKENS, [11, 30, 31], 5) == (((1,), (0,), (1, 0)), 2)
    assert best_first(LOGP, TOKENS, [11, 30, 31], 7) == (((1,), (0,), (1, 0), (1, 1), (0, 0)), 2)
    # a copy whose first token no head proposes starts its own chain at the root; one past the heads' depth too
    assert best_first(LOGP, TOKENS, [12], 3) == (((0,), (0, 0)), 1)
    assert best_first(LOGP, TOKENS, [10, 20, 40], 4) == (((0,), (0, 0), (0, 1)), 1)


def test_the_dynamic_tree_reveals_ranks_lazily_yet_chooses_as_if_it_saw_them_all() -> None:
    """Random heads (1-5 deep, 1-12 ranks, log-probabilities on three scales) and copies that often run through
    the heads' candidates, for 1-64 nodes: the same nodes, in the same order, as pushing every child at once."""
    rng = random.Random(0)
    for _ in range(3000):
        depth, k, nodes = rng.randint(1, 5), rng.randint(1, 12), rng.randint(1, 64)
        logp = [sorted((math.log(rng.random() + 1e-9) * rng.choice([0.2, 1, 3]) for _ in range(k)), reverse=True)
                for _ in range(depth)]
        tokens = [rng.sample(range(max(k, 10)), k) for _ in range(depth)]
        copy = [rng.randrange(12) for _ in range(rng.randint(0, 8))]
        assert best_first(logp, tokens, copy, nodes) == every_child_best_first(logp, tokens, copy, nodes)


def test_the_dynamic_tree_is_a_tree_of_the_requested_size() -> None:
    generator = torch.Generator().manual_seed(0)
    for nodes in (1, 5, 11, 30):
        logp = torch.randn(4, 8, generator=generator).log_softmax(-1).sort(-1, descending=True).values.tolist()
        tokens = [list(range(100 * d, 100 * d + 8)) for d in range(4)]
        paths, chain = best_first(logp, tokens, [100, 207, 300, 401, 555, 556], nodes)
        assert len(paths) + chain == nodes and len(set(paths)) == len(paths)
        assert all(len(p) == 1 or p[:-1] in paths[: paths.index(p)] for p in paths)  # every parent chosen first


def medusa(target, heads, copies: PromptLookupParams | None = None, **settings) -> Proposer:
    """Medusa's proposer over `heads` with `settings` (MedusaParams fields), copies grafted on where given."""
    return build_proposer(target, "medusa", MedusaParams(**settings), copies, heads=heads)


@pytest.mark.parametrize("tree", ["dynamic", "small", "medium", "wide"])
def test_greedy_equals_plain_decoding(target, heads, plain_outputs, tree) -> None:
    accepted, _ = assert_greedy_exact(target, medusa(target, heads, tree=tree), plain_outputs)
    assert accepted > 0  # the heads really proposed tokens the target kept


@pytest.mark.parametrize("tree, copy_ngram, options", [("dynamic", 3, {}), ("dynamic", 1, {"nodes": 16}),
                                                       ("small", 3, {}), ("wide", 1, {}), ("chain", 8, {})])
def test_greedy_with_copies_equals_plain_decoding(target, heads, plain_outputs, tree, copy_ngram, options) -> None:
    proposer = medusa(target, heads, PromptLookupParams(max_ngram=copy_ngram, num_draft=6, branches=1), tree=tree,
                      **options)
    assert_greedy_exact(target, proposer, plain_outputs)
    generation = GenerationParams(max_new_tokens=NEW_TOKENS)
    grafted = sum(bool(e.noted("copied")) for prompt in PROMPTS[:6]
                  for e in generate(target, prompt, proposer, SamplingParams(), generation)[1].events
                  if e.KIND == "draft")
    assert grafted > 0  # copies really were grafted onto trees


def test_the_dynamic_tree_takes_its_default_nodes(target, heads) -> None:
    """By default the dynamic tree has CPU_DYNAMIC_NODES nodes on a CPU; `nodes` sets another size; no forward
    verifies more, even where a wider forward costs nothing."""
    assert dynamic_nodes(gpu=False) == CPU_DYNAMIC_NODES and dynamic_nodes(gpu=True) == GPU_DYNAMIC_NODES
    for nodes in (None, 7):
        proposer = medusa(target, heads, nodes=nodes)
        expected = nodes or CPU_DYNAMIC_NODES
        assert proposer.describe()["nodes"] == expected
        _, trace = generate(target, "Repeat exactly: the cat sat on the mat, the dog sat on the log.", proposer,
                            SamplingParams(), GenerationParams(max_new_tokens=24), costs=FREE)
        assert max(e.num_tokens for e in trace.events if e.KIND == "verify") == expected + 1


def test_the_dynamic_tree_takes_the_gpu_width_on_a_gpu(target, heads, monkeypatch) -> None:
    """The proposer asks for the GPU's width when the target's weights are on a CUDA device (the device is faked:
    building the proposer creates no tensor on it)."""
    from playground.models.transformer import Transformer

    monkeypatch.setattr(Transformer, "device", property(lambda self: torch.device("cuda")))
    for nodes in (None, 7):
        assert medusa(target, heads, nodes=nodes).describe()["nodes"] == (nodes or GPU_DYNAMIC_NODES)


def test_greedy_exact_on_the_paged_cache(target, heads, plain_outputs) -> None:
    generation = GenerationParams(max_new_tokens=NEW_TOKENS, kv="paged")
    for copies in (None, PromptLookupParams(branches=1)):
        proposer = medusa(target, heads, copies)
        for prompt in PROMPTS[:8]:
            assert generate(target, prompt, proposer, SamplingParams(), generation)[0].token_ids == \
                plain_outputs[prompt], prompt


@pytest.mark.parametrize("tree, copies", [("chain", None), ("dynamic", None), ("chain", COPIES), ("dynamic", COPIES)],
                         ids=["chain", "dynamic", "chain-copies", "dynamic-copies"])
def test_lossless_medusa_on_the_real_model_matches_the_target_distribution(target, heads, tree, copies) -> None:
    """The first two tokens (the second a verified proposal in most runs) follow the target's joint, on a prompt
    whose continuation is mostly a copy of itself when copies are grafted on."""
    sampling = SamplingParams(temperature=1.0, top_k=4)
    generation = GenerationParams(max_new_tokens=3, raw=True)
    prompt = REPEATING if copies else "The best thing about summer is"
    proposed = assert_follows_target(target, medusa(target, heads, copies, tree=tree), prompt, sampling, generation)
    assert proposed > 150


def test_same_seed_same_output_and_typical_differs_from_lossless(target, heads) -> None:
    def run(seed: int, acceptance: str, prompt: str = "Write a sentence about the sea.", copies=None) -> tuple:
        return generate(target, prompt, medusa(target, heads, copies, acceptance=acceptance),
                        SamplingParams(temperature=0.8, seed=seed), GenerationParams(max_new_tokens=24))[0].token_ids

    assert run(3, "lossless") == run(3, "lossless") and run(3, "typical") == run(3, "typical")
    assert run(3, "lossless") != run(4, "lossless")
    assert any(run(seed, "lossless") != run(seed, "typical") for seed in range(3))  # typical is lossy
    copying = "Say 'la la la' ten times."
    assert run(1, "lossless", copying, COPIES) == run(1, "lossless", copying, COPIES)
    assert run(1, "lossless", copying, COPIES) != run(2, "lossless", copying, COPIES)


def test_bad_medusa_settings_name_the_field(target, heads, tmp_path) -> None:
    with pytest.raises(ConfigError, match="acceptance must be one of"):
        MedusaParams(acceptance="greedy")
    with pytest.raises(ConfigError, match=r"epsilon must be in \(0, 1\]"):
        MedusaParams(epsilon=0)
    with pytest.raises(ConfigError, match=r"nodes must be an integer in \[1, 64\], got 0"):
        MedusaParams(nodes=0)
    with pytest.raises(ConfigError, match="nodes sizes the dynamic tree only; tree 'wide' has its own nodes"):
        MedusaParams(tree="wide", nodes=8)
    with pytest.raises(ConfigError, match=r"medusa.depth must be in \[1, 4\]"):
        medusa(target, heads, depth=5)
    deep = tmp_path / "deep.json"
    deep.write_text(json.dumps([[0] * d for d in range(1, 7)]))
    with pytest.raises(ConfigError, match="tree: depth 6 needs that many heads; 4 are used"):
        medusa(target, heads, tree=str(deep))
    with pytest.raises(ModelLoadError, match="is not a folder with config.json and medusa.safetensors"):
        load_heads(str(tmp_path), target)
    old = tmp_path / "old"  # heads saved before they read the next token's embedding
    old.mkdir()
    (old / "config.json").write_text(json.dumps({"num_heads": 4, "hidden_size": 576, "vocab_size": 49152}))
    (old / "medusa.safetensors").write_bytes((heads.folder / "medusa.safetensors").read_bytes())
    with pytest.raises(ModelLoadError, match="read only the hidden state .an earlier format.; retrain"):
        load_heads(str(old), target)


def test_heads_read_the_token_the_hidden_state_predicted(target, heads) -> None:
    """The same hidden state with a different next token gives different guesses: the heads see that token."""
    cache = new_cache(target.model, 64, GenerationParams())
    ids = encode_prompt(target, "The capital of France is", GenerationParams())
    with torch.inference_mode():
        _, hidden = target.model(torch.tensor([ids]), torch.arange(len(ids)).unsqueeze(0), cache, (0,),
                                 num_logits=0)  # hidden: (1, T, E)
    lasts = target.tokenizer.encode(" Paris London cat")
    logits = [heads.logits(hidden[0, -1], target.model.embed_tokens.weight[last]) for last in lasts]  # each (K, V')
    assert len({tuple(row.argmax(-1).tolist()) for row in logits}) > 1
    assert not any(torch.allclose(a, b, atol=1e-3) for a, b in combinations(logits, 2))


@pytest.fixture(scope="module")
def float_target(target):
    """The embedded model's blocks against float32 activations: PyTorch's float products agree with it to the last
    bits (beside the default target, the heads' products run in integers on 8-bit activations)."""
    return load_model(ModelSpec(device="cpu", weights="gguf"))


def test_fused_blocks_propose_what_the_heads_module_does(float_target) -> None:
    """Decoding runs the heads' blocks as one stacked product: the logits the module's heads give one by one."""
    target, heads = float_target, load_heads(None, float_target)
    torch.manual_seed(5)
    hidden, lasts = torch.randn(3, 576), [42, 1000, 7]
    embedding = target.model.embed_tokens.weight[lasts]  # (3, E)
    reference = heads.output.logits(heads.heads(hidden, embedding))  # (K, 3, V'), head by head
    torch.testing.assert_close(heads.logits(hidden, embedding), reference, atol=1e-4, rtol=1e-4)


@pytest.fixture(scope="module")
def narrow_heads(target, heads, plain_outputs, tmp_path_factory):
    """The shipped heads' weights restricted to a small vocabulary: ids 0-99 and the tokens of six plain answers."""
    keep = {t for prompt in PROMPTS[:6] for t in plain_outputs[prompt]} | set(range(100))
    folder = tmp_path_factory.mktemp("narrow")
    save_heads(heads.heads, folder, target, torch.float32, torch.tensor(sorted(keep)))
    return load_heads(str(folder), target)


def test_reduced_vocabulary_logits_are_the_full_projection_restricted(float_target, narrow_heads) -> None:
    target, heads = float_target, load_heads(None, float_target)
    narrow_heads = load_heads(str(narrow_heads.folder), float_target)
    hidden, embedding = torch.randn(576), target.model.embed_tokens.weight[42]
    full = target.model.project(heads.heads(hidden, embedding))  # (K, V)
    narrow = narrow_heads.logits(hidden, embedding)  # (K, V')
    assert narrow.shape == (4, narrow_heads.vocab_size)
    torch.testing.assert_close(narrow, full[:, narrow_heads.vocab_ids], atol=1e-4, rtol=1e-4)


def test_reduced_vocabulary_heads_propose_only_their_tokens_and_stay_exact(target, narrow_heads,
                                                                           plain_outputs) -> None:
    allowed = set(narrow_heads.vocab_ids.tolist())
    proposer = medusa(target, narrow_heads)
    accepted = 0
    for prompt in PROMPTS[:6]:
        output, trace = generate(target, prompt, proposer, SamplingParams(),
                                 GenerationParams(max_new_tokens=NEW_TOKENS))
        assert output.token_ids == plain_outputs[prompt], prompt
        assert all({t.id for t in e.tokens} <= allowed for e in trace.events if e.KIND == "draft")
        accepted += compute(trace).accepted
    assert accepted > 0


def test_malformed_reduced_vocabularies_are_refused(target, heads, tmp_path) -> None:
    for name, ids in {"unsorted": [5, 3], "repeated": [3, 3], "out-of-range": [3, 49152],
                      "floats": torch.tensor([1.0, 2.0])}.items():
        save_heads(heads.heads, tmp_path / name, target, torch.float32, torch.tensor([0]))
        tensors = load_file(str(tmp_path / name / "medusa.safetensors"))
        tensors["vocab_ids"] = ids if isinstance(ids, torch.Tensor) else torch.tensor(ids)
        save_file(tensors, str(tmp_path / name / "medusa.safetensors"))
        with pytest.raises(ModelLoadError, match="malformed 'vocab_ids' tensor; it must list 1 to 49152 distinct"):
            load_heads(str(tmp_path / name), target)


def test_a_tree_wider_than_the_heads_vocabulary_is_refused(target, heads, tmp_path) -> None:
    save_heads(heads.heads, tmp_path, target, torch.float32, torch.tensor([4, 8, 15]))
    with pytest.raises(ConfigError, match="tree: a depth takes the top 5 tokens; the heads score only 3"):
        medusa(target, load_heads(str(tmp_path), target), tree="wide")


def test_the_heads_run_only_where_their_price_pays(target, plain_outputs) -> None:
    """The heads' forward, once a step, is priced like a draft's: at a price no step repays they never run (plain
    decoding's steps, or copies alone where copies are grafted on), at nothing they guess."""
    prompt, generation = PROMPTS[0], GenerationParams(max_new_tokens=NEW_TOKENS)

    def guessed(trace) -> int:  # steps whose proposal holds a token beyond the copy it may carry
        copies = [(e, e.noted("copied")) for e in trace.events if e.KIND == "draft"]
        return sum(c is None or len(e.tokens) > c["source"][1] - c["source"][0] for e, c in copies)
    for copies in (None, COPIES):
        proposer = build_proposer(target, "medusa", MedusaParams(), copies)
        heads = proposer.inner if copies else proposer
        heads.own.fixed = 10.0
        output, trace = generate(target, prompt, proposer, SamplingParams(), generation)
        assert output.token_ids == plain_outputs[prompt] and guessed(trace) == 0
        if copies is None:
            assert not any(e.KIND == "draft" for e in trace.events)
        heads.own.fixed = 0.0
        output, trace = generate(target, prompt, proposer, SamplingParams(), generation)
        assert output.token_ids == plain_outputs[prompt] and guessed(trace) > 0
