"""The benchmark harness runs end to end on a tiny budget and writes its JSON and markdown."""

from __future__ import annotations

import argparse
import importlib.util
import json
import statistics
from collections import Counter

import pytest

from playground.__main__ import main
from playground.bench.harness import add_bench_args, check_options, chosen_prompts, contender_summary
from playground.bench.report import Costs, goals
from playground.bench.suite import SUITE, spread
from playground.config import ConfigError
from playground.decoding.medusa import dynamic_nodes
from playground.decoding.registry import ALGORITHMS, build_proposer

from .conftest import TEST_COSTS


def test_bench_writes_report(tmp_path, target) -> None:
    out_json, out_md = tmp_path / "b.json", tmp_path / "b.md"
    assert main(["bench", "--limit", "2", "--max-new-tokens", "4", "--device", "cpu", "--algos", "speculative",
                 "--draft", "none", "--rounds", "3", "--json", str(out_json), "--markdown", str(out_md)]) == 0
    report = json.loads(out_json.read_text())
    assert report["rounds"] == 3 and "interleaved, 3 round(s)" in out_md.read_text()
    # two prompts spread over the categories: the first chat prompt and the code prompt after the second chat one
    assert [(row["index"], row["category"]) for row in report["prompts"]] == [(0, "chat"), (2, "code")]
    assert "| 2 | code |" in out_md.read_text()
    row = report["prompts"][0]
    assert row["ar"]["tokens"] >= 1 and row["hf"]["tokens"] >= 1 and isinstance(row["same_tokens"], bool)
    bandwidth = report["bandwidth"]  # measured before each prompt: the bound at its median
    assert bandwidth["copy_gb_per_s"] > 0 and bandwidth["bound_tokens_per_s"] > 0
    low, high = bandwidth["copy_gb_per_s_range"]
    assert 0 < low <= bandwidth["copy_gb_per_s"] <= high
    assert 0 < report["summary"]["fraction_of_bound"]
    assert "measured before each prompt" in out_md.read_text()
    assert report["summary"]["median_ratio_vs_hf"] > 0
    assert "memory-bandwidth bound" in out_md.read_text()
    # the embedded model reads its GGUF blocks in integers; the same run races plain decoding on the same blocks
    # against float32 activations and on its float32 weights (other arithmetic: their tokens may differ)
    assert report["environment"]["weights"].startswith("Q4_1 and Q8_0 blocks, 8-bit activations")
    assert set(report["algos"]) == {"ar-gguf", "ar-float32"}
    assert all(isinstance(row["algos"]["ar-float32"]["same_tokens_as_ar"], bool) for row in report["prompts"])
    assert "ours on the GGUF blocks with 8-bit activations / with float32 activations" in out_md.read_text()
    assert "ours on the GGUF blocks / on the float32 weights" in out_md.read_text()
    if importlib.util.find_spec("llama_cpp") is not None:  # the optional peer, where installed
        assert row["llama_cpp"]["tokens"] >= 1 and "ours / llama.cpp" in out_md.read_text()
    else:
        assert "llama_cpp" not in row


@pytest.mark.parametrize("count", range(1, len(SUITE) + 1))
def test_a_limit_spreads_the_prompts_over_the_categories(count) -> None:
    """Every category once before any twice, in suite order; the whole suite at its length."""
    indices = spread(count)
    assert len(indices) == count and indices == sorted(set(indices))
    taken = Counter(SUITE[i][0] for i in indices)
    assert max(taken.values()) - min(taken.get(category, 0) for category, _ in SUITE) <= 1


def test_a_limit_takes_one_prompt_of_each_category_first() -> None:
    assert spread(8) == [0, 2, 3, 4, 6, 8, 10, 12]  # one prompt of each of the 8 categories
    assert spread(9) == [0, 1, 2, 3, 4, 6, 8, 10, 12]  # then the second of the first category
    assert spread(len(SUITE)) == list(range(len(SUITE)))
    for count in (0, len(SUITE) + 1):
        with pytest.raises(ValueError, match="count must be in 1..14"):
            spread(count)


def test_bench_rejects_bad_limit(capsys) -> None:
    assert main(["bench", "--limit", "0"]) == 2
    assert "limit must be an integer in [1, 14]" in capsys.readouterr().err
    assert main(["bench", "--gamma", "17"]) == 2
    assert "gamma must be an integer in [1, 16], got 17" in capsys.readouterr().err
    assert main(["bench", "--rounds", "0"]) == 2
    assert "rounds must be an integer in [1, 10], got 0" in capsys.readouterr().err


def test_bench_races_every_algorithm_with_its_transformers_peer(tmp_path, target, monkeypatch) -> None:
    out_json = tmp_path / "s.json"
    # chat, code and the grounded code-editing prompt (the third of the spread): prompt lookup has text to copy
    assert main(["bench", "--limit", "3", "--max-new-tokens", "6", "--device", "cpu", "--draft", "embedded",
                 "--gamma", "2", "--rounds", "1", "--json", str(out_json), "--markdown", str(tmp_path / "s.md")]) == 0
    report = json.loads(out_json.read_text())
    assert set(report["algos"]) == {"ar-gguf", "ar-float32", "speculative", "speculative-copy", "prompt-lookup",
                                    "lookahead", "medusa", "medusa-copy", "medusa-lossless", "medusa-typical",
                                    "eagle", "eagle-copy", "eagle-sampled", "rest", "rest-wide", "self-speculative"}
    for row in report["prompts"]:
        for name, result in row["algos"].items():
            # the sampled rows show what lossless and typical acceptance buy; they are not greedy
            sampled = name in ("medusa-lossless", "medusa-typical", "eagle-sampled")
            assert result["same_tokens_as_ar"] is (None if sampled else True), name
            if sampled:  # measured against plain decoding sampled alike, in the same rounds (here one)
                assert result["speedup_vs_ar"] == pytest.approx(
                    result["tokens_per_s"] / row["ar_sampled"]["tokens_per_s"], rel=1e-6), name
    spec = report["prompts"][0]["algos"]["speculative"]
    assert spec["peer"]["tokens"] >= 1 and spec["ratio_vs_peer"] > 0
    assert report["algos"]["speculative"]["peer"] == "assisted generation (constant)"
    assert "gamma 2" in report["algos"]["speculative"]["setting"]
    assert "copy max ngram 3" in report["algos"]["speculative-copy"]["setting"]
    assert report["prompts"][2]["category"] == "code editing"
    for row in report["prompts"]:
        # transformers has no copies: a copying row's peer is its copy-free row's, run once and shared
        assert row["algos"]["speculative-copy"]["peer"] == row["algos"]["speculative"]["peer"]
    assert report["prompts"][0]["algos"]["prompt-lookup"]["peer"]["tokens"] >= 1
    assert "peer" not in report["prompts"][0]["algos"]["lookahead"]  # transformers has no lookahead decoding
    summary = report["summary"]["algos"]
    assert "median_speedup_vs_ar_grounded" in summary["prompt-lookup"]
    for row in report["prompts"]:
        for result in row["algos"].values():
            split = result["step_split"]
            assert result["step_cost"] == pytest.approx(split["draft"] + split["verify"] + split["other"])
            assert result["step_cost"] > 0 and isinstance(result["flags"], list)
    assert all(entry["median_step_cost"] > 0 and entry["flagged_prompts"] >= 0 for entry in summary.values())
    for entry in summary.values():  # how far the summary speedup moves with the prompts and rounds drawn
        low, high = entry["median_speedup_vs_ar_interval"]
        assert low <= entry["median_speedup_vs_ar"] <= high
        assert entry["never_loses"].startswith("yes" if high >= 0.98 else "NO")
    text = (tmp_path / "s.md").read_text()
    assert "(90% of bootstrap draws over the prompts and their rounds)" in text
    assert "## speculative" in text and "## prompt-lookup" in text and "(goal >= 1.3)" in text
    nodes = dynamic_nodes(gpu=False)
    assert f"depth 4, nodes {nodes}, tree dynamic, acceptance typical" in text and "(LOSSY)" in text
    assert "n/a (sampled)" in text and "over plain decoding sampled alike" in text
    assert "Costs come from the runs themselves" in text and "step cost: draft + verify + other" in text
    # each proposing row is measured against what its own steps predict on this machine's curve
    best = report["summary"]["perfect_proposer"]
    assert 1 <= best["width"] <= 64 and best["speedup"] >= 1.0 and "this machine's ceiling: a perfect proposer" in text
    for name, entry in summary.items():
        if name.startswith("ar-"):
            assert "median_predicted_speedup" not in entry, name
            continue
        assert entry["median_predicted_speedup"] > 0 and entry["median_share_of_predicted"] > 0, name
        assert ("where_the_rest_went" in entry) == (entry["median_share_of_predicted"] < 0.9), name
    assert "median share of predicted" in text and "(goal >= 0.9)" in text
    for name in ("medusa", "eagle"):  # a drafting forward of its own against its bytes' prediction
        entry = summary[name]
        assert entry["draft_forward_over_bytes"] == pytest.approx(entry["draft_forward"] /
                                                                  entry["draft_forward_by_bytes"]), name
    # EAGLE's further depth is one forward over top_k rows a request: its bytes predict that width's cost
    eagle = build_proposer(target, "eagle")
    assert summary["eagle"]["draft_forward_by_bytes"] == pytest.approx(eagle.own.prior * TEST_COSTS.step_cost(
        1, eagle.top_k)) and eagle.top_k > 1 and TEST_COSTS.step_cost(1, eagle.top_k) > 1
    assert "draft forward over bytes" in text and "(goal <= 1.5)" in text
    assert text.count(" | ok |") + text.count("rerun") + text.count("varied") + text.count("explains") >= 3 * 9


def test_the_goals_file_names_contenders_and_bounds() -> None:
    """A goal is data the report reads (`bench/goals.toml`): each table names a contender (or `every`), each goal
    is a bound on a figure, so a misspelt name cannot silently drop one."""
    contenders = {"every"}
    for spec in ALGORITHMS.values():
        contenders |= {spec.name, *(f"{spec.name}-{v.suffix}" for v in spec.variants)}
        contenders |= {f"{spec.name}-copy"} if spec.grafts else set()
    table = goals()
    assert set(table) <= contenders and "every" in table
    for name, entries in table.items():
        for key, goal in entries.items():
            bound, value = goal.split()
            assert bound in (">=", "<=") and float(value) > 0, (name, key)


def test_costs_are_medians_of_the_runs_forwards_in_plain_forwards_of_the_same_prompt() -> None:
    plain = Costs(verify=[(0, 1, 0.02), (0, 1, 0.02), (0, 1, 0.05), (1, 1, 0.04)])  # prompt 0: 0.02 s, prompt 1: 0.04
    costs = Costs(verify=[(0, 1, 0.03), (0, 5, 0.04), (0, 9, 0.05), (1, 9, 0.12), (2, 9, 1.0)],
                  draft=[(0, 0.002), (1, 0.006), (1, 0.008)])
    # one-token forwards (a step that proposed nothing) are left out of the verify cost; each forward is priced in
    # its own prompt's plain forwards (prompt 1's are twice prompt 0's); a prompt plain decoding did not run is not
    want = {"verify_cost_ratio": 2.5, "verify_tokens": 9, "draft_cost_ratio": 0.15}
    assert costs.ratios(plain) == pytest.approx(want)
    assert Costs(verify=[(0, 1, 0.03)]).ratios(plain) == {}


def test_bench_rejects_unknown_algorithms(capsys) -> None:
    assert main(["bench", "--algos", "speculative,medusa-ish"]) == 2
    assert "algos: unknown medusa-ish" in capsys.readouterr().err


def test_the_llama_cpp_peer_decodes_to_an_end_or_the_limit() -> None:
    """run_llama keeps llama.cpp's greedy tokens up to an end-of-sequence id or max_new_tokens, after a reset; the
    peer needs a GGUF file and the optional package."""
    from types import SimpleNamespace

    from playground.bench.peers import llama_cpp_peer, run_llama
    from playground.config import GenerationParams

    class FakeLlama:
        def __init__(self, tokens):
            self.tokens, self.resets, self.calls = tokens, 0, []

        def reset(self):
            self.resets += 1

        def generate(self, prompt_ids, **options):
            self.calls.append((list(prompt_ids), options))
            yield from self.tokens

    target = SimpleNamespace(eos_token_ids=(2,))
    llm = FakeLlama([5, 6, 2, 9])
    run = run_llama(llm, [1, 4], target, GenerationParams(max_new_tokens=8))
    assert run.token_ids == (5, 6, 2) and run.tokens == 3 and llm.resets == 1
    assert llm.calls[0][0] == [1, 4] and llm.calls[0][1]["top_k"] == 1 and llm.calls[0][1]["temp"] == 0.0
    assert run_llama(FakeLlama([5, 6, 7, 8]), [1], target, GenerationParams(max_new_tokens=2)).token_ids == (5, 6)
    assert llama_cpp_peer(None, 512) is None


def test_the_kernel_suite_reads_the_products_and_the_forward_against_their_bounds(tmp_path, target,
                                                                                  monkeypatch) -> None:
    from playground.bench import kernel as bench_kernel
    from playground.models import native

    monkeypatch.setattr(bench_kernel, "MIN_SECONDS", 0.002)
    monkeypatch.setattr(bench_kernel, "REPEATS", 2)
    monkeypatch.setattr(bench_kernel, "PAIRED_ROUNDS", 2)
    monkeypatch.setattr(native, "read_bandwidth", lambda kernel, threads: 20e9)  # a fixed machine, for the table
    out_json, out_md = tmp_path / "k.json", tmp_path / "k.md"
    assert main(["bench", "--suite", "kernel", "--json", str(out_json), "--markdown", str(out_md)]) == 0
    kernel = json.loads(out_json.read_text())["kernel"]
    assert kernel["peak_gfma_per_s"] > 0 and kernel["integer_peak_g_per_s"] > 0 and kernel["threads"] >= 1
    products = kernel["products"]
    # the layers' Q4_1 blocks and the output's Q8_0 rows in integers, and the largest layer product as float32
    assert {p["format"] for p in products} == {"Q4_1 x 8-bit", "Q8_0 x 8-bit", "float32"}
    assert {p["bound"] for p in products} == {"integer", "FMA"}
    assert {p["rows"] for p in products} == {1, 4, 8, 12, kernel["rows_per_pass"]}
    assert all(0 < p["share_of_peak"] < 1.5 and p["gfma_per_s"] > 0 for p in products)  # a bound bounds
    forward = kernel["forward"]
    assert forward["bound_ms"] == pytest.approx(1e3 * forward["bytes"] / 20e9) and 90e6 < forward["bytes"] < 100e6
    assert set(forward["ms"]) == {"1", "4", "8"} and all(v > 0 for v in forward["ms"].values())
    paired = forward["paired"]  # each one-token forward against the bandwidth of its own round (fixed here)
    assert len(paired["ratios"]) == 2 and paired["read_gb_per_s"] == [20.0, 20.0]
    assert paired["median"] == pytest.approx(statistics.median(paired["ratios"])) and min(paired["ratios"]) > 0
    text = out_md.read_text()
    assert "| 3072x576 | Q4_1 x 8-bit | 12 |" in text and "bounds a forward at" in text
    assert "the bound of its own moment (median" in text


def test_bench_races_a_spec_bench_file_per_category(tmp_path) -> None:
    """Spec-Bench's question.jsonl format (a few rows of two categories, two turns each): each row's first turn is
    raced under its category, `--per-category` samples, and the report tabulates each category's speedup and mean
    accepted tokens beside the project's columns; a bad file is one line before any model loads."""
    questions = tmp_path / "question.jsonl"
    rows = [{"question_id": i, "category": category, "turns": [text, "And then?"]} for i, (category, text) in
            enumerate([("summarization", "Summarise: the cat sat on the mat and the cat sat on the mat."),
                       ("math_reasoning", "What is 12 times 12?"), ("summarization", "Summarise: rain fell."),
                       ("math_reasoning", "What is 3 plus 4?")])]
    questions.write_text("".join(json.dumps(row) + "\n" for row in rows))
    out = tmp_path / "b.json"
    assert main(["bench", "--prompts", str(questions), "--per-category", "1", "--algos", "prompt-lookup",
                 "--max-new-tokens", "6", "--rounds", "1", "--no-peers", "--device", "cpu", "--json", str(out),
                 "--markdown", str(tmp_path / "b.md")]) == 0
    report = json.loads(out.read_text())
    assert [(r["category"], r["prompt"]) for r in report["prompts"]] == [
        ("summarization", rows[0]["turns"][0]), ("math_reasoning", rows[1]["turns"][0])]
    table = report["summary"]["algos"]["prompt-lookup"]["by_category"]
    assert set(table) == {"summarization", "math_reasoning"} and all(
        v["prompts"] == 1 and v["median_speedup"] > 0 and v["mean_accepted_tokens"] >= 1 for v in table.values())
    text = (tmp_path / "b.md").read_text()
    assert "| category | prompts | speedup (median) | mean accepted tokens |" in text
    assert "| summarization | 1 |" in text
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"turns": []}\n')
    assert main(["bench", "--prompts", str(bad)]) == 2


def bench_args(**changes) -> argparse.Namespace:
    """The bench's options at their defaults, as its parser gives them, with `changes`."""
    parser = argparse.ArgumentParser()
    add_bench_args(parser)
    args = parser.parse_args([])
    for key, value in changes.items():
        setattr(args, key, value)
    return args


def test_the_bench_checks_its_options_and_chooses_its_prompts_before_any_model_loads(tmp_path) -> None:
    """`check_options` sets the output files' defaults by suite and refuses a bad option in one line; and
    `chosen_prompts` takes the whole suite, --per-category's first of each category, then --limit spread."""
    args = bench_args(suite="kernel", json=str(tmp_path / "k.json"), markdown=str(tmp_path / "k.md"))
    check_options(args)
    assert args.algos == ",".join(ALGORITHMS)  # the default suite's options are not the kernel suite's concern
    args = bench_args(json=None, markdown=None, algos="prompt-lookup, rest")
    check_options(args)
    assert (args.json, args.markdown, args.algos) == ("bench_results/bench.json", "bench_results/bench.md",
                                                      ("prompt-lookup", "rest"))
    with pytest.raises(ConfigError, match=r"max_new_tokens must be an integer in \[1, 4096\], got 0"):
        check_options(bench_args(max_new_tokens=0))
    suite, indices = chosen_prompts(bench_args())
    assert suite == SUITE and indices == list(range(len(SUITE)))
    assert chosen_prompts(bench_args(limit=3))[1] == spread(3)
    firsts = chosen_prompts(bench_args(per_category=1))[1]
    assert [SUITE[i][0] for i in firsts] == list(dict.fromkeys(category for category, _ in SUITE))
    assert chosen_prompts(bench_args(per_category=1, limit=2))[1] == [firsts[i] for i in spread(2, [SUITE[i]
                                                                                                  for i in firsts])]
    with pytest.raises(ConfigError, match=r"limit must be an integer in \[1, 8\], got 9"):
        chosen_prompts(bench_args(per_category=1, limit=9))


def test_a_contenders_summary_is_its_prompts_medians() -> None:
    """`contender_summary` on made-up rows: the median speedup inside its interval, the verdict of the measured
    plan, grounded against open-ended prompts, each category's figures, and the mean acceptance where judged."""
    def result(speedup: float, accepted: float, rate: float | None) -> dict:
        return {"speedup_vs_ar": speedup, "round_speedups": [speedup, speedup], "same_tokens_as_ar": True,
                "mean_accepted_tokens": accepted, "acceptance_rate": rate, "step_cost": 1.0, "flags": []}
    rows = [{"index": i, "category": category, "algos": {"x": result(speedup, accepted, rate)}}
            for i, (category, speedup, accepted, rate) in enumerate([
                ("chat", 0.9, 1.2, 0.2), ("code editing", 1.5, 2.0, 0.6), ("chat", 1.1, 1.4, None)])]
    entry = contender_summary("x", rows, "measured")
    low, high = entry["median_speedup_vs_ar_interval"]
    assert entry["median_speedup_vs_ar"] == 1.1 and low <= 1.1 <= high and entry["never_loses"].startswith("yes")
    assert entry["all_same_tokens_as_ar"] is True and entry["median_tokens_per_target_forward"] == 1.4
    assert (entry["median_speedup_vs_ar_grounded"], entry["median_speedup_vs_ar_open"]) == pytest.approx((1.5, 1.0))
    assert entry["by_category"]["chat"] == pytest.approx({"prompts": 2, "median_speedup": 1.0,
                                                         "mean_accepted_tokens": 1.3})
    assert entry["mean_acceptance_rate"] == pytest.approx(0.4) and entry["flagged_prompts"] == 0
    assert "never_loses" not in contender_summary("x", rows, "as-set")
    for row in rows:
        row["algos"]["x"] |= {"same_tokens_as_ar": None, "round_speedups": [0.5, 0.6], "speedup_vs_ar": 0.55}
    losing = contender_summary("x", rows, "measured")
    assert losing["all_same_tokens_as_ar"] is None and losing["never_loses"].startswith("NO")
