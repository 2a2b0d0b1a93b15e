"""Draft and Medusa training: the pipelines run end to end on a tiny budget, examples are aligned, and the
shipped draft and heads meet their contracts."""

from __future__ import annotations

import argparse
import json
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from playground.bench.suite import SUITE
from playground.config import ConfigError, ModelSpec
from playground.decoding.speculative import check_compatible
from playground.models import load_model
from playground.models.answers import ANSWERS, EMBEDDED_ANSWERS, load_answers
from playground.models.loader import EMBEDDED_DRAFT, default_draft
from playground.models.medusa import EMBEDDED_MEDUSA, default_heads, load_heads
from playground.models.vocab import PROPOSAL_VOCAB, VOCAB_IDS, proposal_rows
from playground.train import draft as draft_module
from playground.train import medusa as medusa_module
from playground.train import ngrams as ngrams_module
from playground.train.__main__ import main
from playground.train.draft import (
    Corpus,
    answer_ids,
    batches,
    distillation_loss,
    frequent_vocabulary,
    generate_corpus,
    load_or_generate_corpus,
    one_cycle,
    two_stage_corpus,
)
from playground.train.medusa import head_examples
from playground.train.ngrams import sample_prompts
from playground.train.prompts import (
    CODE_TEMPLATES,
    EXTRA_TEMPLATES,
    HELD_OUT_TOPICS,
    TEMPLATES,
    TRAIN_TOPICS,
    WIDE_TOPICS,
    held_out_prompts,
    maths_prompt,
    second_stage_prompts,
    training_prompts,
)


def test_training_pipeline_smoke(tmp_path, target, capsys) -> None:
    out, corpus = tmp_path / "draft", tmp_path / "corpus.safetensors"
    small = ["draft", "--limit", "2", "--epochs", "1", "--hidden", "32", "--layers", "1", "--eval-prompts", "1",
             "--out", str(out), "--corpus", str(corpus)]
    assert main(small + ["--answer-tokens", "8", "--generate-batch", "1"]) == 0
    assert Corpus.load(corpus).answer_tokens() <= 2 * 8
    report = json.loads((out / "train_report.json").read_text())
    assert report["first_stage_prompts"] == 2 and report["train_prompts"] >= 2 and report["layers"] == 1
    assert 0 <= report["held_out_token_acceptance"] <= 1 and report["draft_target_cost_ratio"] > 0
    draft = load_model(ModelSpec(source=str(out), device="cpu"))
    check_compatible(target, draft)
    assert AutoModelForCausalLM.from_pretrained(out).config.num_hidden_layers == 1
    # the draft proposes from the 8192 tokens the corpus ranks first, which our engine reads beside its weights
    proposal = load_file(out / PROPOSAL_VOCAB)[VOCAB_IDS]
    assert len(proposal) == report["proposal_vocab"] == 8192
    assert set(answer_ids(Corpus.load(corpus)).tolist()) <= set(proposal.tolist())
    # the cached corpus is reused only for the settings that made it; the whole vocabulary writes no file
    assert main(small + ["--answer-tokens", "8", "--weights-dtype", "float16", "--proposal-vocab", "49152"]) == 0
    assert "reusing the corpus" in capsys.readouterr().err and not (out / PROPOSAL_VOCAB).exists()
    assert main(small + ["--answer-tokens", "8", "--proposal-vocab", "0"]) == 2
    assert "proposal_vocab must be an integer in [1, 49152]" in capsys.readouterr().err
    assert main(small + ["--answer-tokens", "9"]) == 2
    assert "corpus:" in capsys.readouterr().err


def test_batches_pair_each_answer_token_with_the_position_that_predicts_it() -> None:
    """Answer token j of a sequence is scored at the position before it, against its own soft-label row."""
    answers = [8, 9, 3, 2]  # the greedy (top-1) tokens, in corpus order
    topk = torch.tensor([[a, 0] for a in answers])
    corpus = Corpus([[5, 6, 7, 8, 9], [4, 3, 2]], [3, 1], topk, torch.zeros(4, 2))
    ids, (rows, columns), labels = next(batches(corpus, 4, torch.Generator().manual_seed(0), pad=0))
    assert sorted(labels.tolist()) == [0, 1, 2, 3]
    assert ids[rows, columns + 1].tolist() == topk[labels, 0].tolist()
    by_label = dict(zip(labels.tolist(), columns.tolist()))
    assert by_label == {0: 2, 1: 3, 2: 0, 3: 1}


def test_corpus_round_trips_through_safetensors(tmp_path) -> None:
    corpus = Corpus([[1, 2, 3], [4, 5]], [1, 1], torch.arange(6).view(3, 2), torch.rand(3, 2))
    corpus.save(tmp_path / "c.safetensors", {"model": "x"})
    again = Corpus.load(tmp_path / "c.safetensors")
    assert again.sequences == corpus.sequences and again.answer_starts == corpus.answer_starts
    assert torch.equal(again.topk_ids, corpus.topk_ids) and torch.equal(again.topk_logprobs, corpus.topk_logprobs)


def test_distillation_loss_is_lowest_when_the_draft_matches_the_target() -> None:
    target_logprobs = torch.tensor([[-0.1, -2.5, -4.0]])  # top-k of the target, best first
    topk_ids = torch.tensor([[2, 0, 1]])
    matching = torch.full((1, 5), -30.0)
    matching[0, topk_ids[0]] = target_logprobs[0]
    wrong = matching.clone()
    wrong[0, 2], wrong[0, 4] = -6.0, 0.0  # the draft prefers a token the target never ranked
    assert distillation_loss(matching, topk_ids, target_logprobs) < distillation_loss(wrong, topk_ids, target_logprobs)


def test_distillation_loss_over_a_reduced_vocabulary_ignores_ids_outside_it() -> None:
    """Soft labels outside the covered ids (-1) neither count nor break the loss."""
    logits = torch.tensor([[0.5, -1.0, 2.0], [1.0, 0.0, -1.0]])  # (N=2, V'=3)
    ids = torch.tensor([[2, -1], [-1, -1]])  # row 1 lies wholly outside the vocabulary
    logprobs = torch.tensor([[-0.2, -1.8], [-0.5, -1.0]])
    loss = distillation_loss(logits, ids, logprobs)
    assert torch.isfinite(loss)
    moved = logprobs.clone()
    moved[0, 1] = 5.0  # an alternative outside the vocabulary, now the target's favourite: ignored all the same
    assert torch.equal(loss, distillation_loss(logits, ids, moved))
    expected = -logits.log_softmax(-1)[0, 2] / 2  # row 0: hard and soft terms both on token 2; row 1 adds nothing
    torch.testing.assert_close(loss, expected)


def test_frequent_vocabulary_ranks_answers_then_alternatives_then_low_ids() -> None:
    # answers 7, 7, 3 (7 most frequent); alternatives add 5 (twice) and 9 (once) beside the answers
    corpus = Corpus([[1, 7, 7, 3]], [1], torch.tensor([[7, 5], [7, 9], [3, 5]]), torch.zeros(3, 2))
    assert frequent_vocabulary(corpus, 2, 12).tolist() == [3, 7]
    assert frequent_vocabulary(corpus, 3, 12).tolist() == [3, 5, 7]
    assert frequent_vocabulary(corpus, 6, 12).tolist() == [0, 1, 3, 5, 7, 9]  # then the lowest unused ids, 0 and 1
    assert frequent_vocabulary(corpus, 12, 12).tolist() == list(range(12))


def test_second_stage_prompts_ground_tasks_in_first_stage_answers() -> None:
    prompts = training_prompts()
    story = "Mina found a map in the attic. It showed a river that no longer exists! She decided to look"
    code = "```python\ndef area(r):\n    return 3.14 * r * r\n```\nThis computes a circle's area."
    answers = [code if "Python function" in p else story for p in prompts]
    second = second_stage_prompts(prompts, answers)
    assert second == second_stage_prompts(prompts, answers)  # deterministic
    grounded = [p for p in second if "Mina found a map" in p or code[:20] in p]
    assert len(grounded) == len(prompts) // 4 and len(second) == len(grounded) + 105
    # the answer is cut after its last complete sentence; code answers get a code-editing task
    assert any(p.endswith("no longer exists!") for p in grounded) and not any("She decided" in p for p in grounded)
    assert all(any(p.startswith(t.split("{")[0]) for t in CODE_TEMPLATES) for p in grounded if code[:20] in p)
    assert any(p.startswith("Translate into French: 'Mina found a map in the attic.'") for p in grounded)
    assert maths_prompt(3) == maths_prompt(3) and maths_prompt(4) is None
    # too short to ground a task on: skipped
    assert second_stage_prompts(prompts[:2], ["Yes.", "Short."]) == []
    # nothing the benchmark or the held-out report asks is ever trained on
    suite = {p for _, p in SUITE}
    assert not (set(prompts) | set(second)) & (suite | set(held_out_prompts()))


def test_two_stage_corpus_appends_answers_to_prompts_built_on_the_first_answers(monkeypatch) -> None:
    asked = []

    def answer(target, prompts, answer_tokens, dtype, batch):  # stands in for the target: one answer token per prompt
        asked.append(list(prompts))
        assert batch == 3
        n = len(prompts)
        return Corpus([[0, 5 + i] for i in range(n)], [1] * n, torch.full((n, 2), 5), torch.zeros(n, 2))

    text = "The river runs south to the sea. Boats carry grain along it."
    tokenizer = SimpleNamespace(decode=lambda ids, skip_special_tokens: text)
    monkeypatch.setattr(draft_module, "generate_corpus", answer)
    prompts = training_prompts()[:8]
    corpus = two_stage_corpus(SimpleNamespace(tokenizer=tokenizer), prompts, 8, "float32", batch=3)
    assert asked[0] == prompts and asked[1] == second_stage_prompts(prompts, [text] * 8)
    assert len(asked[1]) == 3  # prompts 1 and 5 grounded on their answers, a word problem at 3
    assert len(corpus.sequences) == len(corpus.answer_starts) == len(corpus.topk_ids) == 11


def schedule_rates(total: int, warmup: float, reference: bool = False) -> list[float]:
    optimizer = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))], lr=1e-3)
    schedule = (torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=1e-3, total_steps=total, pct_start=warmup)
                if reference else one_cycle(optimizer, 1e-3, total, warmup))
    rates = []
    for _ in range(total):
        rates.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        schedule.step()
    return rates


def test_one_cycle_runs_any_number_of_steps_and_keeps_pytorchs_schedule_otherwise() -> None:
    # PyTorch's OneCycleLR divides by zero at exactly one warmup step: 10 steps at 0.1 (the draft), 20 at 0.05
    for warmup in (0.1, 0.05):
        for total in range(1, 45):
            rates = schedule_rates(total, warmup)
            assert len(rates) == total and max(rates) <= 1e-3
    assert max(schedule_rates(10, 0.1)) == 1e-3  # warmed up over two steps to the peak
    for total, warmup in ((100, 0.1), (37, 0.05)):
        assert schedule_rates(total, warmup) == schedule_rates(total, warmup, reference=True)


def test_bad_training_arguments_are_refused(capsys) -> None:
    assert main(["draft", "--epochs", "0"]) == 2
    assert "epochs must be an integer in [1, 100]" in capsys.readouterr().err
    assert main(["draft", "--generate-batch", "0"]) == 2
    assert "generate_batch must be an integer in [1, 512], got 0" in capsys.readouterr().err
    assert main(["draft", "--extra-templates", str(len(EXTRA_TEMPLATES) + 1)]) == 2
    assert f"extra_templates must be an integer in [0, {len(EXTRA_TEMPLATES)}]" in capsys.readouterr().err
    assert main(["medusa", "--wide-topics", "-1"]) == 2
    assert f"wide_topics must be an integer in [0, {len(WIDE_TOPICS)}], got -1" in capsys.readouterr().err
    assert main(["draft", "--templates-per-wide-topic", "0"]) == 2
    assert "templates_per_wide_topic must be an integer in [1, 48], got 0" in capsys.readouterr().err


def test_an_output_folder_that_cannot_be_one_is_refused_before_any_work(tmp_path, capsys) -> None:
    """A file where the folder should be, or a folder under a file: one line at once, not minutes later."""
    taken = tmp_path / "taken"
    taken.write_text("a file")
    for command in ("draft", "medusa", "eagle", "ngrams", "layerskip"):
        for out, message in ((taken, "is a file, not a folder"), (taken / "sub", "taken is a file, not a folder")):
            assert main([command, "--out", str(out)]) == 2, command
            err = capsys.readouterr().err  # one line, nothing before it: no model loaded, no corpus generated
            assert err.startswith("error: out: ") and message in err and len(err.splitlines()) == 1, err


def test_extra_templates_are_a_seeded_sample_per_topic_after_every_base_prompt() -> None:
    base = training_prompts()
    assert len(base) == len(TEMPLATES) * len(TRAIN_TOPICS)
    wider = training_prompts(5, seed=0)
    assert wider[: len(base)] == base and len(wider) == len(base) + 5 * len(TRAIN_TOPICS)
    assert wider == training_prompts(5, seed=0) and wider != training_prompts(5, seed=1)
    extra = wider[len(base):]
    for i, topic in enumerate(TRAIN_TOPICS):  # five distinct extra templates, each about its topic
        mine = extra[5 * i : 5 * i + 5]
        assert len(set(mine)) == 5 and all(topic in p for p in mine)
    # every extra template is used for some topic at the shipped setting, and none is a suite or held-out prompt
    shipped = training_prompts(10)
    assert all(set(shipped) & {t.format(topic=topic) for topic in TRAIN_TOPICS} for t in EXTRA_TEMPLATES)
    assert not set(shipped) & ({p for _, p in SUITE} | set(held_out_prompts()))


def test_wide_topics_follow_the_other_prompts_with_a_seeded_sample_of_all_templates() -> None:
    shipped = training_prompts(10)
    wide = training_prompts(10, seed=0, wide_topics=5, templates_per_wide_topic=4)
    assert wide[: len(shipped)] == shipped and len(wide) == len(shipped) + 5 * 4
    assert wide == training_prompts(10, 0, 5, 4) and wide != training_prompts(10, 1, 5, 4)
    templates = set(TEMPLATES + EXTRA_TEMPLATES)
    for i, topic in enumerate(WIDE_TOPICS[:5]):
        mine = wide[len(shipped) + 4 * i : len(shipped) + 4 * i + 4]
        assert len(set(mine)) == 4 and all(any(t.format(topic=topic) == p for t in templates) for p in mine)
    # new subjects only: none trained on before, held out, or asked by the benchmark
    assert len(set(WIDE_TOPICS)) == len(WIDE_TOPICS) and not set(WIDE_TOPICS) & set(TRAIN_TOPICS + HELD_OUT_TOPICS)
    every = training_prompts(24, 0, len(WIDE_TOPICS), len(templates))
    assert not set(every) & ({p for _, p in SUITE} | set(held_out_prompts()))


class FakePeer:
    """Stands in for the transformers peer: answers each row with its last prompt token + 100, then, for rows whose
    last token is even, end-of-sequence and padding; records every batch it is given."""

    def __init__(self) -> None:
        self.batches: list[list[list[int]]] = []

    def to(self, dtype):
        return self

    def generate(self, ids, attention_mask, max_new_tokens, logits_processor, **_):
        self.batches.append([row[mask.bool()].tolist() for row, mask in zip(ids, attention_mask)])
        last = ids[:, -1]  # (B,): left padding puts every prompt's last token in the last column
        answers = torch.stack([last + 100, torch.where(last % 2 == 0, 2, last + 101), last * 0 + 2], 1)  # (B, 3)
        for step in range(3):
            logits_processor[0](None, F.one_hot(answers[:, step], 400).float())  # (B, V)
        return torch.cat((ids, answers), 1)


def test_generate_corpus_batches_prompts_by_length_and_keeps_their_order(monkeypatch, capsys) -> None:
    peer = FakePeer()
    monkeypatch.setattr("playground.models.loader.load_hf_peer", lambda target: peer)
    monkeypatch.setattr("playground.decoding.encode_prompt", lambda target, prompt, generation: json.loads(prompt))
    prompts = [[5, 6, 7, 8], [9], [10, 11], [12, 13, 14, 15, 16, 17], [18], [19, 20, 21]]
    corpus = generate_corpus(SimpleNamespace(eos_token_ids=(2,)), [json.dumps(p) for p in prompts], 3, "float32",
                             batch=2)
    assert peer.batches == [[[9], [18]], [[10, 11], [19, 20, 21]], [[5, 6, 7, 8], [12, 13, 14, 15, 16, 17]]]
    # in the prompts' order: an even last token ends at end-of-sequence, padding dropped; an odd one runs to 3
    assert corpus.sequences == [p + ([p[-1] + 100, 2] if p[-1] % 2 == 0 else [p[-1] + 100, p[-1] + 101, 2])
                                for p in prompts]
    assert corpus.answer_starts == [len(p) for p in prompts]
    assert corpus.topk_ids[:, 0].tolist() == answer_ids(corpus).tolist()  # soft labels follow their tokens
    # its progress names the corpus, which every trainer shares, not one trainer
    assert capsys.readouterr().err.splitlines()[-1].startswith("[train corpus] target answered 6/6 prompts, 16 tokens")


def test_a_cached_corpus_is_refused_for_other_prompts_of_the_same_number(tmp_path, monkeypatch) -> None:
    made = Corpus([[1, 5]], [1], torch.zeros(1, 2, dtype=torch.int64), torch.zeros(1, 2))
    monkeypatch.setattr(draft_module, "two_stage_corpus", lambda *args: made)
    args = SimpleNamespace(model="embedded", answer_tokens=8, corpus=str(tmp_path / "c.safetensors"),
                           generate_batch=4, corpus_dir=None)
    assert load_or_generate_corpus(None, ["a", "b"], args, "float32")[0] is made
    assert load_or_generate_corpus(None, ["a", "b"], args, "float32")[0].sequences == [[1, 5]]  # reused
    with pytest.raises(ConfigError, match="prompts_sha256"):
        load_or_generate_corpus(None, ["a", "c"], args, "float32")


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
    keys = {"held_out_token_acceptance", "held_out_accepted_per_drafted", "draft_target_cost_ratio", "seed"}
    assert keys <= set(report)
    assert len(proposal_rows(draft)) == report["proposal_vocab"] == 8192
    assert report["size_mb"] <= 30 and report["corpus_generation_s"] + report["wall_s_this_run"] <= 45 * 60


def shipped_settings_match_defaults(add_args, report: dict, keys: tuple[str, ...]) -> None:
    """The trainer's defaults reproduce the shipped asset: its report records the settings it was trained with."""
    parser = argparse.ArgumentParser()
    add_args(parser)
    defaults = vars(parser.parse_args([]))
    assert {key: defaults[key] for key in keys} == {key: report[key] for key in keys}
    assert defaults["extra_templates"] == report["extra_templates_per_topic"]


def test_draft_trainer_defaults_reproduce_the_shipped_draft() -> None:
    report = json.loads((EMBEDDED_DRAFT / "train_report.json").read_text())
    shipped_settings_match_defaults(draft_module.add_args, report, (
        "epochs", "lr", "wide_topics", "templates_per_wide_topic", "dtype", "weights_dtype", "seed", "hidden",
        "layers", "proposal_vocab"))


def test_medusa_trainer_defaults_reproduce_the_shipped_heads() -> None:
    report = json.loads((EMBEDDED_MEDUSA / "train_report.json").read_text())
    shipped_settings_match_defaults(medusa_module.add_args, report, (
        "epochs", "lr", "batch", "dtype", "weights_dtype", "seed"))


def test_medusa_training_pipeline_smoke(tmp_path, target, capsys) -> None:
    out = tmp_path / "heads"
    small = ["medusa", "--limit", "2", "--answer-tokens", "8", "--batch", "8", "--out", str(out)]
    assert main(small + ["--head-vocab", "300"]) == 0
    report = json.loads((out / "train_report.json").read_text())
    assert [h["predicts"] for h in report["heads"]] == ["t+2", "t+3", "t+4", "t+5"]
    assert all(0 <= h["top1"] <= h["top5"] <= 1 for h in report["heads"]) and report["first_stage_prompts"] == 2
    assert report["head_vocab_size"] == 300 and 0 < report["held_out_answers_in_head_vocab"] < 1
    heads = load_heads(str(out), target)
    assert heads.heads.num_heads == 4 and heads.vocab_size == 300
    for bad in ("0", "49153"):
        assert main(small + ["--head-vocab", bad]) == 2
        assert "head_vocab must be an integer in [1, 49152]" in capsys.readouterr().err


def test_medusa_examples_pair_each_state_with_the_token_its_head_predicts() -> None:
    """Two sequences with 3 and 4 answer tokens: state i (the position predicting answer token i) trains head k
    on answer token i + k + 1, never across a sequence boundary."""
    rows, labels = head_examples([3, 4], 0)
    assert rows.tolist() == [0, 1, 3, 4, 5] and labels.tolist() == [1, 2, 4, 5, 6]
    rows, labels = head_examples([3, 4], 2)
    assert rows.tolist() == [3] and labels.tolist() == [6]


def test_medusa_next_token_ids_follow_the_hidden_state_rows() -> None:
    """Row i of the hidden states predicted answer token i; the heads read that token's embedding."""
    corpus = Corpus([[1, 2, 3, 4], [5, 6, 7]], [2, 1], torch.zeros(4, 2, dtype=torch.long), torch.zeros(4, 2))
    assert answer_ids(corpus).tolist() == [3, 4, 6, 7]


def test_shipped_medusa_heads_contract(target) -> None:
    assert default_heads("embedded") == str(EMBEDDED_MEDUSA) and default_heads("some/other-model") is None
    assert (EMBEDDED_MEDUSA / "medusa.safetensors").stat().st_size <= 30 * 2**20
    report = json.loads((EMBEDDED_MEDUSA / "train_report.json").read_text())
    assert [h["head"] for h in report["heads"]] == [0, 1, 2, 3] and report["heads"][0]["top5"] > 0.5
    assert report["corpus_generation_s"] + report["wall_s_this_run"] <= 45 * 60
    shipped = load_heads(None, target)
    assert shipped.heads.num_heads == 4 and shipped.vocab_size == report["head_vocab_size"] == 8192


def test_ngrams_writer_saves_the_targets_answers_for_lookahead(tmp_path, target, capsys) -> None:
    out = tmp_path / "ngrams"
    small = ["ngrams", "--prompts", "2", "--answer-tokens", "8", "--generate-batch", "2", "--out", str(out)]
    assert main(small) == 0
    report = json.loads((out / "report.json").read_text())
    answers = load_answers(str(out / ANSWERS), target.model.config.vocab_size)
    assert len(answers) == report["prompts"] == 2 and 0 < sum(map(len, answers)) == report["tokens"] <= 16
    # the same seed samples the same prompts, none of them the benchmark's
    assert sample_prompts(2, 0) == sample_prompts(2, 0) != sample_prompts(2, 1)
    assert not set(sample_prompts(1024, 0)) & {prompt for _, prompt in SUITE}
    assert main(["ngrams", "--prompts", "0", "--out", str(out)]) == 2
    assert "prompts must be an integer in [1, " in capsys.readouterr().err


def test_ngrams_writer_defaults_reproduce_the_shipped_answers(target) -> None:
    report = json.loads((EMBEDDED_ANSWERS.parent / "report.json").read_text())
    parser = argparse.ArgumentParser()
    ngrams_module.add_args(parser)
    defaults = vars(parser.parse_args([]))
    assert {k: defaults[k] for k in ("prompts", "answer_tokens", "dtype", "generate_batch", "seed")} == {
        k: report[k] for k in ("prompts", "answer_tokens", "dtype", "generate_batch", "seed")}
    assert sum(map(len, load_answers(str(EMBEDDED_ANSWERS), target.model.config.vocab_size))) == report["tokens"]
