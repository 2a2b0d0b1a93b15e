"""The benchmark harness runs end to end on a tiny budget and writes its JSON and markdown."""

from __future__ import annotations

import json

from playground.__main__ import main


def test_bench_writes_report(tmp_path, target) -> None:
    out_json, out_md = tmp_path / "b.json", tmp_path / "b.md"
    assert main(["bench", "--limit", "2", "--max-new-tokens", "4", "--device", "cpu", "--draft", "none",
                 "--json", str(out_json), "--markdown", str(out_md)]) == 0
    report = json.loads(out_json.read_text())
    assert len(report["prompts"]) == 2
    row = report["prompts"][0]
    assert row["ar"]["tokens"] >= 1 and row["hf"]["tokens"] >= 1 and row["same_tokens"] is True
    assert report["bandwidth"]["copy_gb_per_s"] > 0 and report["bandwidth"]["bound_tokens_per_s"] > 0
    assert 0 < report["summary"]["fraction_of_bound"]
    assert report["summary"]["median_ratio_vs_hf"] > 0
    assert "memory-bandwidth bound" in out_md.read_text()
    assert "speculative" not in report


def test_bench_rejects_bad_limit(capsys) -> None:
    assert main(["bench", "--limit", "0"]) == 2
    assert "limit must be an integer in [1, 14]" in capsys.readouterr().err


def test_bench_with_a_draft_adds_speculative_and_assisted_generation(tmp_path, target) -> None:
    out_json = tmp_path / "s.json"
    assert main(["bench", "--limit", "1", "--max-new-tokens", "6", "--device", "cpu", "--draft", "embedded",
                 "--gamma", "2", "--json", str(out_json), "--markdown", str(tmp_path / "s.md")]) == 0
    report = json.loads(out_json.read_text())
    row = report["prompts"][0]
    assert row["spec_same_tokens"] is True
    assert row["speculative"]["acceptance_rate"] == 1.0  # the target drafting for itself
    assert row["hf_assisted"]["tokens"] >= 1 and row["ratio_vs_hf_assisted"] > 0
    assert 0.5 < report["speculative"]["draft_cost_ratio"] < 2.0  # same model: about one
    assert "Speculative decoding" in (tmp_path / "s.md").read_text()
