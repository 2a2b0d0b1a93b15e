"""EAGLE: greedy exactness on every test prompt with the shipped head, alone and with prompt lookup's copies grafted
on, on both caches and in batches with chunked prefills and preemption; sampled outputs are plain decoding's for the
same seed and follow the target's distribution (chi-square); the head's trees (parents first, within the budget,
nothing below an end of sequence) and a copy grafted onto one; the head reads every feature once; a head reading
the target's tapped layers (EAGLE-3's input), exact as above, and its trainer; bad heads and settings; the trainer's
unrolled passes; the script that compares the heads' inputs."""

from __future__ import annotations

import dataclasses
import json
import time

import pytest
import torch
from safetensors.torch import save_file

from playground.config import ConfigError, EngineParams, GenerationParams, SamplingParams
from playground.decoding.costs import ForwardCosts
from playground.decoding.eagle import EagleParams, EagleProposer
from playground.decoding.grafted import graft
from playground.decoding.prompt_lookup import PromptLookupParams
from playground.decoding.proposer import Drafted, Proposal
from playground.decoding.registry import build_proposer
from playground.engine import Engine, generate
from playground.metrics import compute, depth_profile
from playground.models import ModelLoadError, native
from playground.models.eagle import (
    CONFIG,
    EMBEDDED_EAGLE,
    TAPPED,
    WEIGHTS,
    EagleHead,
    default_head,
    head_config,
    load_head,
    save_head,
)
from playground.sampling import Lossless
from playground.trace import AcceptEvent, DraftEvent, TokenInfo, Trace

from .prompts import NEW_TOKENS, PROMPTS, assert_greedy_exact
from .stats import assert_follows_target, reference_tokens


@pytest.fixture(scope="module")
def head(target):
    return load_head(None, target)  # the head shipped for the embedded model


@pytest.fixture(scope="module")
def tapped(target, head, tmp_path_factory):
    """A head that reads layers 2, 15 and 29 as an EAGLE-3 head does: the shipped head's weights, and a mix that
    passes on layer 29's input, scaled, times the final norm's weights: the final-norm features the shipped head
    learned from but for the last layer's own addition, so that its guesses are kept often enough to test."""
    e = target.model.config.hidden_size
    module = EagleHead(head.head.config, (2, 15, 29))
    mix = torch.zeros(e, 3 * e)
    mix[:, 2 * e :] = torch.diag(target.model.norm.weight.detach().float())
    module.load_state_dict({**{k: v.float() for k, v in head.head.state_dict().items()}, "mix.weight": mix})
    folder = tmp_path_factory.mktemp("tapped")
    save_head(module, folder, target, torch.float32, head.vocab_ids)
    return load_head(str(folder), target)


COPIES = PromptLookupParams(max_ngram=3, branches=1)
REPEATING = "red green blue red green blue red green"  # its continuation is mostly a copy of itself


def eagle(target, head, copies: PromptLookupParams | None = None, **settings) -> EagleProposer:
    return build_proposer(target, "eagle", EagleParams(**settings), copies, head=head)


def drafted_share(plain_outputs: dict[str, tuple[int, ...]], accepted: int) -> float:
    """The share of the tokens after the prefill's that were drafted and kept, over every exactness prompt."""
    return accepted / sum(len(tokens) - 1 for tokens in plain_outputs.values())


def test_greedy_exact_on_every_prompt_with_a_third_of_the_tokens_drafted(target, head, plain_outputs) -> None:
    accepted, drafted = assert_greedy_exact(target, eagle(target, head), plain_outputs)
    assert accepted < drafted and drafted_share(plain_outputs, accepted) > 0.3


def test_greedy_exact_on_the_paged_cache_and_with_narrow_trees(target, head, plain_outputs) -> None:
    for settings in ({}, {"top_k": 1, "depth": 3}, {"nodes": 2}):
        proposer = eagle(target, head, **settings)
        for prompt in PROMPTS[:6]:
            output, trace = generate(target, prompt, proposer, SamplingParams(),
                                     GenerationParams(max_new_tokens=NEW_TOKENS, kv="paged"))
            assert output.token_ids == plain_outputs[prompt], (settings, prompt)
            nodes = settings.get("nodes", proposer.nodes)
            assert all(len(e.tokens) <= nodes for e in trace.events if isinstance(e, DraftEvent))


def test_greedy_exact_with_copies_grafted_on_both_caches(target, head, plain_outputs) -> None:
    proposer = eagle(target, head, COPIES)
    assert proposer.label == "eagle+copy" and proposer.describe()["copy_max_ngram"] == 3
    accepted, drafted = assert_greedy_exact(target, proposer, plain_outputs)
    assert accepted < drafted and drafted_share(plain_outputs, accepted) > 0.3
    copied = 0
    for prompt in PROMPTS[:6]:
        output, trace = generate(target, prompt, proposer, SamplingParams(),
                                 GenerationParams(max_new_tokens=NEW_TOKENS, kv="paged"))
        assert output.token_ids == plain_outputs[prompt], prompt
        drafts = [e for e in trace.events if isinstance(e, DraftEvent)]
        assert all(len(e.tokens) <= proposer.nodes for e in drafts)
        copied += sum(e.noted("copied") is not None for e in drafts)  # a step whose tree holds a copy
    assert copied > 0


def test_a_copy_grafted_onto_a_tree_runs_through_its_nodes_then_on_by_itself() -> None:
    eos = frozenset({2})
    # root -> 5 (0.6) -> 7 (0.3); root -> 6 (0.3)
    tree = Proposal([5, 6, 7], [0, 0, 1], ["eagle"] * 3, [0.6, 0.3, 0.3], [0.6, 0.3, 0.5], note=Drafted(2))
    grafted = graft(tree, [6, 9, 10], 0.5, "copy", 4, eos)
    # 6 is the tree's: now kept at 0.5 once the root is; 9 and 10 hang below it; the least likely node (10) is cut
    assert (grafted.tokens, grafted.parents, grafted.sources) == ([5, 6, 7, 9], [0, 0, 1, 2],
                                                                 ["eagle", "copy", "eagle", "copy"])
    assert grafted.reach == pytest.approx([0.6, 0.5, 0.3, 0.25]) and grafted.probs == [0.6, 0.3, 0.5, None]
    assert grafted.trace_fields()["draft_forwards"] == 2
    through = graft(tree, [5, 7, 8], 0.9, "copy", 8, eos)  # along the likeliest path, each edge at least 0.9
    assert through.tokens == [5, 7, 8, 6] and through.parents == [0, 1, 2, 0]
    assert through.reach == pytest.approx([0.9, 0.81, 0.729, 0.3])
    assert graft(tree, [2, 4], 0.9, "copy", 8, eos).tokens == [2, 5, 6, 7]  # nothing after an end of sequence
    sampled = dataclasses.replace(tree, rule=Lossless(torch.ones(3, 4) / 4))
    assert graft(sampled, [6, 9], 0.9, "copy", 8, eos) is sampled  # judged by its own distributions


def test_a_batch_with_chunked_prefills_and_preemption_gives_every_request_its_solo_output(target, head,
                                                                                         plain_outputs) -> None:
    """Prompts prefilled in chunks of 16 tokens (the head reads each chunk's features), a pool so small that
    requests are preempted and recomputed (the head drops and reads their features again), batches of 1-8."""
    generation = GenerationParams(max_new_tokens=NEW_TOKENS)
    prompts = list(PROMPTS[:8])
    for params, copies in ((EngineParams(max_running=8, max_batch_tokens=16), None),
                           (EngineParams(max_running=4, num_blocks=48), None), (EngineParams(max_running=1), None),
                           (EngineParams(max_running=4, num_blocks=48), COPIES)):
        proposer = eagle(target, head, copies)
        engine = Engine(target, params, proposer=proposer)
        ids = {engine.add_request(p, generation=generation): p for p in prompts}
        outputs = engine.run_all()
        for rid, prompt in ids.items():
            assert outputs[rid].token_ids == plain_outputs[prompt], (params, prompt)
        counts = engine.counts["eagle"]
        assert 0 < counts.accepted < counts.proposed, params
        if copies:
            assert engine.counts["copy"].accepted > 0
        assert getattr(proposer, "inner", proposer).states == {}  # every request's head state went with it


def test_a_head_reading_tapped_layers_is_greedy_exact_on_both_caches_and_in_batches(target, tapped,
                                                                                    plain_outputs) -> None:
    """The engine returns the tapped layers' inputs beside the final states (prefill chunks and decode steps) and
    the head reads their mix: every prompt plain decoding's tokens, with drafted tokens kept."""
    proposer = eagle(target, tapped)
    assert proposer.taps == (2, 15, 29) and proposer.eagle.head.mix is not None
    accepted, drafted = assert_greedy_exact(target, proposer, plain_outputs)
    assert 0 < accepted < drafted
    stack = target.model.native_stack
    if stack is not None:  # one native call per run of layers between taps, each run's stack made once
        assert {(0, 2), (2, 15), (15, 29), (29, 30)} <= set(stack.parts)
    generation = GenerationParams(max_new_tokens=NEW_TOKENS, kv="paged")
    for params in (EngineParams(max_running=1), EngineParams(max_running=4, max_batch_tokens=16, num_blocks=48)):
        engine = Engine(target, params, proposer=eagle(target, tapped, COPIES))
        ids = {engine.add_request(p, generation=generation): p for p in PROMPTS[:6]}
        outputs = engine.run_all()
        assert all(outputs[rid].token_ids == plain_outputs[p] for rid, p in ids.items()), params
        assert engine.counts["eagle"].accepted > 0


def test_sampled_outputs_are_plain_decodings_for_the_same_seed(target, head) -> None:
    """One-hot trees: each token is drawn from the target's row as plain decoding draws it (the head priced cheaply,
    so that it drafts at every step its guesses could pay for)."""
    proposer = eagle(target, head, draft_cost=0.05)
    generation = GenerationParams(max_new_tokens=20)
    for prompt, temperature, seed in ((PROMPTS[0], 0.7, 0), (PROMPTS[3], 1.0, 5), (PROMPTS[8], 0.5, 11)):
        sampling = SamplingParams(temperature=temperature, top_p=0.9, seed=seed)
        output, trace = generate(target, prompt, proposer, sampling, generation)
        assert list(output.token_ids) == reference_tokens(target, prompt, sampling, generation), prompt
        assert compute(trace).accepted > 0


@pytest.mark.parametrize("copies", [None, COPIES], ids=["alone", "copies"])
def test_sampled_eagle_follows_the_target_distribution(target, head, copies) -> None:
    """On a prompt whose continuation is mostly a copy of itself where copies are grafted on."""
    sampling = SamplingParams(temperature=1.0, top_k=4)
    generation = GenerationParams(max_new_tokens=3, raw=True)
    prompt = REPEATING if copies else "The best thing about summer is"
    proposed = assert_follows_target(target, eagle(target, head, copies), prompt, sampling, generation)
    assert proposed > 0


def test_trees_put_parents_first_stay_within_room_and_stop_at_an_end_of_sequence(target, head) -> None:
    proposer = eagle(target, head, nodes=16)
    _, trace = generate(target, PROMPTS[1], proposer, SamplingParams(), GenerationParams(max_new_tokens=40))
    drafts = [e for e in trace.events if isinstance(e, DraftEvent)]
    assert drafts and any(len({t.parent for t in e.tokens}) > 1 for e in drafts)  # trees, not only chains
    eos = set(target.eos_token_ids)
    for event in drafts:
        depths = [0]
        for i, token in enumerate(event.tokens):
            parent = i if token.parent is None else token.parent  # None: a chain, each node after the one before
            assert parent <= i and (parent == 0 or event.tokens[parent - 1].id not in eos)
            depths.append(depths[parent] + 1)
        assert max(depths) <= proposer.depth and event.draft_forwards >= 1
    profile = depth_profile(trace)
    assert profile["kept_at_least"][0] >= profile["kept_at_least"][-1] and profile["oracle_tokens_per_forward"] > 1


def test_the_head_reads_each_feature_once_and_drafts_every_step(target, head) -> None:
    """After the prefill the head holds the prompt's features; every decode step drafts (the head has read up to
    the last token's predecessor) and its keys grow by exactly the tokens committed."""
    proposer = eagle(target, head)
    seen: list[tuple[int, int]] = []
    original = proposer.grow

    def grow(requests, depths):
        trees = original(requests, depths)
        seen.extend((proposer.states[r.id].length, r.num_computed) for r in requests)
        return trees
    proposer.grow = grow
    output, trace = generate(target, PROMPTS[2], proposer, SamplingParams(), GenerationParams(max_new_tokens=30))
    assert seen and all(keys == computed for keys, computed in seen)  # keys at positions 0 .. last token - 1
    steps = {e.step for e in trace.events if isinstance(e, DraftEvent)}  # the engine may trim a tree away
    assert len(seen) >= compute(trace).target_forwards - 2 and len(steps) >= 0.8 * len(seen)


def kept(state):
    """A copy of a request's head state whose key storage later steps cannot write into."""
    return dataclasses.replace(state, k=state.k.clone(), v=state.v.clone())


def same_trees(a: list[Proposal], b: list[Proposal]) -> None:
    """The same nodes, tokens and parents; chances to float error (a batch's padded forward may round apart)."""
    assert [(p.tokens, p.parents, p.note) for p in a] == [(p.tokens, p.parents, p.note) for p in b]
    for x, y in zip(a, b):
        torch.testing.assert_close(x.reach, y.reach, atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(x.probs, y.probs, atol=1e-4, rtol=1e-4)


def test_trees_grown_together_are_each_requests_own(target, head) -> None:
    """A batch's trees grow in one head forward per depth: each is the tree its request grows alone (the same
    nodes, tokens and parents, chances to float error), whatever its depth, and each head's keys are what it stores
    alone. The bookkeeping in Python lists (a CPU's) and as tensors on the device (a GPU's) grow the same trees."""
    proposer = eagle(target, head, draft_cost=0.0)  # priced free and verified on a flat cost curve: deep trees
    original, compared = proposer.grow, []

    def grow(requests, depths):
        before = {r.id: kept(proposer.states[r.id]) for r in requests}  # `grow` writes into the keys' storage
        proposer.on_host = False
        on_device = original(requests, depths)
        proposer.states.update({r.id: kept(before[r.id]) for r in requests})
        proposer.on_host = True
        together = original(requests, depths)
        same_trees(together, on_device)
        if len(requests) > 1:
            after = dict(proposer.states)
            for i, (r, depth) in enumerate(zip(requests, depths)):
                proposer.states[r.id] = kept(before[r.id])
                [alone] = original([r], [depth])
                same_trees([alone], [together[i]])
                alone_state, together_state = proposer.states[r.id], after[r.id]
                assert alone_state.length == together_state.length
                torch.testing.assert_close(alone_state.k[:, : alone_state.length],
                                           together_state.k[:, : together_state.length], atol=1e-4, rtol=1e-4)
            proposer.states.update(after)
        compared.append((len(requests), max(depths), len(set(depths))))
        return together
    proposer.grow = grow
    engine = Engine(target, EngineParams(max_running=4), proposer=proposer, costs=ForwardCosts((1, 2), (1.0, 1.0)))
    for i, prompt in enumerate(PROMPTS[:5]):  # staggered ends: a request near its end has less room than the rest
        engine.add_request(prompt, generation=GenerationParams(max_new_tokens=12 + 5 * i))
    engine.run_all()
    batched = [c for c in compared if c[0] > 1]
    assert len(batched) >= 10 and max(b for b, _, _ in batched) == 4 and max(d for _, d, _ in batched) >= 4
    assert any(kinds > 1 for _, _, kinds in batched)  # trees of different depths in one batch (rooms near the end)
    assert len(compared) > len(batched)  # and alone, once the others have finished


def test_the_device_bookkeeping_is_greedy_exact_too(target, head, plain_outputs) -> None:
    """The tensor bookkeeping a GPU runs, run here on the CPU: plain decoding's tokens."""
    proposer = eagle(target, head)
    proposer.on_host = False
    accepted, _ = assert_greedy_exact(target, proposer, plain_outputs)
    assert accepted > 0


def test_shipped_head_contract(target, head) -> None:
    assert default_head("embedded") == str(EMBEDDED_EAGLE) and default_head("some/other-model") is None
    assert (EMBEDDED_EAGLE / WEIGHTS).stat().st_size <= 30 * 2**20
    report = json.loads((EMBEDDED_EAGLE / "train_report.json").read_text())
    assert report["corpus_generation_s"] + report["wall_s_this_run"] <= 90 * 60
    assert report["held_out_tokens_per_target_forward"] > 2.0 and report["head_vocab"] == len(head.vocab_ids)


def test_the_held_out_evaluation_measures_nothing_on_this_host(target, monkeypatch) -> None:
    """The trainer's report judges the head: its trees are planned on the flat curve and the head priced at its
    estimate, so the figures are the same on any host (a measured forward cost would size the trees)."""
    from playground.train.eagle import evaluate
    from playground.train.prompts import held_out_prompts

    def measured(*args, **kwargs):
        raise AssertionError("the evaluation read this host's forward costs")

    monkeypatch.setattr("playground.engine.engine.forward_costs", measured)
    monkeypatch.setattr("playground.decoding.costs.measure", measured)
    report = evaluate(target, EMBEDDED_EAGLE, held_out_prompts()[:2])
    assert report["held_out_tokens_per_target_forward"] > 1.5


def test_bad_heads_are_refused_with_one_line(tmp_path, target) -> None:
    with pytest.raises(ModelLoadError, match="is not a folder with config.json and eagle.safetensors"):
        load_head(str(tmp_path), target)
    (tmp_path / WEIGHTS).write_bytes(b"")
    (tmp_path / CONFIG).write_text("{not json")
    with pytest.raises(ModelLoadError, match="malformed"):
        load_head(str(tmp_path), target)
    shape = json.loads((EMBEDDED_EAGLE / CONFIG).read_text())
    (tmp_path / CONFIG).write_text(json.dumps({**shape, "hidden_size": 64}))
    with pytest.raises(ModelLoadError, match="made for a target of"):
        load_head(str(tmp_path), target)
    (tmp_path / CONFIG).write_text(json.dumps(shape))
    save_file({"fc.weight": torch.zeros(2, 2)}, str(tmp_path / WEIGHTS))
    with pytest.raises(ModelLoadError, match="does not match its config"):
        load_head(str(tmp_path), target)
    for taps in ([2, 30], [5, 5]):
        (tmp_path / CONFIG).write_text(json.dumps({**shape, "features": TAPPED, "taps": taps}))
        with pytest.raises(ModelLoadError, match=r"this target's layers are 0\.\.29, each tapped once"):
            load_head(str(tmp_path), target)
    (tmp_path / CONFIG).write_text(json.dumps({**shape, "taps": [2, 15, 27]}))  # features say final-norm
    with pytest.raises(ModelLoadError, match="made for a target of"):
        load_head(str(tmp_path), target)
    with pytest.raises(ModelLoadError, match="none ships for this target"):
        load_head(None, dataclasses.replace(target, spec=dataclasses.replace(target.spec, source="some/model")))


@pytest.mark.parametrize("settings, message", [
    ({"depth": 0}, "depth must be an integer in [1, 16]"),
    ({"top_k": 17}, "top_k must be an integer in [1, 16]"),
    ({"nodes": 0}, "nodes must be an integer in [1, 64]"),
    ({"draft_cost": 2.0}, "draft_cost must be in [0, 1]"),
    ({"head": " "}, "head must be a folder"),
])
def test_bad_settings_name_the_field(settings, message) -> None:
    with pytest.raises(ConfigError) as error:
        EagleParams(**settings)
    assert message in str(error.value) and "\n" not in str(error.value)


def test_the_head_predicts_a_feature_for_every_position_and_masks_what_it_must_not_see(target) -> None:
    """Run causally over 5 positions at once, the head gives what it gives position by position with the keys of
    the positions before: what drafting does one depth at a time."""
    torch.manual_seed(0)
    module = EagleHead(head_config(target.model)).eval()
    cfg = module.config
    embeddings, features = torch.randn(1, 5, cfg.hidden_size), torch.randn(1, 5, cfg.hidden_size)
    cos, sin = target.model.rope(torch.arange(5).unsqueeze(0), torch.float32)
    empty = torch.zeros(1, cfg.num_kv_heads, 0, cfg.head_dim)
    with torch.no_grad():
        whole, k, v = module(embeddings, features, cos, sin, empty, empty, torch.ones(1, 5, 5, dtype=torch.bool).tril())
        for i in range(5):
            visible = torch.ones(1, 1, i + 1, dtype=torch.bool)
            one, _, _ = module(embeddings[:, i : i + 1], features[:, i : i + 1], cos[:, i : i + 1], sin[:, i : i + 1],
                               k[:, :, :i], v[:, :, :i], visible)
            torch.testing.assert_close(one[0, 0], whole[0, i], rtol=1e-4, atol=1e-4)


def test_the_served_head_runs_its_layer_natively_and_gives_the_pytorch_layers_features(target, head) -> None:
    """Beside a target whose layers run in the native kernel, the head's layer does too (norms, products and its
    attention over each node's own visible keys): beside the default target on integer products, its products
    are Q8_0 blocks against 8-bit activations; beside a target on float32 activations, it gives what the same
    weights give in PyTorch's ops."""
    from playground.config import ModelSpec
    from playground.models import load_model

    if native.kernel() is None or target.model.native_stack is None:
        pytest.skip(f"native kernel {native.status()}")
    assert head.head.layer.kernel is not None
    formats = {m.packed.format for m in head.head.modules() if isinstance(getattr(m, "packed", None), native.Panels)}
    assert formats == {native.INTEGER_FORMATS["Q8_0"]}
    head = load_head(None, load_model(ModelSpec(device="cpu", weights="gguf")))
    assert head.head.layer.kernel is not None
    reference = EagleHead(head.head.config, head.head.taps).eval()
    reference.load_state_dict(head.head.state_dict())
    cfg, (b, t, past) = reference.config, (3, 4, 9)
    torch.manual_seed(0)
    embeddings, features = torch.randn(b, t, cfg.hidden_size), torch.randn(b, t, cfg.hidden_size)
    cos, sin = target.model.rope(torch.arange(past, past + t).repeat(b, 1), torch.float32)
    past_k, past_v = (torch.randn(b, cfg.num_kv_heads, past, cfg.head_dim) for _ in range(2))
    visible = torch.cat((torch.rand(b, t, past) > 0.3, torch.eye(t, dtype=torch.bool).expand(b, -1, -1)), 2)
    with torch.inference_mode():
        served = head.head(embeddings, features, cos, sin, past_k, past_v, visible)
        expected = reference(embeddings, features, cos, sin, past_k, past_v, visible)
    for got, want in zip(served, expected):  # features (B, T, E), keys and values (B, Hkv, T, D)
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


def test_unrolled_training_passes_give_what_drafting_each_depth_gives(target) -> None:
    """Pass k of the training unroll at position j equals drafting k deep after the real features up to j-k+1:
    the head reads its own predicted features and sees the real keys, then its chain's."""
    from playground.train.eagle import unrolled

    torch.manual_seed(0)
    module = EagleHead(head_config(target.model)).eval()
    cfg, n = module.config, 7
    embeddings, features = torch.randn(1, n, cfg.hidden_size), torch.randn(1, n, cfg.hidden_size)
    cos, sin = target.model.rope(torch.arange(n).unsqueeze(0), torch.float32)
    empty = torch.zeros(1, cfg.num_kv_heads, 0, cfg.head_dim)
    with torch.no_grad():
        offsets, passes = zip(*unrolled(module, embeddings, features, cos, sin, 3))
        assert offsets == (0, 0, 0)
        causal = torch.ones(1, n, n, dtype=torch.bool).tril()
        first, k1, v1 = module(embeddings, features, cos, sin, empty, empty, causal)
        torch.testing.assert_close(passes[0], first)
        for last_real in range(n - 2):
            feature, past_k, past_v = first[:, last_real : last_real + 1], k1[:, :, : last_real + 1], \
                v1[:, :, : last_real + 1]
            for depth in (2, 3):
                at = last_real + depth - 1
                if at >= n:
                    break
                visible = torch.ones(1, 1, past_k.shape[2] + 1, dtype=torch.bool)
                feature, k, v = module(embeddings[:, at : at + 1], feature, cos[:, at : at + 1], sin[:, at : at + 1],
                                       past_k, past_v, visible)
                torch.testing.assert_close(feature[0, 0], passes[depth - 1][0, at], rtol=1e-4, atol=1e-4)
                past_k, past_v = torch.cat((past_k, k), 2), torch.cat((past_v, v), 2)


def test_unrolled_passes_from_a_later_first_position_give_the_full_passes_there(target) -> None:
    """Where no loss reads positions before `first`, the deeper passes start later and predict what the full
    passes predict at their positions: pass k from first - (unroll - k), whose keys the deeper passes read."""
    from playground.train.eagle import unrolled

    torch.manual_seed(0)
    module = EagleHead(head_config(target.model)).eval()
    n, e = 9, module.config.hidden_size
    embeddings, features = torch.randn(2, n, e), torch.randn(2, n, e)
    cos, sin = target.model.rope(torch.arange(n).expand(2, n), torch.float32)
    with torch.no_grad():
        full = unrolled(module, embeddings, features, cos, sin, 3)
        for first, offsets in ((4, (0, 3, 4)), (1, (0, 0, 1))):
            later = unrolled(module, embeddings, features, cos, sin, 3, first)
            assert tuple(offset for offset, _ in later) == offsets
            for (_, whole), (offset, part) in zip(full, later):
                torch.testing.assert_close(part, whole[:, offset:], rtol=1e-4, atol=1e-4)


def test_depth_profile_by_hand() -> None:
    """Two drafting steps: a tree of depth 2 (3 nodes) keeping 2 tokens, a chain of 3 keeping none."""
    def token(parent):
        return TokenInfo(id=1, text="a", position=0, parent=parent)
    events = [DraftEvent(step=1, t=0.0, tokens=[token(0), token(0), token(1)], wall_s=0.0, draft_forwards=2),
              AcceptEvent(step=1, t=0.0, token=token(None)), AcceptEvent(step=1, t=0.0, token=token(None)),
              DraftEvent(step=2, t=0.0, tokens=[token(None)] * 3, wall_s=0.0, draft_forwards=3)]
    profile = depth_profile(Trace("eagle", "m", "p", [1], {}, events))
    assert profile == {"kept_at_least": [0.5, 0.5, 0.0], "mean_nodes_verified": 3,
                       "oracle_tokens_per_forward": 1 + 2.5}
    assert depth_profile(Trace("ar", "m", "p", [1], {}, [])) == {}


def test_eagle_training_pipeline_smoke(tmp_path, target, capsys) -> None:
    """Two prompts, one epoch: a head that loads, drafts exactly, and a report that says what it measured."""
    from playground.train.__main__ import main

    out = tmp_path / "head"
    small = ["eagle", "--limit", "2", "--answer-tokens", "8", "--batch", "4", "--eval-prompts", "1",
             "--out", str(out)]
    started = time.perf_counter()
    assert main(small + ["--head-vocab", "300", "--unroll", "2"]) == 0
    elapsed = time.perf_counter() - started
    assert "epoch 1/16: regression " in capsys.readouterr().err
    report = json.loads((out / "train_report.json").read_text())
    # the corpus generated in this run counts once: the full run is its generation plus the rest
    assert 0 < report["corpus_generation_s"] and report["corpus_generation_s"] + report["wall_s_this_run"] <= elapsed
    assert report["first_stage_prompts"] == 2 and report["head_vocab"] == 300 and report["unroll"] == 2
    assert report["held_out_prompts"] == 1
    assert report["held_out_tokens_per_target_forward"] >= 1 and set(report["held_out_kept_at_least"]) == {
        str(d) for d in range(1, EagleParams().depth + 1)}
    loaded = load_head(str(out), target)
    assert len(loaded.vocab_ids) == 300
    # the evaluation priced the head at its weights' estimate, not at what this host measured
    assert report["head_target_cost_ratio"] == EagleProposer(target, EagleParams(), loaded).estimate_cost()
    for bad, message in ((["--head-vocab", "0"], "head_vocab must be an integer in [1, 49152]"),
                         (["--noise", "2"], "noise must be in [0, 1]"),
                         (["--unroll", "5"], "unroll must be an integer in [1, 4]"),
                         (["--device", "tpu"], "device must be cpu or cuda")):
        assert main(small + bad) == 2
        assert message in capsys.readouterr().err


def test_a_head_trained_on_tapped_layers_reads_them_and_learns_the_tokens_alone(tmp_path, target, capsys) -> None:
    """`--taps`: the features are the tapped layers' inputs beside the final states, the loss has no feature
    regression (the mix learns through the tokens), and the saved head loads reading those layers."""
    from playground.train.__main__ import main
    from playground.train.eagle import head_loss

    e, taps = target.model.config.hidden_size, (2, 15, 29)
    module = EagleHead(head_config(target.model), taps)
    torch.manual_seed(0)
    ids = torch.randint(0, 1000, (2, 6))
    features = torch.randn(2, 6, 4 * e)
    regression, tokens = head_loss(module, target, ids, features, torch.tensor([6, 5]), torch.tensor([2, 3]),
                                   target.model.output_weight.detach()[:300].float(), 0.1, torch.Generator(), 2)
    tokens.backward()
    assert regression.item() == 0 and module.mix.weight.grad.abs().sum() > 0
    out = tmp_path / "head"
    small = ["eagle", "--limit", "2", "--answer-tokens", "8", "--batch", "4", "--eval-prompts", "1",
             "--head-vocab", "300", "--out", str(out)]
    capsys.readouterr()
    assert main(small + ["--taps", "2", "15", "29"]) == 0
    progress = capsys.readouterr().err
    assert "epoch 1/16: tokens " in progress and "regression" not in progress
    assert json.loads((out / "train_report.json").read_text())["taps"] == [2, 15, 29]
    assert load_head(str(out), target).head.taps == taps
    for bad, message in ((["--taps", "30"], "taps must be an integer in [0, 29]"),
                         (["--taps", "3", "3"], "taps must name each layer once")):
        assert main(small + bad) == 2
        assert message in capsys.readouterr().err


def test_sequence_states_are_every_position_and_the_medusa_slice_their_answer_rows(target) -> None:
    from playground.train.draft import Corpus
    from playground.train.medusa import hidden_states, sequence_states

    corpus = Corpus([[1, 2, 3, 4], [5, 6, 7]], [2, 1], torch.zeros(4, 2, dtype=torch.long), torch.zeros(4, 2))
    states = sequence_states(target, corpus, "float32")
    assert [tuple(s.shape) for s in states] == [(4, 576), (3, 576)]
    answers, counts = hidden_states(target, corpus, "float32")
    assert counts == [2, 2] and torch.equal(answers, torch.cat((states[0][1:3], states[1][0:2])))
