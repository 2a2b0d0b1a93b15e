"""Renderers: token states from events, step replay, escaping, legend, copied-source highlight, race
lanes on their own clocks, the KV block map and memory chart, the notebooks' step player."""

from __future__ import annotations

import html
import re
from dataclasses import replace

import pytest

from playground.config import GenerationParams, SamplingParams
from playground.decoding.prompt_lookup import CopyProposer, PromptLookupParams
from playground.engine import generate
from playground.trace import (
    AcceptEvent,
    BonusEvent,
    CommitEvent,
    CorrectEvent,
    DraftEvent,
    FinishEvent,
    MemoryEvent,
    PreemptEvent,
    RejectEvent,
    TokenInfo,
)
from playground.ui.decode import _source_span
from playground.viz import STATES, render_legend, render_prompt, render_tokens, token_views
from playground.viz.memory import memory_figure, render_block_map, request_colour
from playground.viz.race import Lane, events_until, render_race
from playground.viz.steps import render_step_detail, step_rows
from playground.viz.widgets import step_player


def tok(token_id: int, position: int, text: str | None = None) -> TokenInfo:
    return TokenInfo(id=token_id, text=text if text is not None else f"t{token_id}", position=position, p=0.5, q=0.25)


def commit(step: int) -> CommitEvent:
    return CommitEvent(step=step, t=0.0, num_tokens=0, draft_s=0.0, verify_s=0.0, overhead_s=0.0, kv_bytes=0)


def speculative_events() -> list:
    """Step 0: the prefill token. Step 1: 3 proposals, 1 accepted, 1 rejected, 1 never judged, a correction.
    Step 2: 2 proposals, both accepted, a bonus. Step 3: nothing proposed, one plain token."""
    return [
        BonusEvent(step=0, t=0.0, token=tok(10, 5)), commit(0),
        DraftEvent(step=1, t=0.1, tokens=[tok(11, 6), tok(12, 7), tok(13, 8)], wall_s=0.1, draft_forwards=3),
        AcceptEvent(step=1, t=0.2, token=tok(11, 6), u=0.1),
        RejectEvent(step=1, t=0.2, token=tok(12, 7), u=0.9),
        CorrectEvent(step=1, t=0.2, token=tok(14, 7)), commit(1),
        DraftEvent(step=2, t=0.3, tokens=[tok(15, 8), tok(16, 9)], wall_s=0.1, draft_forwards=2),
        AcceptEvent(step=2, t=0.4, token=tok(15, 8), u=None),
        AcceptEvent(step=2, t=0.4, token=tok(16, 9), u=None),
        BonusEvent(step=2, t=0.4, token=tok(17, 10)), commit(2),
        BonusEvent(step=3, t=0.5, token=tok(18, 11)), commit(3),
    ]


def tree_events() -> list:
    """Step 1 proposes a tree: nodes 1 (a) and 2 (b) follow the last token, 3 (c) and 4 (d) follow a, 5 (e) follows
    c. The target keeps a and refuses c, correcting it."""
    def node(token_id: int, position: int, parent: int) -> TokenInfo:
        return replace(tok(token_id, position), parent=parent)

    tree = DraftEvent(step=1, t=0.0, wall_s=0.0, draft_forwards=0, tokens=[
        node(11, 4, 0), node(12, 4, 0), node(13, 5, 1), node(14, 5, 1), node(15, 6, 3)])
    return [BonusEvent(step=0, t=0.0, token=tok(10, 3)), commit(0), tree,
            AcceptEvent(step=1, t=0.0, token=tok(11, 4)), RejectEvent(step=1, t=0.0, token=tok(13, 5)),
            CorrectEvent(step=1, t=0.0, token=tok(16, 5)), commit(1)]


def states(views) -> list[tuple[int, str]]:
    return [(v.token.id, v.state) for v in views]


def test_every_decision_gets_its_state_in_text_order():
    assert states(token_views(speculative_events())) == [
        (10, "generated"), (11, "accepted"), (12, "rejected"), (13, "discarded"), (14, "corrected"),
        (15, "accepted"), (16, "accepted"), (17, "bonus"), (18, "generated")]


def test_replaying_a_step_shows_the_tokens_as_they_stood():
    events = speculative_events()
    assert states(token_views(events, upto_step=0)) == [(10, "generated")]
    assert [s for _, s in states(token_views(events, upto_step=1))] == [
        "generated", "accepted", "rejected", "discarded", "corrected"]
    # mid-step, while the target has not judged the proposals yet, they are pending
    assert states(token_views(events[:3])) == [(10, "generated"), (11, "pending"), (12, "pending"), (13, "pending")]


def test_the_annotated_text_keeps_earlier_steps_refused_guesses_out_of_the_line():
    """Step 1's refused and never-judged guesses stay in view while step 1 is the latest, and leave the line (a
    `pg-past` class, shown only under `pg-show-guesses`) once later steps have come."""
    events = speculative_events()
    past = re.compile(r'class="pg-tok pg-(\w+) pg-past"')
    assert past.findall(render_tokens(events, upto_step=1)) == []
    assert past.findall(render_tokens(events)) == ["rejected", "discarded"]
    page = render_tokens(events)
    assert ".pg-past { display: none; }" in page and ".pg-show-guesses .pg-past { display: inline; }" in page


def test_html_escapes_token_text_and_hover():
    evil = "<script>alert(1)</script>\"'&"
    events = [DraftEvent(step=1, t=0.0, tokens=[tok(1, 0, evil)], wall_s=0.0, draft_forwards=1),
              RejectEvent(step=1, t=0.0, token=tok(1, 0, evil), u=0.5),
              CorrectEvent(step=1, t=0.0, token=tok(2, 0, "<b>bold</b>"))]
    out = render_tokens(events)
    assert "<script>" not in out and "<b>" not in out
    assert "&lt;script&gt;alert(1)&lt;/script&gt;" in out and "&lt;b&gt;bold&lt;/b&gt;" in out
    # the hover text is an attribute: quotes inside it must not end it
    for title in re.findall(r'title="([^"]*)"', out):
        assert "<" not in title
    assert out.count('class="pg-tok pg-rejected"') == 1 and out.count('class="pg-tok pg-corrected"') == 1


def test_hover_names_step_decision_p_q_and_draw():
    out = render_tokens(speculative_events())
    assert "step 1 · rejected · token 12 &#x27;t12&#x27; · p 0.5000 · q 0.2500 · u 0.9000" in out


def test_legend_lists_every_state_with_its_class_and_css():
    legend = render_legend()
    for state in STATES.values():
        assert f'class="pg-tok pg-{state.name}"' in legend and f">{state.label}<" in legend
        assert f".pg-{state.name}{{" in legend
        # on a touch screen nothing hovers: each meaning is also text in the list that opens below the legend
        assert f"</span>: {html.escape(state.meaning)}</li>" in legend


def test_prompt_source_span_is_highlighted():
    out = render_prompt(["a", "b", "<c>", "d"], source=(1, 3))
    highlighted = re.findall(r'<span class="pg-tok pg-prompt pg-source">([^<]*)</span>', out)
    assert highlighted == ["b", "&lt;c&gt;"]
    assert "pg-source" not in render_prompt(["a", "b"], source=(5, 7)).split("</style>")[1]


def test_a_tree_being_verified_is_drawn_where_the_text_ends():
    """The replay's first beat of a step that proposed a tree: the text ends in the tree, one branch a line, each
    starting under the token it branches from (blank copies of the tokens above it), every node drafted once; a
    chain's beat, or the verdict's, is text alone."""
    from playground.viz.tokens import branch_lines

    events = tree_events()
    assert branch_lines(events[2]) == [([], [1, 3, 5]), ([], [2]), ([1], [4])]
    drafting = render_tokens(events, 1, proposing=True).split("</style>")[-1]
    lines = drafting.split('<span class="pg-branch">')[1:]
    shown = [re.findall(r'class="pg-tok pg-(\w+)"[^>]*>([^<]*)<', line) for line in lines]
    assert shown == [[("pending", "t11"), ("pending", "t13"), ("pending", "t15")], [("pending", "t12")],
                     [("blank", "t11"), ("pending", "t14")]]
    assert "pg-branches" not in render_tokens(events, 1).split("</style>")[-1]
    assert "pg-branches" not in render_tokens(speculative_events(), 1, proposing=True).split("</style>")[-1]


def test_a_tree_shows_its_kept_path_and_what_stood_behind_the_refusal_not_the_other_branches():
    """Nodes 1 (a) and 2 (b) follow the last token; 3 (c) and 4 (d) follow a, 5 (e) follows c. The target keeps a,
    refuses c, so e stood behind the refusal (discarded); b and d were branches beside the kept path (dropped)."""
    events = tree_events()
    assert states(token_views(events)) == [(10, "generated"), (11, "accepted"), (13, "rejected"), (15, "discarded"),
                                           (16, "corrected")]


def test_a_real_trace_renders_the_generated_text(target):
    proposer = CopyProposer(target, PromptLookupParams(max_ngram=2, num_draft=4))
    output, trace = generate(target, "Repeat exactly: one two three four five six seven eight.", proposer,
                             SamplingParams(), GenerationParams(max_new_tokens=24))
    views = token_views(trace.events)
    kept = [v.token.id for v in views if v.state not in ("rejected", "discarded", "pending")]
    assert tuple(kept) == output.token_ids
    assert any(v.state == "accepted" for v in views)


def test_charts_count_per_step_and_accumulate_tokens():
    from playground.viz.charts import expected_speedup, steps_figure, tokens_time_series

    events = speculative_events()
    bars = {trace.name: list(trace.y) for trace in steps_figure(events).data}
    # step 3 proposes nothing: its token is a plain one, not a bonus
    assert bars == {"accepted": [1, 2, 0], "corrected": [1, 0, 0], "bonus": [0, 1, 0], "generated": [0, 0, 1],
                    "rejected": [-1, 0, 0]}
    commits = [CommitEvent(step=s, t=0.1 * s, num_tokens=n, draft_s=0.0, verify_s=0.0, overhead_s=0.0,
                           kv_bytes=0) for s, n in ((0, 1), (1, 2), (2, 3))]
    assert tokens_time_series(commits) == ([0.0, 0.0, 0.1, 0.2], [0, 1, 3, 6])
    assert abs(expected_speedup(0.7, 4, 0.15) - (1 - 0.7 ** 5) / 0.3 / 1.6) < 1e-12
    assert abs(expected_speedup(0.7, 4, 0.15, 0.05) - (1 - 0.7 ** 5) / 0.3 / 1.8) < 1e-12


def test_theory_panels_are_named_by_their_axes_so_a_phone_shows_no_overlapping_titles():
    from playground.viz.charts import theory_figure

    fig = theory_figure(0.7, 4, 0.15)
    assert not fig.layout.annotations  # no subplot titles side by side
    assert (fig.layout.yaxis.title.text, fig.layout.yaxis2.title.text) == ("tokens per forward", "speedup vs plain")


def test_theory_overlays_every_algorithms_runs_with_the_speedup_measured_beside_them():
    from playground.ui.theory import measured_points

    history = [{"algo": "ar", "prompt": "p", "tokens_per_s": 20.0, "acceptance_rate": None,
                "mean_accepted": None, "mean_draft": None, "speedup": None},
               {"algo": "speculative", "prompt": "p", "tokens_per_s": 30.0, "acceptance_rate": 0.6,
                "mean_accepted": 2.1, "mean_draft": 4.0, "speedup": 1.5, "tree": False},
               {"algo": "eagle", "prompt": "q", "tokens_per_s": 10.0, "acceptance_rate": 0.2,
                "mean_accepted": 1.2, "mean_draft": 1.0, "mean_nodes": 12.0, "speedup": 0.9, "tree": True},
               {"algo": "prompt-lookup", "prompt": "p", "tokens_per_s": 50.0, "acceptance_rate": 0.5,
                "mean_accepted": 1.5, "mean_draft": 8.0, "speedup": None, "tree": False}]
    points = measured_points(history)
    # plain decoding drafts nothing; a tree's x is the nodes a step verified; no speedup is borrowed from elsewhere
    assert [(p.gamma, p.acceptance, p.tokens_per_forward, p.speedup, p.tree) for p in points] == [
        (4.0, 0.6, 2.1, 1.5, False), (12.0, 0.2, 1.2, 0.9, True), (8.0, 0.5, 1.5, None, False)]


def timed_run(times: list[float], per_step: int, name: str = "x") -> list:
    """A run committing `per_step` plain tokens at each engine time, then finishing at the last one."""
    events, position = [], 0
    for step, t in enumerate(times):
        for _ in range(per_step):
            events.append(BonusEvent(step=step, t=t, token=tok(100 + position, position, f"{name}{position}")))
            position += 1
        events.append(CommitEvent(step=step, t=t, num_tokens=per_step, draft_s=0.0, verify_s=0.0, overhead_s=0.0,
                                  kv_bytes=0))
    events.append(FinishEvent(step=len(times), t=times[-1], reason="length", token_ids=list(range(position)),
                              text="", wall_s=times[-1]))
    return events


def test_race_lanes_replay_each_run_on_its_own_clock():
    fast, slow = Lane("fast <b>", timed_run([0.1, 0.2], 4, "f")), Lane("slow", timed_run([0.1, 0.4, 0.8], 1, "s"))
    assert (fast.wall_s, fast.total_tokens, slow.wall_s, slow.total_tokens) == (0.2, 8, 0.8, 3)
    assert len(events_until(slow.events, 0.4)) == 4
    start = render_race([fast, slow], 0.0)
    assert start.count('class="pg-lane"') == 2 and "0 tokens · 0.00 s" in start and 'class="pg-tok ' not in start
    mid = render_race([fast, slow], 0.3)
    assert "8 tokens · done in 0.20 s" in mid and "1 tokens · 0.30 s" in mid
    assert mid.count("pg-lane pg-lane-done") == 1 and 'style="width:100.0%"' in mid and 'style="width:33.3%"' in mid
    end = render_race([fast, slow])
    assert end.count("pg-lane pg-lane-done") == 2 and "s2" in end and "fast &lt;b&gt;" in end and "fast <b>" not in end


def memory_event(step: int, t: float, owners: list[int], shared: list[int], used: int, contiguous: int):
    return MemoryEvent(step=step, t=t, num_tokens=1, wall_s=0.01, block_size=4, blocks_total=len(owners),
                       blocks_used=sum(o >= 0 for o in owners), bytes_used=used, bytes_reserved=used + 10,
                       logical_bytes=used, contiguous_bytes=contiguous, owners=owners, shared=shared,
                       running=sorted({o for o in owners if o >= 0}), waiting=[])


def test_block_map_colours_blocks_by_request_and_marks_shared_and_free():
    event = memory_event(3, 0.5, [0, 0, 1, -1, -1, 2], [0], 100, 400)
    shown = render_block_map(event, {0: "running", 1: "running", 2: "waiting"})
    assert shown.count('class="pg-block') == 6 and shown.count("pg-block pg-block-free\"") == 2
    assert shown.count("pg-block pg-block-shared\"") == 1 and 'title="block 0: request 0, shared' in shown
    assert f"background-color:{request_colour(1)}" in shown and "request 2 … waiting" in shown
    assert "4 of 6 blocks in use" in shown and "1 shared" in shown
    assert "class=\"pg-block" not in render_block_map(None)  # the empty container only


def test_memory_chart_draws_paged_against_contiguous_with_preemptions():
    events = [memory_event(1, 0.1, [0, -1], [], 2**20, 4 * 2**20),
              PreemptEvent(step=2, t=0.2, seq=1, reason="out of KV blocks"),
              memory_event(2, 0.2, [0, 0], [], 2 * 2**20, 4 * 2**20)]
    fig = memory_figure(iter(events))
    lines = {trace.name: list(trace.y) for trace in fig.data}
    assert lines["contiguous reservation"] == [4.0, 4.0] and lines["paged: tokens stored"] == [1.0, 2.0]
    assert list(fig.data[-1].x) == [0.2] and fig.data[-1].name == "preemption"


def test_step_table_counts_each_decision_and_the_detail_names_the_proposals():
    table = step_rows(speculative_events())
    assert [r[:7] for r in table] == [[1, 3, 1, 1, 1, 0, 0], [2, 2, 2, 0, 0, 1, 0], [3, 0, 0, 0, 0, 0, 1]]
    detail = render_step_detail(speculative_events(), 1, {11: "a<b", 12: "c", 13: "d"}.get)
    assert "<b>step 1</b>" in detail and "1 accepted, 1 rejected" in detail and "by 3 draft forward(s)" in detail
    assert "a&lt;b" in detail and "a<b" not in detail
    assert "nothing proposed" in render_step_detail(speculative_events(), 3)


def sibling_events() -> list:
    """Step 1: a chain of 2 with a sibling of its first token (parent 0, same position); the target refuses the
    first choice and takes the sibling, then a bonus. Step 2: the same shape, the chain accepted whole."""
    def node(token_id: int, position: int, parent: int) -> TokenInfo:
        return replace(tok(token_id, position), parent=parent)

    return [
        BonusEvent(step=0, t=0.0, token=tok(10, 5)), commit(0),
        DraftEvent(step=1, t=0.1, tokens=[node(11, 6, 0), node(12, 7, 1), node(13, 6, 0)], wall_s=0.1,
                   draft_forwards=2),
        RejectEvent(step=1, t=0.2, token=tok(11, 6), u=None),
        AcceptEvent(step=1, t=0.2, token=tok(13, 6), u=None),
        BonusEvent(step=1, t=0.2, token=tok(14, 7)), commit(1),
        DraftEvent(step=2, t=0.3, tokens=[node(15, 8, 0), node(16, 9, 1), node(17, 8, 0)], wall_s=0.1,
                   draft_forwards=2),
        AcceptEvent(step=2, t=0.4, token=tok(15, 8), u=None),
        AcceptEvent(step=2, t=0.4, token=tok(16, 9), u=None),
        BonusEvent(step=2, t=0.4, token=tok(18, 10)), commit(2),
    ]


def test_a_sibling_that_lost_leaves_the_text_and_the_detail_names_it():
    events = sibling_events()
    # while a step is judged the text shows its best guess, the chain (the sibling is in the step detail); once
    # decided, a sibling that lost is gone and one that won takes its place
    assert states(token_views(events[:3])) == [(10, "generated"), (11, "pending"), (12, "pending")]
    assert states(token_views(events)) == [
        (10, "generated"), (11, "rejected"), (12, "discarded"), (13, "accepted"), (14, "bonus"),
        (15, "accepted"), (16, "accepted"), (18, "bonus")]
    detail = render_step_detail(events, 1, {11: "a", 12: "b", 13: "c<"}.get)
    assert "the draft's runner-up" in detail and "c&lt;" in detail and "1 accepted, 1 rejected" in detail


def test_lookahead_detail_draws_the_window_and_outlines_the_verified_hit():
    window = {"kind": "jacobi", "window": [[1, 2, 3], [4, 5, 6]], "pool_size": 7, "candidates": [[8, 9], [8, 7]]}
    events = [DraftEvent(step=1, t=0.0, tokens=[tok(8, 3), tok(7, 4)], wall_s=0.0, draft_forwards=0, note=window)]
    detail = render_step_detail(events, 1)
    assert detail.count("<th>row ") == 2 and detail.count("<td>") == 6 and "<td>#5</td>" in detail
    assert "pool: 7 n-grams; 2 hit(s)" in detail and detail.count("pg-ngram pg-verified") == 1
    # as set, every hit is verified at once, as a tree: each hit is one of its root-to-leaf paths, and outlined
    root = replace(tok(8, 3), parent=0)
    tree = [root, replace(tok(9, 4), parent=1), root, replace(tok(7, 4), parent=3)]
    both = render_step_detail([replace(events[0], tokens=tree)], 1)
    assert both.count("pg-ngram pg-verified") == 2 and "the verified ones outlined" in both
    nothing = render_step_detail([replace(events[0], tokens=[])], 1)
    assert "pg-ngram pg-verified" not in nothing and "none verified this step" in nothing


def test_a_copy_highlights_its_source_until_a_proposal_without_one():
    copy = DraftEvent(step=1, t=0.0, tokens=[tok(5, 3), tok(8, 4)], wall_s=0.0, draft_forwards=0,
                      note={"kind": "copied", "source": [2, 4], "ngram": 3})
    assert _source_span([copy], 1) == (2, 4)
    guessed = replace(copy, step=2, note=None)
    assert _source_span([copy, guessed], 2) is None and _source_span([copy, guessed], 1) == (2, 4)
    assert "copied from positions 2..3 after a 3-token match" in render_step_detail([copy], 1)


def test_step_player_shows_the_last_step_and_rerenders_on_every_move():
    seen = []

    def render(step):
        seen.append(step)
        return f"<b>step {step}</b>"

    box = step_player(render, 1, 5)
    controls, view = box.children
    play, slider = controls.children
    assert (play.min, play.max, slider.min, slider.max) == (1, 5, 1, 5)
    assert view.value == "<b>step 5</b>"
    slider.value = 2
    assert view.value == "<b>step 2</b>" and seen == [5, 2]
    with pytest.raises(ValueError, match="last must be >= first"):
        step_player(render, 3, 2)


def test_a_step_shows_its_proposal_before_its_verdict_and_names_what_sits_beside_its_first_token():
    """The replay's first beat of a step: its proposal drafted ("pending") and being verified, no verdict yet; the
    step's second beat is its verdict. Beside a chain's first token sit the draft's runner-up, the heads' other
    guess, or prompt lookup's second copy."""
    events = sibling_events()
    # the text shows the chain drafted; what sits beside its first token is named in the step detail
    assert states(token_views(events, 1, proposing=True)) == [(10, "generated"), (11, "pending"), (12, "pending")]
    proposing = render_step_detail(events, 1, {11: "a", 12: "b", 13: "c"}.get, proposing=True)
    shown = proposing.split("</style>")[-1]
    assert "being verified..." in shown and " accepted" not in shown and "committed" not in shown
    assert "1 accepted, 1 rejected" in render_step_detail(events, 1, {11: "a", 12: "b", 13: "c"}.get)
    heads = [replace(e, draft_forwards=0) if isinstance(e, DraftEvent) else e for e in events]
    assert "beside its first token runner-up" in render_step_detail(heads, 1)
    copies = [replace(e, note={"kind": "copied", "source": [0, 2], "ngram": 1}) if isinstance(e, DraftEvent) else e
              for e in heads]
    assert "beside its first token a second copy" in render_step_detail(copies, 1)


def test_a_notes_text_is_escaped_whether_its_kind_is_known_or_not():
    """A trace's note is data from a file: a kind no module registered shows its fields escaped, as does a known
    kind that says nothing of its own."""
    from dataclasses import dataclass

    from playground import notes

    @dataclass(frozen=True)
    class Plain(notes.NoteKind):
        KIND = "plain-test"
        label: str

    draft = DraftEvent(step=1, t=0.0, tokens=[tok(5, 3)], wall_s=0.0, draft_forwards=0,
                       note={"kind": "<i>mystery</i>", "label": "<script>x</script>"})
    shown = render_step_detail([draft], 1)
    assert "<script>" not in shown and "&lt;script&gt;" in shown and "&lt;i&gt;mystery" in shown
    notes.register(Plain)
    try:
        shown = render_step_detail([replace(draft, note={"kind": "plain-test", "label": "<script>x</script>"})], 1)
        assert "<script>" not in shown and "(label &lt;script&gt;x&lt;/script&gt;)" in shown
    finally:
        notes.unregister(Plain)
