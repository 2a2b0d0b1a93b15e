"""The benchmark harness runs end to end on a tiny budget and writes its JSON and markdown."""

from __future__ import annotations

import json
from collections import Counter

import pytest

from playground.__main__ import main
from playground.bench import Costs
from playground.bench_suite import SUITE, spread
from playground.config import SpeculativeParams, dynamic_nodes


def test_bench_writes_report(tmp_path, target) -> None:
    out_json, out_md = tmp_path / "b.json", tmp_path / "b.md"
    assert main(["bench", "--limit", "2", "--max-new-tokens", "4", "--device", "cpu", "--algos", "speculative",
                 "--draft", "none", "--json", str(out_json), "--markdown", str(out_md)]) == 0
    report = json.loads(out_json.read_text())
    # two prompts spread over the categories: the first chat prompt and the code prompt after the second chat one
    assert [(row["index"], row["category"]) for row in report["prompts"]] == [(0, "chat"), (2, "code")]
    assert "| 2 | code |" in out_md.read_text()
    row = report["prompts"][0]
    assert row["ar"]["tokens"] >= 1 and row["hf"]["tokens"] >= 1 and row["same_tokens"] is True
    assert report["bandwidth"]["copy_gb_per_s"] > 0 and report["bandwidth"]["bound_tokens_per_s"] > 0
    assert 0 < report["summary"]["fraction_of_bound"]
    assert report["summary"]["median_ratio_vs_hf"] > 0
    assert "memory-bandwidth bound" in out_md.read_text()
    assert report["algos"] == {} and report["prompts"][0]["algos"] == {}


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
    assert main(["bench", "--draft-confidence", "1"]) == 2
    assert "confidence must be in [0, 1), got 1.0" in capsys.readouterr().err


def test_bench_races_every_algorithm_with_its_transformers_peer(tmp_path, target) -> None:
    out_json = tmp_path / "s.json"
    # chat, code and the grounded code-editing prompt (the third of the spread): prompt lookup has text to copy
    assert main(["bench", "--limit", "3", "--max-new-tokens", "6", "--device", "cpu", "--draft", "embedded",
                 "--gamma", "2", "--json", str(out_json), "--markdown", str(tmp_path / "s.md")]) == 0
    report = json.loads(out_json.read_text())
    assert set(report["algos"]) == {"speculative", "speculative-chain", "speculative-adaptive", "speculative-copy",
                                    "speculative-confident", "speculative-copy-confident", "prompt-lookup", "lookahead",
                                    "medusa", "medusa-copy", "medusa-lossless", "medusa-typical"}
    for row in report["prompts"]:
        for name, result in row["algos"].items():
            # the sampled Medusa rows show what lossless and typical acceptance buy; they are not greedy
            sampled = name in ("medusa-lossless", "medusa-typical")
            assert result["same_tokens_as_ar"] is (None if sampled else True), name
    spec = report["prompts"][0]["algos"]["speculative"]
    assert spec["acceptance_rate"] == 1.0  # the target drafting for itself
    assert spec["peer"]["tokens"] >= 1 and spec["ratio_vs_peer"] > 0
    adaptive = report["prompts"][0]["algos"]["speculative-adaptive"]
    assert adaptive["peer"]["tokens"] >= 1 and adaptive["predicted_tokens_per_forward"] > 1
    assert report["algos"]["speculative-adaptive"]["peer"] == "assisted generation (heuristic_transient)"
    # the chain-only row meets the same peer run; whether the default row has a sibling depends on the machine
    assert "chain only" in report["algos"]["speculative-chain"]["setting"]
    assert report["prompts"][0]["algos"]["speculative-chain"]["peer"] == spec["peer"]
    # as long as one pass of the CPU kernel's rows allows: 5 tokens with AVX2, 8 with AVX-512
    length = SpeculativeParams(copy_ngram=3).resolve(target.model.rows_per_pass, greedy=True).copy_tokens
    assert f"copies of up to {length} tokens after a 3..1-gram match" in report["algos"]["speculative-copy"]["setting"]
    assert report["prompts"][2]["category"] == "code editing"
    assert report["prompts"][2]["algos"]["speculative-copy"]["peer"]["tokens"] >= 1
    assert "stops after a token of draft probability below 0.5" in report["algos"]["speculative-confident"]["setting"]
    assert report["prompts"][0]["algos"]["speculative-confident"]["peer"]["tokens"] >= 1
    both = report["algos"]["speculative-copy-confident"]["setting"]
    assert f"copies of up to {length} tokens" in both and "below 0.5" in both
    for row in report["prompts"]:
        # transformers has no copies: a copying row's peer is its copy-free row's, run once and shared
        for copying, plain in (("speculative-copy", "speculative"),
                               ("speculative-copy-confident", "speculative-confident")):
            assert row["algos"][copying]["peer"] == row["algos"][plain]["peer"]
        assert row["algos"]["speculative"]["peer"] != row["algos"]["speculative-confident"]["peer"]
    assert report["prompts"][0]["algos"]["prompt-lookup"]["peer"]["tokens"] >= 1
    assert "peer" not in report["prompts"][0]["algos"]["lookahead"]  # transformers has no lookahead decoding
    # same model, so about one on a quiet machine; a timing, so only its presence is checked (the CI machine is shared)
    assert report["algos"]["speculative"]["draft_cost_ratio"] > 0
    summary = report["summary"]["algos"]
    assert "median_speedup_vs_ar_grounded" in summary["prompt-lookup"]
    assert summary["prompt-lookup"]["copy_bound_median_tokens_per_forward_grounded"] >= 1
    for row in report["prompts"]:
        lookup = row["algos"]["prompt-lookup"]
        # no proposer copying one span per step commits more per forward than the best copy every step
        assert lookup["copy_bound"]["tokens_per_forward"] >= lookup["mean_accepted_tokens"] - 1e-9
        assert lookup["copy_bound"]["speedup_vs_ar"] >= 1
    assert report["algos"]["prompt-lookup"]["verify_cost_ratio"] > 0
    assert 2 <= report["algos"]["prompt-lookup"]["verify_tokens"] <= 9
    for row in report["prompts"]:
        assert all(result["step_cost"] > 0 for result in row["algos"].values())
    assert all(entry["median_step_cost"] > 0 for entry in summary.values())
    text = (tmp_path / "s.md").read_text()
    assert "## speculative" in text and "## prompt-lookup" in text and "(goal >= 1.3)" in text
    # the dynamic tree takes what one pass of the kernel's rows has beside the last token (at most 5), every step
    rows = target.model.rows_per_pass
    nodes = dynamic_nodes(rows, gpu=False)
    assert f"## medusa (tree dynamic ({nodes} nodes)" in text and "typical acceptance (LOSSY)" in text
    assert (f"## medusa-copy (tree dynamic ({nodes} nodes), heads medusa-smollm2-135m, copies of up to 8 tokens after "
            "a 3..1-gram match grafted on, ranked among the tree's nodes") in text
    assert "n/a (sampled)" in text
    assert report["algos"]["medusa"]["verify_cost_ratio"] > 0
    assert report["algos"]["medusa"]["verify_tokens"] == nodes + 1
    assert "Costs come from the runs themselves" in text and "step cost (plain steps)" in text


def test_bench_times_the_chain_once_where_the_default_verifies_no_sibling(tmp_path, target, monkeypatch) -> None:
    from playground.models.transformer import Transformer

    # no pass of the CPU kernel's rows, as on a GPU: the default row resolves to the chain alone
    monkeypatch.setattr(Transformer, "rows_per_pass", property(lambda self: None))
    out_json = tmp_path / "g.json"
    assert main(["bench", "--limit", "1", "--max-new-tokens", "3", "--device", "cpu", "--algos", "speculative",
                 "--draft", "embedded", "--no-peers", "--json", str(out_json), "--markdown", str(tmp_path / "g.md")]) == 0
    algos = json.loads(out_json.read_text())["algos"]
    assert "chain only" in algos["speculative"]["setting"]
    assert "speculative-chain" not in algos
    assert {"speculative-adaptive", "speculative-copy", "speculative-confident", "speculative-copy-confident"} <= set(algos)


def test_costs_are_medians_of_the_runs_forwards_in_plain_forwards() -> None:
    costs = Costs(verify=[(1, 0.03), (5, 0.04), (9, 0.05), (9, 0.06)], draft=[0.002, 0.003, 0.004])
    # one-token forwards (a step that proposed nothing) are left out of the verify cost
    assert costs.ratios(0.02) == pytest.approx({"verify_cost_ratio": 2.5, "verify_tokens": 9, "draft_cost_ratio": 0.15})
    assert Costs(verify=[(1, 0.03)]).ratios(0.02) == {}


def test_bench_rejects_unknown_algorithms(capsys) -> None:
    assert main(["bench", "--algos", "speculative,medusa-ish"]) == 2
    assert "algos: unknown medusa-ish" in capsys.readouterr().err
