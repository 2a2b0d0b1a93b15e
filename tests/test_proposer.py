"""A new algorithm is one proposer: one defined here, in a test alone, runs through the engine's batch and the
server with no other file changed, and keeps greedy and seeded outputs those of plain decoding."""

from __future__ import annotations

import pytest

from playground.config import (SpeculativeParams, MedusaParams, EngineParams, GenerationParams, LookaheadParams,
                               PromptLookupParams, SamplingParams)
from playground.decoding.costs import ForwardCosts
from playground.decoding.proposer import Proposal, Proposer
from playground.decoding.registry import PROPOSERS
from playground.engine import Engine
from playground.engine import generate
from playground.metrics import compute
from playground.trace import AcceptEvent, BonusEvent, CommitEvent, CorrectEvent, DraftEvent, LookaheadEvent, Trace
from playground.viz.steps import render_step_detail

from .prompts import NEW_TOKENS, PROMPTS
from .stats import reference_tokens
from .test_server import get, post, running


class Bigrams(Proposer):
    """Proposes, after each request's last token, the chain its own text's bigrams lead to: the token that followed
    that token most recently, then the one that followed that, up to three. Its table is per request, kept from
    `start` to `end` and grown in `observe` from the tokens the verifier kept."""

    label = "bigrams"

    def __init__(self) -> None:
        self.tables: dict[int, dict[int, int]] = {}
        self.ended = 0

    def bind(self, settings) -> None:
        self.tables = {}

    def start(self, request) -> None:
        self.tables[request.id] = dict(zip(request.prompt_ids, request.prompt_ids[1:]))

    def end(self, request) -> None:
        del self.tables[request.id]
        self.ended += 1

    def propose(self, requests, rooms, cost):
        proposals = {}
        for request, room in zip(requests, rooms):
            table, token, chain = self.tables[request.id], request.tokens[request.num_computed], []
            while token in table and len(chain) < min(3, room):
                token = table[token]
                chain.append(token)
            if chain:
                proposals[request.id] = Proposal.chain(chain, self.label, 0.9)
        return proposals

    def observe(self, request, proposal, outcome) -> None:
        text = request.tokens[: request.num_computed] + outcome.new
        self.tables[request.id].update(zip(text[-len(outcome.new) - 1 :], outcome.new))


def test_a_proposer_defined_in_a_test_runs_in_the_engine_batch(target, plain_outputs) -> None:
    """Greedy: plain decoding's tokens at batch 1 and 8, its bigrams proposed, some kept, and every request's
    state dropped at its end. Seeded sampling: plain decoding's samples, seed for seed."""
    generation = GenerationParams(max_new_tokens=NEW_TOKENS)
    prompts = PROMPTS[:8]
    for batch in (1, 8):
        proposer = Bigrams()
        engine = Engine(target, EngineParams(max_running=batch), proposer=proposer)
        ids = {engine.add_request(p, generation=generation): p for p in prompts}
        outputs = engine.run_all()
        assert all(outputs[rid].token_ids == plain_outputs[p] for rid, p in ids.items()), batch
        counts = engine.counts["bigrams"]
        assert counts.steps > 0 and 0 < counts.accepted < counts.proposed, batch
        assert proposer.tables == {} and proposer.ended == len(prompts)
    sampled = []
    for proposer in (None, Bigrams()):
        engine = Engine(target, EngineParams(max_running=4), proposer=proposer)
        ids = [engine.add_request(p, SamplingParams(temperature=0.8, seed=i), GenerationParams(max_new_tokens=16))
               for i, p in enumerate(prompts[:4])]
        outputs = engine.run_all()
        sampled.append([outputs[i].token_ids for i in ids])
    assert sampled[0] == sampled[1] and engine.counts["bigrams"].accepted > 0


def test_a_proposer_defined_in_a_test_serves_over_http(target, plain_outputs) -> None:
    """The server takes the proposer as it is and reports what it proposed."""
    with running(target, EngineParams(max_running=4), proposer=Bigrams()) as service:
        prompt = PROMPTS[0]
        status, reply = post(service, "/v1/chat/completions",
                             {"messages": [{"role": "user", "content": prompt}], "max_tokens": NEW_TOKENS})
        expected = target.tokenizer.decode(plain_outputs[prompt], skip_special_tokens=True)
        assert status == 200 and reply["choices"][0]["message"]["content"] == expected
        status, state = get(service, "/v1/engine")
        assert state["proposer"]["proposer"] == "bigrams" and state["proposer"]["counts"]["bigrams"]["proposed"] > 0


@pytest.mark.parametrize("kv", ["contiguous", "paged"])
@pytest.mark.parametrize("algo", ["ar", "prompt-lookup", "lookahead", "medusa", "speculative"])
def test_batch_one_generation_is_the_engine_step_with_its_trace(target, plain_outputs, algo, kv) -> None:
    """`generate` runs one request through the engine: plain decoding's greedy tokens for every algorithm on either
    cache, and a trace that survives its JSON round trip and adds up (tokens drawn, decisions, steps)."""
    params = {"prompt-lookup": PromptLookupParams(), "lookahead": LookaheadParams(),
              "medusa": MedusaParams(), "speculative": SpeculativeParams()}.get(algo)
    proposer = None if params is None else PROPOSERS[algo](target, params)
    drafted = 0
    for prompt in PROMPTS:
        output, trace = generate(target, prompt, proposer, generation=GenerationParams(max_new_tokens=NEW_TOKENS,
                                                                                       kv=kv), algo=algo)
        assert output.token_ids == plain_outputs[prompt], (algo, prompt)
        trace = Trace.from_json(trace.to_json())
        kept = [e.token.id for e in trace.events if isinstance(e, (AcceptEvent, CorrectEvent, BonusEvent))]
        assert tuple(kept[: len(output.token_ids)]) == output.token_ids and trace.finish().text == output.text
        commits = [e for e in trace.events if isinstance(e, CommitEvent)]
        assert [c.step for c in commits] == list(range(len(commits))) and sum(c.num_tokens for c in commits) >= \
            len(output.token_ids)
        metrics = compute(trace)
        assert metrics.tokens == len(output.token_ids) and metrics.target_forwards == len(commits)
        drafted += metrics.drafted or 0
    assert (drafted > 0) == (algo != "ar")


def test_batch_one_generation_samples_what_plain_decoding_samples(target) -> None:
    """Seeded sampling through the engine: plain decoding's tokens, seed for seed, whatever the proposer."""
    generation = GenerationParams(max_new_tokens=16)
    for i, prompt in enumerate(PROMPTS[:4]):
        sampling = SamplingParams(temperature=0.8, top_p=0.95, seed=i)
        plain = tuple(reference_tokens(target, prompt, sampling, generation))
        for algo, params in (("ar", None), ("prompt-lookup", PromptLookupParams()), ("lookahead", LookaheadParams()),
                             ("medusa", MedusaParams())):
            proposer = None if params is None else PROPOSERS[algo](target, params)
            output, _ = generate(target, prompt, proposer, sampling, generation, algo)
            assert output.token_ids == plain, (algo, prompt)


@pytest.mark.parametrize("algo, params", [
    ("prompt-lookup", PromptLookupParams(num_draft=4, branches=3)),
    ("medusa", MedusaParams(tree="small")),
    ("medusa", MedusaParams(tree="chain", acceptance="typical")),
    ("speculative", SpeculativeParams(sample=True))])
def test_proposer_settings_keep_greedy_exact(target, plain_outputs, algo, params) -> None:
    """Several copies merged into a tree, the named Medusa trees, typical acceptance and sampled draft chains (the
    last two matter only when sampling) leave greedy outputs plain decoding's (with every width run, as if a forward
    cost one step however wide)."""
    proposer = PROPOSERS[algo](target, params)
    trees = 0
    for prompt in PROMPTS[:12]:
        output, trace = generate(target, prompt, proposer, generation=GenerationParams(max_new_tokens=NEW_TOKENS),
                                 costs=ForwardCosts((1, 2), (1.0, 1.0)))
        assert output.token_ids == plain_outputs[prompt], (algo, params, prompt)
        trees += sum(1 for e in trace.events if isinstance(e, DraftEvent) and any(t.parent for t in e.tokens[1:]))
    assert trees > 0 or params in (MedusaParams(tree="chain", acceptance="typical"),
                                   SpeculativeParams(sample=True))


def test_typical_acceptance_and_sampled_chains_run_when_sampling(target) -> None:
    """Under sampling, Medusa's typical acceptance (lossy) keeps more of the heads' tokens than the exact rule on the
    same prompts and seeds, and a sampled draft chain is judged by the lossless rule: both run to the end."""
    generation = GenerationParams(max_new_tokens=32)
    accepted = {}
    for acceptance in ("lossless", "typical"):
        proposer = PROPOSERS["medusa"](target, MedusaParams(acceptance=acceptance))
        accepted[acceptance] = sum(
            compute(generate(target, p, proposer, SamplingParams(temperature=0.7, seed=i), generation,
                             "medusa")[1]).accepted
            for i, p in enumerate(PROMPTS[:6]))
    assert accepted["typical"] > accepted["lossless"] > 0
    proposer = PROPOSERS["speculative"](target, SpeculativeParams(sample=True))
    output, trace = generate(target, PROMPTS[0], proposer, SamplingParams(temperature=0.7, seed=0), generation,
                             "speculative")
    assert len(output.token_ids) > 0 and compute(trace).drafted > 0


def test_a_proposer_adds_its_own_trace_events(target) -> None:
    """Lookahead's window, pool size and candidates go into the engine's trace before each step's draft, and the
    step detail draws them."""
    proposer = PROPOSERS["lookahead"](target, LookaheadParams())
    _, trace = generate(target, PROMPTS[0], proposer, generation=GenerationParams(max_new_tokens=12),
                        algo="lookahead")
    windows = [e for e in trace.events if isinstance(e, LookaheadEvent)]
    assert windows and all(e.step >= 1 and e.pool_size > 0 and len(e.window) >= 1 for e in windows)
    assert "Jacobi window" in render_step_detail(trace.events, windows[-1].step)
    assert Trace.from_json(trace.to_json()).events == trace.events


def test_the_step_detail_draws_an_engine_tree_with_its_texts(target) -> None:
    """A Medusa step through the engine: its tree drawn from the draft event alone, with the tokens' own texts (no
    tokenizer at hand) and the kept path marked."""
    proposer = PROPOSERS["medusa"](target, MedusaParams())
    _, trace = generate(target, PROMPTS[0], proposer, generation=GenerationParams(max_new_tokens=16),
                        algo="medusa")
    step = next(e.step for e in trace.events if isinstance(e, AcceptEvent) and e.step > 0)
    draft = next(e for e in trace.events if isinstance(e, DraftEvent) and e.step == step)
    html = render_step_detail(trace.events, step)
    assert "Proposal tree" in html and "pg-accepted" in html and "#" + str(draft.tokens[0].id) not in html
    assert all(t.text.strip() == "" or t.text.strip() in html for t in draft.tokens if "<" not in t.text)
