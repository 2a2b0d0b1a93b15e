"""Draft training: the pipeline runs end to end on a tiny budget, and the shipped draft meets its contract."""

from __future__ import annotations

import json

import torch
from transformers import AutoModelForCausalLM

from playground.config import ModelSpec
from playground.decoding.speculative import check_compatible
from playground.models import load_model
from playground.models.loader import EMBEDDED_DRAFT, default_draft
from playground.train.__main__ import main
from playground.train.draft import batches


def test_training_pipeline_smoke(tmp_path, target) -> None:
    out = tmp_path / "draft"
    assert main(["draft", "--limit", "2", "--epochs", "1", "--answer-tokens", "8", "--hidden", "32",
                 "--layers", "1", "--eval-prompts", "1", "--out", str(out)]) == 0
    report = json.loads((out / "train_report.json").read_text())
    assert report["train_prompts"] == 2 and report["layers"] == 1
    assert 0 <= report["held_out_greedy_acceptance"] <= 1 and report["draft_target_cost_ratio"] > 0
    draft = load_model(ModelSpec(source=str(out), device="cpu"))
    check_compatible(target, draft)
    assert AutoModelForCausalLM.from_pretrained(out).config.num_hidden_layers == 1


def test_batches_label_answer_tokens_in_place() -> None:
    """transformers shifts labels inside its loss, so label t must be token t itself (answer positions only)."""
    corpus = [([5, 6, 7, 8, 9], 3), ([4, 3, 2], 1)]
    ids, labels = next(batches(corpus, 4, torch.Generator().manual_seed(0), pad=0))
    rows = {tuple(i): tuple(l) for i, l in zip(ids.tolist(), labels.tolist())}
    assert rows[(5, 6, 7, 8, 9)] == (-100, -100, -100, 8, 9)
    assert rows[(4, 3, 2, 0, 0)] == (-100, 3, 2, -100, -100)


def test_bad_training_arguments_are_refused(capsys) -> None:
    assert main(["draft", "--epochs", "0"]) == 2
    assert "epochs must be an integer in [1, 100]" in capsys.readouterr().err


def test_shipped_draft_contract(target) -> None:
    assert default_draft("embedded") == str(EMBEDDED_DRAFT)
    assert default_draft("some/other-model") is None
    size = sum(f.stat().st_size for f in EMBEDDED_DRAFT.glob("*.safetensors"))
    assert size <= 30 * 2**20
    draft = load_model(ModelSpec(source=str(EMBEDDED_DRAFT), device="cpu"))
    check_compatible(target, draft)
    reference = AutoModelForCausalLM.from_pretrained(EMBEDDED_DRAFT, dtype=torch.float32)  # usable as assistant
    assert reference.config.vocab_size == target.model.config.vocab_size
    report = json.loads((EMBEDDED_DRAFT / "train_report.json").read_text())
    assert {"held_out_greedy_acceptance", "draft_target_cost_ratio", "seed"} <= set(report)
