"""Decode forwards in static shapes (the CUDA-graph path with capture off, which runs on the CPU): every algorithm on
both caches and in padded batches gives plain decoding's tokens; a static forward writes and returns what an eager
one does and nothing else; seeded sampling is unchanged; compiled layers run where PyTorch's ops would and keep
every algorithm plain decoding; buckets, settings and errors. With a CUDA GPU, graphs give the static path's tokens
and compiled graphs every algorithm their plain decoding's."""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json

import pytest
import torch

from playground.__main__ import main
from playground.cli import add_model_args, model_spec
from playground.config import KV_KINDS, ConfigError, EngineParams, GenerationParams, ModelSpec, SamplingParams
from playground.decoding import costs as costs_module
from playground.decoding.base import contiguous_cache, forward_tokens, paged_cache
from playground.decoding.prompt_lookup import PromptLookupParams
from playground.decoding.registry import build_proposer
from playground.decoding.speculative import SpeculativeParams
from playground.engine import Engine, generate
from playground.models import ModelLoadError, compiled, load_model
from playground.models import forwards as forwards_module
from playground.models.forwards import (
    MIN_KEYS,
    ONE_WIDTH,
    Captured,
    Forwards,
    StaticForwards,
    bucket,
    make_forwards,
)
from playground.models.loader import load_draft, load_hf_peer

from .prompts import NEW_TOKENS, PROMPTS
from .test_engine import tiny_model

ALGOS = (None, "speculative", "prompt-lookup", "lookahead", "medusa", "eagle")


@pytest.fixture(scope="module")
def static(target):
    return dataclasses.replace(target, forwards="static")


@pytest.fixture
def static_calls(monkeypatch) -> list[int]:
    """The batch size of every static forward run."""
    calls: list[int] = []
    real = StaticForwards.__call__

    def spy(self, seq_ids, *args, **kwargs):
        calls.append(len(seq_ids))
        return real(self, seq_ids, *args, **kwargs)
    monkeypatch.setattr(StaticForwards, "__call__", spy)
    return calls


def test_buckets_are_powers_of_two() -> None:
    assert [bucket(n) for n in (1, 2, 3, 4, 5, 8, 9, 33)] == [1, 2, 4, 4, 8, 8, 16, 64]
    assert bucket(5, MIN_KEYS) == 64 and bucket(65, MIN_KEYS) == 128


@pytest.mark.parametrize("kv", KV_KINDS)
def test_every_algorithm_in_static_shapes_is_plain_decoding(static, plain_outputs, static_calls, kv) -> None:
    generation = GenerationParams(max_new_tokens=NEW_TOKENS, kv=kv, block_size=4)
    for algo in ALGOS:
        proposer = build_proposer(static, algo) if algo else None
        for prompt in PROMPTS[::4]:
            assert generate(static, prompt, proposer, None, generation)[0].token_ids == plain_outputs[prompt], (
                algo, prompt)
    assert len(static_calls) > 50


def test_padded_batches_with_preemption_give_every_request_its_own_output(static, plain_outputs) -> None:
    prompts = PROMPTS[:7]
    for algo in (None, "medusa", "speculative", "eagle", "prompt-lookup"):
        engine = Engine(static, EngineParams(num_blocks=48, block_size=4, max_batch_tokens=48, max_running=5),
                        proposer=build_proposer(static, algo) if algo else None)
        ids = {engine.add_request(p, None, GenerationParams(max_new_tokens=NEW_TOKENS)): p for p in prompts}
        outputs = engine.run_all()
        assert {ids[i]: out.token_ids for i, out in outputs.items()} == {p: plain_outputs[p] for p in prompts}, algo
        rows = {key[0] for key in engine.runner.forwards.buckets}
        assert rows <= {1, 2, 4, 8} and rows & {4, 8}, algo  # 3 or 5 requests ran padded to 4 or 8 rows
        assert engine.cache.blocks.num_free == 48


def test_captured_runs_from_one_set_of_inputs_per_shape() -> None:
    """Each call copies its inputs into the corner of its shape's set; past them lies what earlier calls left."""
    runs = Captured(lambda x, scale: (x * scale,), graphs=False)
    (first,) = runs((torch.tensor([1.0, 2.0, 3.0]),), ((4,),), 2.0)
    (second,) = runs((torch.tensor([5.0]),), ((4,),), 2.0)
    assert first.tolist() == [2.0, 4.0, 6.0, 0.0] and second.tolist() == [10.0, 4.0, 6.0, 0.0]
    runs((torch.tensor([1.0]),), ((4,),), 3.0)
    assert len(runs.sets) == 2  # one per shape and static argument


@pytest.mark.parametrize("algo", ["medusa", "eagle"])
def test_the_heads_guess_in_static_shapes_what_they_guess_eager(target, static, algo) -> None:
    """With static forwards the Medusa and EAGLE heads run padded (captured with graphs on a GPU): 3 requests at
    once, the same guesses kept as eager, and only padded shapes."""
    counts = []
    for model in (target, static):
        proposer = build_proposer(model, algo)
        engine = Engine(model, EngineParams(max_running=3), proposer=proposer)
        for prompt in PROMPTS[:3]:
            engine.add_request(prompt, None, GenerationParams(max_new_tokens=NEW_TOKENS))
        engine.run_all()
        counts.append({source: (c.proposed, c.accepted) for source, c in engine.counts.items()})
    assert counts[0] == counts[1] and counts[1][algo][1] > 0
    assert proposer.captured.sets and target.forwards == "eager"
    for shapes, _ in proposer.captured.sets:  # rows (and EAGLE's tokens per request, keys before, from MIN_KEYS,
        padded = [(shapes[0][0], 1)]  # and scored rows)
        if algo == "eagle":
            padded += [(shapes[0][1], 1), (shapes[3][2], MIN_KEYS), (shapes[6][1], 1)]
        assert all(bucket(n, floor) == n for n, floor in padded), shapes


@pytest.mark.parametrize("kv", KV_KINDS)
def test_a_static_forward_writes_and_returns_what_an_eager_one_does_and_nothing_else(target, kv) -> None:
    """Three requests of different lengths, a tree of 3 tokens each (padded to 4 rows of 4 tokens on the paged
    cache): the same hidden states bit for bit, the same keys and values in every slot, and padding that reads
    nothing a row wrote (NaN in the unwritten slots stays in the padding). Ids given as a tensor (as a draft's chain
    feeds its guesses, a strided view at its first place) run as the same lists."""
    model = target.model
    rows = 3 if kv == "paged" else 1

    def cache():
        made = paged_cache(model, 32, 4) if kv == "paged" else contiguous_cache(model, 100)
        made.k.fill_(float("nan"))
        made.v.fill_(float("nan"))
        return made
    eager_cache, static_cache, fed_cache = cache(), cache(), cache()
    lengths = [7, 12, 5][:rows]
    for made in (eager_cache, static_cache, fed_cache):
        for seq, length in enumerate(lengths):
            ids = torch.arange(10, 10 + length).unsqueeze(0)  # (1, T)
            model(ids, torch.arange(length).unsqueeze(0), made, [seq], num_logits=0)
    tree = torch.tensor([[1, 0, 0], [1, 1, 0], [1, 0, 1]], dtype=torch.bool).expand(rows, 3, 3)  # (B, 3, 3)
    ids = [[100 + seq, 200 + seq, 300 + seq] for seq in range(rows)]
    positions = [[n, n + 1, n + 1] for n in lengths]
    eager = Forwards(model, eager_cache)(list(range(rows)), ids, positions, tree)
    static = StaticForwards(model, static_cache)(list(range(rows)), ids, positions, tree)
    assert torch.equal(eager, static) and not static.isnan().any()
    fed = torch.tensor([[t for t in row for _ in (0, 1)] for row in ids])[:, ::2]  # (B, 3), strided
    assert torch.equal(StaticForwards(model, fed_cache)(list(range(rows)), fed, positions, tree), static)
    for ours, theirs in ((static_cache.k, eager_cache.k), (static_cache.v, eager_cache.v)):
        scratch = ours[:, -1] if kv == "paged" else ours[:, :, :, -1]
        tokens = ours[:, :-1] if kv == "paged" else ours[:, :, :, :-1]  # every slot but the scratch one
        expected = theirs[:, :-1] if kv == "paged" else theirs[:, :, :, :-1]
        assert torch.equal(tokens.nan_to_num(7.0), expected.nan_to_num(7.0))
        assert not scratch.isnan().any()  # the padding wrote there
    assert [eager_cache.length(s) for s in range(rows)] == [static_cache.length(s) for s in range(rows)]


@pytest.mark.parametrize("kv", KV_KINDS)
def test_tapped_forwards_return_the_final_states_and_each_tapped_layers_input(target, kv) -> None:
    """With taps (an EAGLE-3 head's), eager forwards (the native kernel's layers in runs between the taps) and
    static ones (layer by layer) give the same bits, the untapped forward's final states first, then the residual
    stream entering each tapped layer: what transformers returns as that layer's hidden states, the trainer's
    input (`train.medusa.sequence_states`), to the rounding that reading the GGUF blocks (summed block by block, on
    float32 activations) rather than transformers' dequantised float32 weights adds over 27 layers."""
    taps, e = (27, 2, 15), target.model.config.hidden_size
    ids, prompt = [[300, 301]], torch.arange(10, 20).unsqueeze(0)  # a decode forward after a 10-token prefix

    def run(model, forwards_type, taps):
        cache = paged_cache(model, 32, 4) if kv == "paged" else contiguous_cache(model, 100)
        prefill = model(prompt, torch.arange(10).unsqueeze(0), cache, [0], num_logits=0, taps=taps)[1]
        return prefill, forwards_type(model, cache, taps=taps)([0], ids, [[10, 11]])

    plain = run(target.model, Forwards, ())
    eager, static = run(target.model, Forwards, taps), run(target.model, StaticForwards, taps)
    for untapped, tapped, laid in zip(plain, eager, static):  # the prefill's (1, 10, 4E), the decode's (1, 2, 4E)
        assert tapped.shape[-1] == 4 * e and torch.equal(tapped[..., :e], untapped) and torch.equal(tapped, laid)
    peer = load_hf_peer(target)
    with torch.inference_mode():
        expected = peer.model(input_ids=torch.cat((prompt, torch.tensor(ids)), 1), output_hidden_states=True)
    float_blocks = load_model(ModelSpec(device="cpu", weights="gguf"))  # the 8-bit activations move further
    got = torch.cat(run(float_blocks.model, Forwards, taps), 1)  # (1, 12, 4E)
    for i, layer in enumerate(taps):
        torch.testing.assert_close(got[..., (i + 1) * e : (i + 2) * e], expected.hidden_states[layer],
                                   rtol=1e-3, atol=1e-3)


# (prompts, new tokens) of the 16-bit checks: the suite's share proves the property; the sweep (`pytest -m sweep`,
# which scripts/gpu_check.sh runs) takes more of both
SHORT, SWEEP = (1, 8), pytest.param((3, 16), marks=pytest.mark.sweep, id="sweep")


@pytest.mark.parametrize("size", [pytest.param(SHORT, id="short"), SWEEP])
def test_in_bfloat16_every_forward_has_one_shape_and_every_algorithm_is_plain_decoding(size) -> None:
    """PyTorch's kernels pick their reduction order by shape, so in bfloat16 one width and the cache's whole length
    for every decode forward are what keep a token's bits (greedy choices flip otherwise)."""
    prompts, new_tokens = size
    half = load_model(ModelSpec(device="cpu", dtype="bfloat16", forwards="static"))
    assert half.model.rows_per_pass is None
    for kv in KV_KINDS:
        generation = GenerationParams(max_new_tokens=new_tokens, kv=kv, block_size=4)
        plain = {p: generate(half, p, None, None, generation)[0].token_ids for p in PROMPTS[:prompts]}
        for algo in ALGOS[1:]:
            proposer = build_proposer(half, algo)
            for prompt, tokens in plain.items():
                assert generate(half, prompt, proposer, None, generation)[0].token_ids == tokens, (kv, algo, prompt)
    half.model.static_shelf.clear()
    for running in (1, 3):  # batches run in buckets: a batch's rows and prefill chunks change the shapes anyway
        engine = Engine(half, EngineParams(num_blocks=64, block_size=4, max_running=running),
                        proposer=build_proposer(half, "medusa"))
        for prompt in PROMPTS[:prompts + 1]:
            engine.add_request(prompt, None, GenerationParams(max_new_tokens=new_tokens // 2))
        engine.run_all()
        forwards = engine.runner.forwards
        assert forwards.max_width == (ONE_WIDTH if running == 1 else None)
        if running == 1:
            assert {key[1:] for key in forwards.buckets} == {(ONE_WIDTH, 64 * 4)}


@pytest.mark.parametrize("size", [pytest.param((1, 6), id="short"), SWEEP])
def test_compiled_layers_run_every_layer_pytorch_runs_and_keep_plain_decoding(target, plain_outputs, monkeypatch,
                                                                             size) -> None:
    """--forwards compiled: each layer's work around attention compiled by torch.compile (Inductor's C++ here, its
    kernels captured in graphs on a GPU). In bfloat16, where PyTorch's kernels run the layers, it runs every layer
    of every decode forward, near the uncompiled forward's hidden states, and every algorithm gives its plain
    decoding's tokens on both caches, and dynamo keeps the graphs batching engines need (run in the sweep below);
    where the native kernel runs a layer (float32 here), the kernel keeps it."""
    layers = []
    monkeypatch.setattr(forwards_module, "compiled_layer",
                        lambda block, *args: layers.append(block) or compiled.layer(block, *args))
    half = load_model(ModelSpec(device="cpu", dtype="bfloat16", forwards="compiled"))
    assert half.graphs is False and half.model.rows_per_pass is None
    rows = []
    for mode in ("static", "compiled"):
        cache = contiguous_cache(half.model, 40)
        forward_tokens(half.model, cache, list(range(1, 30)))
        rows.append(make_forwards(half.model, cache, mode)([0], [[7, 8]], [[29, 30]]).float())  # (1, 2, E)
    assert len(layers) == half.model.config.num_layers
    assert (rows[1] - rows[0]).norm() < 0.05 * rows[0].norm()  # bfloat16 rounding alone moves eager from static as far
    prompts, new_tokens = size
    for kv in KV_KINDS:
        generation = GenerationParams(max_new_tokens=new_tokens, kv=kv, block_size=4)
        plain = {p: generate(half, p, None, None, generation)[0].token_ids for p in PROMPTS[:prompts]}
        for algo in ("speculative", "medusa", "eagle"):
            for prompt, tokens in plain.items():
                assert generate(half, prompt, build_proposer(half, algo), None, generation)[0].token_ids == tokens, (
                    kv, algo, prompt)
    assert torch._dynamo.config.recompile_limit >= compiled.GRAPHS  # what batching engines need (the sweep below)
    layers.clear()
    blocks = dataclasses.replace(target, forwards="compiled")
    assert generate(blocks, PROMPTS[0], None, None, GenerationParams(max_new_tokens=NEW_TOKENS))[0].token_ids == (
        plain_outputs[PROMPTS[0]]) and not layers


@pytest.mark.sweep
def test_compiled_batching_engines_with_a_draft_and_eagle_keep_more_graphs_than_dynamos_default() -> None:
    """Batching engines with the draft and with EAGLE run buckets of one and more rows for three models: more graphs
    than dynamo keeps by default (rows may differ from solo runs in 16 bits, docs/gpu.md: only that they run is
    asked here)."""
    half = load_model(ModelSpec(device="cpu", dtype="bfloat16", forwards="compiled"))
    draft = load_draft(None, half)
    for running, source, proposer in ((2, "draft", build_proposer(half, "speculative", SpeculativeParams(),
                                                                  PromptLookupParams(), draft=draft)),
                                      (4, "eagle", build_proposer(half, "eagle"))):
        engine = Engine(half, EngineParams(max_running=running), proposer=proposer)
        for prompt in PROMPTS[:6]:
            engine.add_request(prompt, None, GenerationParams(max_new_tokens=8))
        assert [len(out.token_ids) for out in engine.run_all().values()] == [8] * 6
        assert engine.counts[source].accepted > 0, source
    from torch._dynamo.eval_frame import _debug_get_cache_entry_list  # private: how many graphs a function keeps

    assert len(_debug_get_cache_entry_list(compiled.attention_in.__code__)) > 8  # dynamo's default limit


def test_the_next_engine_takes_what_a_closed_one_built_and_two_at_once_keep_their_own(static, plain_outputs) -> None:
    """Graphs write and read one cache's storage: an engine's static forwards go back on the model's shelf when it
    is closed (or collected) and the next cache of that shape takes them; two engines alive at once never share."""
    static.model.static_shelf.clear()
    generation = GenerationParams(max_new_tokens=NEW_TOKENS)
    for prompt in PROMPTS[:2]:
        assert generate(static, prompt, None, None, generation)[0].token_ids == plain_outputs[prompt]
    (shelved,) = static.model.static_shelf.values()
    assert len(shelved) == 1 and len(shelved[0].buckets) >= 1  # one set of shapes, reused, back on the shelf
    params = EngineParams(num_blocks=64, block_size=4, max_running=2)
    first, second = Engine(static, params), Engine(static, params)
    assert first.cache.k is not second.cache.k
    for each in (first, second):
        each.add_request(PROMPTS[3], None, generation)
    outputs = [each.run_all()[0].token_ids for each in (first, second)]
    assert outputs == [plain_outputs[PROMPTS[3]]] * 2
    first.close()
    third = Engine(static, params)
    assert third.cache.k is first.cache.k  # the closed engine's storage, with its buckets
    assert third.runner.forwards.buckets is first.runner.forwards.buckets
    del second, each  # collected without a close (its scheduler refers back to it: a cycle), its shapes go back
    gc.collect()
    assert len(static.model.static_shelf[next(k for k in static.model.static_shelf if k[0] == "PagedKVCache")]) == 1


def test_a_sequence_past_a_sliding_window_is_refused_by_its_real_length() -> None:
    """Static keys are padded (here to 64): the window is checked against the tokens, not the padding."""
    model = tiny_model().model
    model.config = dataclasses.replace(model.config, sliding_window=12)
    for forwards in (Forwards, StaticForwards):
        cache = contiguous_cache(model, 32)
        run = forwards(model, cache)
        run([0], [list(range(1, 11))], [list(range(10))])  # 10 tokens: within the window, 64 keys when static
        with pytest.raises(ValueError, match="exceeds the model's sliding window"):
            run([0], [[1, 2, 3]], [[10, 11, 12]])  # 13


def test_seeded_sampling_is_unchanged_by_static_shapes(target, static) -> None:
    sampling = SamplingParams(temperature=0.8, seed=3)
    generation = GenerationParams(max_new_tokens=NEW_TOKENS)
    for algo, params in ((None, None), ("speculative", SpeculativeParams(sample=True)), ("medusa", None)):
        outputs = [generate(model, prompt, build_proposer(model, algo, params) if algo else None, sampling,
                            generation)[0].token_ids for model in (target, static) for prompt in PROMPTS[:3]]
        assert outputs[:3] == outputs[3:], algo


def test_the_setting_is_checked_and_resolved(target, tmp_path) -> None:
    with pytest.raises(ConfigError, match="forwards"):
        ModelSpec(forwards="fast")
    with pytest.raises(ModelLoadError, match="^forwards: 'graphs' .* CUDA GPU.*use static or eager"):
        load_model(ModelSpec(device="cpu", forwards="graphs"))
    with pytest.raises(ModelLoadError, match="^forwards: 'compiled' with bitsandbytes .* use static or eager"):
        load_model(ModelSpec(device="cpu", forwards="compiled", quant="int8"))
    assert target.forwards == "eager"  # auto on a CPU
    assert load_model(ModelSpec(device="cpu", forwards="static")).forwards == "static"
    with pytest.raises(ValueError, match="CUDA graphs need a CUDA device"):
        make_forwards(target.model, contiguous_cache(target.model, 8), "graphs")
    parser = argparse.ArgumentParser()
    add_model_args(parser)
    assert model_spec(parser.parse_args([])).forwards == "auto"
    assert model_spec(parser.parse_args(["--no-graphs"])).forwards == "eager"
    assert model_spec(parser.parse_args(["--forwards", "static"])).forwards == "static"
    with pytest.raises(SystemExit):
        parser.parse_args(["--forwards", "static", "--no-graphs"])


def test_forward_costs_are_measured_and_kept_per_way_of_running(target) -> None:
    model = target.model
    eager_key = costs_module.machine_key(model)
    assert eager_key == costs_module.machine_key(model, "eager") != costs_module.machine_key(model, "static")
    costs = costs_module.measure(model, rounds=1, forwards="static")
    assert costs.tokens == costs_module.WIDTHS and all(a <= b for a, b in zip(costs.seconds, costs.seconds[1:]))


def test_bench_races_plain_decoding_with_eager_forwards(tmp_path) -> None:
    out_json, out_md = tmp_path / "b.json", tmp_path / "b.md"
    assert main(["bench", "--limit", "1", "--max-new-tokens", "4", "--device", "cpu", "--forwards", "static",
                 "--algos", "prompt-lookup", "--draft", "none", "--rounds", "1", "--no-peers", "--json",
                 str(out_json), "--markdown", str(out_md)]) == 0
    report = json.loads(out_json.read_text())
    assert report["environment"]["forwards"] == "static"
    assert set(report["algos"]) == {"ar-eager", "prompt-lookup"}
    assert report["prompts"][0]["algos"]["ar-eager"]["same_tokens_as_ar"] is True
    assert "ours with static forwards / with eager forwards" in out_md.read_text()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a CUDA GPU")
def test_graphs_give_the_static_shapes_tokens_and_compiled_graphs_their_plain_decoding_on_cuda() -> None:
    graphs = load_model(ModelSpec(device="cuda", forwards="graphs"))
    static = dataclasses.replace(graphs, forwards="static")
    generation = GenerationParams(max_new_tokens=NEW_TOKENS, kv="paged")
    for algo in (None, "speculative", "medusa", "eagle"):
        for prompt in PROMPTS[:5]:
            ours, theirs = (generate(model, prompt, build_proposer(model, algo) if algo else None, None,
                                     generation)[0].token_ids for model in (graphs, static))
            assert ours == theirs, (algo, prompt)
    compiled_model = dataclasses.replace(graphs, forwards="compiled")
    assert compiled_model.graphs
    for prompt in PROMPTS[:3]:
        plain = generate(compiled_model, prompt, None, None, generation)[0].token_ids
        for algo in ("speculative", "medusa", "eagle"):
            proposer = build_proposer(compiled_model, algo)
            assert generate(compiled_model, prompt, proposer, None, generation)[0].token_ids == plain, (algo, prompt)
