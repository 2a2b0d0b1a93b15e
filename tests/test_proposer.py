"""A new algorithm is one proposer and its spec: one defined here, in a test alone, runs through the engine's batch
and the server with no other file changed, keeps greedy and seeded outputs those of plain decoding, and once
registered appears with its setting on the command line, in the app's Decode and Race tabs and in the bench, and its
own note in the trace, checked as it loads and said in the step detail."""

from __future__ import annotations

import argparse
import json
import re
from dataclasses import dataclass, replace
from typing import ClassVar

import pytest

from playground.__main__ import algo_params, build_parser
from playground.bench import harness as bench
from playground.config import ConfigError, EngineParams, GenerationParams, SamplingParams, check_int
from playground.decoding import registry
from playground.decoding.costs import ForwardCosts
from playground.decoding.lookahead import LookaheadParams
from playground.decoding.medusa import MedusaParams
from playground.decoding.prompt_lookup import PromptLookupParams
from playground.decoding.proposer import Note, Proposal, Proposer
from playground.decoding.registry import ALGORITHMS
from playground.decoding.spec import Algorithm, Setting
from playground.decoding.speculative import SpeculativeParams
from playground.engine import Engine, generate
from playground.metrics import compute
from playground.notes import NoteKind, Said
from playground.trace import AcceptEvent, BonusEvent, CommitEvent, CorrectEvent, DraftEvent, Trace, TraceError
from playground.viz.steps import render_step_detail

from .prompts import NEW_TOKENS, PROMPTS
from .stats import reference_tokens
from .test_server import get, post, running


@dataclass(frozen=True)
class BigramParams:
    longest: int = 3

    def __post_init__(self) -> None:
        check_int("longest", self.longest, 1, 8)


@dataclass(frozen=True, slots=True)
class Followed(Note, NoteKind):
    """The trace's note of a bigram chain: how many bigrams the request's table held when it was proposed."""

    KIND: ClassVar[str] = "bigrams"
    table: int

    def shown(self) -> Followed:
        return self

    def check(self) -> None:
        if self.table < 1:
            raise ValueError(f"table: at least one bigram, got {self.table}")

    def say(self, draft, text) -> Said:
        return Said(origin=f" followed through a table of {self.table} bigrams")


class Bigrams(Proposer):
    """Proposes, after each request's last token, the chain its own text's bigrams lead to: the token that followed
    that token most recently, then the one that followed that, up to `longest`. Its table is per request, kept from
    `start` to `end` and grown in `observe` from the tokens the verifier kept."""

    label = "bigrams"

    def __init__(self, target=None, params: BigramParams | None = None) -> None:
        self.tables: dict[int, dict[int, int]] = {}
        self.ended = 0
        self.longest = (params or BigramParams()).longest

    def bind(self, settings, cache) -> None:
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
            while token in table and len(chain) < min(self.longest, room):
                token = table[token]
                chain.append(token)
            if chain:
                proposals[request.id] = replace(Proposal.chain(chain, self.label, 0.9), note=Followed(len(table)))
        return proposals

    def observe(self, request, proposal, outcome) -> None:
        text = request.tokens[: request.num_computed] + outcome.new
        self.tables[request.id].update(zip(text[-len(outcome.new) - 1 :], outcome.new))

    def describe(self):
        return {"proposer": self.label, "longest": self.longest}


BIGRAMS = Algorithm("bigrams", "bigram chains (a test's)", "bigram chains (--algo bigrams)", BigramParams, Bigrams,
                    (Setting("longest", "most tokens a chain proposes, 1..8", label="longest chain (1..8)"),),
                    sources={"bigrams": ("Bigrams", "chained")}, example="Repeat: red green blue, red green blue.",
                    notes=(Followed,))


@pytest.fixture
def registered():
    registry.register(BIGRAMS)
    yield BIGRAMS
    registry.unregister(BIGRAMS.name)


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


def test_a_proposer_defined_in_a_test_notes_its_proposals_in_the_trace(registered, target) -> None:
    """Its note goes into its draft events, survives the JSON round trip, is checked by its own rule as a trace
    loads, and is said in the step detail; unregistered, a trace holding it still loads and shows its fields."""
    _, trace = generate(target, BIGRAMS.example, Bigrams(), generation=GenerationParams(max_new_tokens=16),
                        algo="bigrams")
    drafts = [e for e in trace.events if isinstance(e, DraftEvent) and e.noted("bigrams")]
    assert drafts and all(e.note["table"] > 0 for e in drafts)
    assert Trace.from_json(trace.to_json()) == trace
    assert " followed through a table of " in render_step_detail(trace.events, drafts[0].step)
    data = json.loads(trace.to_json())
    at = next(i for i, e in enumerate(data["events"]) if e["kind"] == "draft")
    data["events"][at]["note"]["table"] = 0
    with pytest.raises(TraceError, match=re.escape(f"events[{at}].note.table: at least one bigram, got 0")):
        Trace.from_dict(data)
    registry.unregister(BIGRAMS.name)
    try:
        loaded = Trace.from_json(trace.to_json())
        assert "a note of kind bigrams: table " in render_step_detail(loaded.events, drafts[0].step)
    finally:
        registry.register(BIGRAMS)


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
        assert state["weights"] == target.model.formats_read()  # what the products read, in words


@pytest.mark.parametrize("kv", ["contiguous", "paged"])
@pytest.mark.parametrize("algo", ["ar", "prompt-lookup", "lookahead", "medusa", "speculative"])
def test_batch_one_generation_is_the_engine_step_with_its_trace(target, plain_outputs, algo, kv) -> None:
    """`generate` runs one request through the engine: plain decoding's greedy tokens for every algorithm on either
    cache, and a trace that survives its JSON round trip and adds up (tokens drawn, decisions, steps)."""
    params = {"prompt-lookup": PromptLookupParams(), "lookahead": LookaheadParams(),
              "medusa": MedusaParams(), "speculative": SpeculativeParams()}.get(algo)
    proposer = None if params is None else ALGORITHMS[algo].proposer(target, params)
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
            proposer = None if params is None else ALGORITHMS[algo].proposer(target, params)
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
    proposer = ALGORITHMS[algo].proposer(target, params)
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
        proposer = ALGORITHMS["medusa"].proposer(target, MedusaParams(acceptance=acceptance))
        accepted[acceptance] = sum(
            compute(generate(target, p, proposer, SamplingParams(temperature=0.7, seed=i), generation,
                             "medusa")[1]).accepted
            for i, p in enumerate(PROMPTS[:6]))
    assert accepted["typical"] > accepted["lossless"] > 0
    proposer = ALGORITHMS["speculative"].proposer(target, SpeculativeParams(sample=True))
    output, trace = generate(target, PROMPTS[0], proposer, SamplingParams(temperature=0.7, seed=0), generation,
                             "speculative")
    assert len(output.token_ids) > 0 and compute(trace).drafted > 0


def test_a_proposer_notes_its_own_trace_fields(target) -> None:
    """Lookahead's window, pool size and candidates go into each step's draft event as its note, and the step detail
    draws them."""
    proposer = ALGORITHMS["lookahead"].proposer(target, LookaheadParams())
    _, trace = generate(target, PROMPTS[0], proposer, generation=GenerationParams(max_new_tokens=12),
                        algo="lookahead")
    windows = [e for e in trace.events if isinstance(e, DraftEvent) and e.noted("jacobi")]
    assert windows and all(e.step >= 1 and e.note["pool_size"] > 0 and len(e.note["window"]) >= 1 for e in windows)
    assert "Jacobi window" in render_step_detail(trace.events, windows[-1].step)
    assert Trace.from_json(trace.to_json()).events == trace.events


def test_the_step_detail_draws_an_engine_tree_with_its_texts(target) -> None:
    """A Medusa step through the engine: its tree drawn from the draft event alone, with the tokens' own texts (no
    tokenizer at hand) and the kept path marked."""
    proposer = ALGORITHMS["medusa"].proposer(target, MedusaParams())
    _, trace = generate(target, PROMPTS[0], proposer, generation=GenerationParams(max_new_tokens=16),
                        algo="medusa")
    step = next(e.step for e in trace.events if isinstance(e, AcceptEvent) and e.step > 0)
    draft = next(e for e in trace.events if isinstance(e, DraftEvent) and e.step == step)
    html = render_step_detail(trace.events, step)
    assert "Proposal tree" in html and "pg-accepted" in html and "#" + str(draft.tokens[0].id) not in html
    assert all(t.text.strip() == "" or t.text.strip() in html for t in draft.tokens if "<" not in t.text)


def test_a_registered_algorithm_appears_on_every_surface(registered, target, plain_outputs) -> None:
    """Its spec alone puts it, with its one setting, on the command line (generate and serve), in the app's Decode
    tab (its choice, its field, its example) and Race, and in the bench's contenders; each runs it with the setting
    given, and greedy output stays plain decoding's."""
    from gradio_client import Client

    from playground.ui import build_app
    from playground.ui.form import layout

    parser = build_parser()
    for command in ("generate", "serve"):
        helped = parser._subparsers._group_actions[0].choices[command].format_help()
        assert "bigram chains (--algo bigrams):" in helped and re.search(r"--longest LONGEST\s+most tokens", helped)
    args = parser.parse_args(["generate", "--prompt", "hi", "--algo", "bigrams", "--longest", "2"])
    assert algo_params(args) == (BigramParams(2), None)
    assert algo_params(parser.parse_args(["serve", "--algo", "bigrams", "--longest", "5"]))[0] == BigramParams(5)
    with pytest.raises(ConfigError, match=re.escape("longest must be an integer in [1, 8], got 0")):
        algo_params(parser.parse_args(["generate", "--prompt", "hi", "--algo", "bigrams", "--longest", "0"]))
    with pytest.raises(ConfigError, match="longest: a setting of --algo bigrams, not medusa"):
        algo_params(parser.parse_args(["generate", "--prompt", "hi", "--algo", "medusa", "--longest", "2"]))

    # the app: the Decode tab runs it with its field's value; the Race runs it at its defaults
    fields = {f"{owner}.{setting.field}": value for owner, setting, value in layout()}
    assert fields["bigrams.longest"] == 3
    app = build_app(lambda handler: handler)
    app.launch(prevent_thread_lock=True, quiet=True)
    try:
        client = Client(app.local_url, verbose=False)
        values = [2 if key == "bigrams.longest" else value for key, value in fields.items()]
        prompt = PROMPTS[0]
        outputs = client.predict(prompt, BIGRAMS.label, NEW_TOKENS, 0.0, 0, 1.0, None, "contiguous", "as-set",
                                 *values, "embedded", "", "cpu", "float32", "auto", api_name="/decode")
        trace = Trace.load(outputs[4][0])  # the trace, then its timeline
        assert trace.algo == "bigrams" and trace.params["longest"] == 2
        assert tuple(trace.finish().token_ids) == plain_outputs[prompt] and compute(trace).drafted > 0
        assert "same tokens as plain decoding: yes" in outputs[3]
        page = json.dumps(client.config)  # the layout the browser draws: its choice, its field and its example
        assert all(text in page for text in (BIGRAMS.label, "longest chain (1..8)", BIGRAMS.example))
        _, status, table, *_ = client.predict(prompt, [BIGRAMS.label], 8, 0.0, 0, "as-set", "embedded", "", "cpu",
                                              "float32", "auto", api_name="/race")
        assert [row[0] for row in (table["data"] if isinstance(table, dict) else table)] == ["plain", BIGRAMS.label]
    finally:
        app.close()

    # the bench races it against plain decoding at its defaults
    assert bench.parse_algos("bigrams") == ("bigrams",)
    options = argparse.Namespace(algos=("bigrams",), gamma=4, tree="dynamic", draft=None, model="embedded")
    contenders, draft = bench.build_contenders(options, target)
    assert [(c.name, c.algo, c.setting) for c in contenders] == [("bigrams", "bigrams", "longest 3")] and draft is None
