"""The corpus at scale (`python -m playground.train corpus`): its prompts, its split and its resumable shards."""

from __future__ import annotations

import ast
import json
import re
from argparse import Namespace
from collections import Counter
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from playground.bench.suite import SUITE
from playground.config import ConfigError
from playground.train import corpus
from playground.train.__main__ import main as train_main

ROOT = Path(__file__).resolve().parent.parent


def notebook_strings() -> set[str]:
    """Every string literal of 20 characters or more in the notebooks' code cells: their prompts among them."""
    found = set()
    for path in (ROOT / "notebooks").glob("*.ipynb"):
        for cell in json.loads(path.read_text())["cells"]:
            if cell["cell_type"] != "code":
                continue
            source = "".join(cell["source"])
            source = "\n".join(line for line in source.splitlines() if not line.lstrip().startswith(("%", "!")))
            found |= {node.value for node in ast.walk(ast.parse(source))
                      if isinstance(node, ast.Constant) and isinstance(node.value, str) and len(node.value) >= 20}
    return found


def test_the_prompts_are_many_varied_new_and_split_by_group() -> None:
    train, held = corpus.asks(0)
    assert len(train) > 25_000 and 0.02 < len(held) / (len(train) + len(held)) < 0.08
    assert set(Counter(a.kind for a in train)) == set(Counter(a.kind for a in held)) == {"task", "format", "code",
                                                                                           "maths"}
    assert not {a.group for a in train} & {a.group for a in held}  # no held-out topic, task or problem is trained on
    assert corpus.asks(0) == (train, held) and corpus.asks(1)[0] != train  # the seed alone decides the order
    texts = {a.text for a in train + held}
    assert len(texts) == len(train) + len(held)
    # never the benchmark's prompts, nor the notebooks'
    avoid = {p for _, p in SUITE} | notebook_strings()
    assert len(avoid) > len(SUITE)
    assert not texts & avoid
    assert not [p for p in avoid if any(p in t for t in texts) and len(p) > 40]


def test_half_the_answers_are_sampled_each_with_a_seed_of_its_own() -> None:
    texts = [a.text for a in corpus.asks(0)[0][:2000]]
    sampled = [corpus.sampling_for(t, 0) for t in texts]
    share = sum(not s.greedy for s in sampled) / len(sampled)
    assert 0.45 < share < 0.55
    assert len({s.seed for s in sampled if not s.greedy}) > 0.99 * sum(not s.greedy for s in sampled)
    assert [corpus.sampling_for(t, 0) for t in texts] == sampled


def test_a_second_turn_grounds_a_task_in_an_answer_or_follows_up_on_it() -> None:
    ask = corpus.Ask("task", "owls", "Write a short paragraph about owls.")
    answer = "Owls hunt at night. They have very good hearing and can turn their heads far around."
    turns = [corpus.second_turn(i, ask, answer, ["Make it shorter."]) for i in range(8)]
    assert [t and t[0] for t in turns] == [
        "grounded", None, "follow-up", None, "grounded", None, "follow-up", None]
    assert "Owls hunt at night." in turns[0][1][0]["content"] and len(turns[0][1]) == 1
    assert [m["role"] for m in turns[2][1]] == ["user", "assistant", "user"]
    assert turns[2][1][1]["content"] == answer and turns[2][1][2]["content"] == "Make it shorter."
    assert corpus.second_turn(0, ask, "  ", ["Make it shorter."]) is None


def run(out: Path, **changes) -> None:
    args = Namespace(model="embedded", weights="auto", out=str(out), tokens=1000, answer_tokens=8, shard_prompts=8,
                     batch=8, seed=0)
    for key, value in changes.items():
        setattr(args, key, value)
    corpus.main(args)


def test_shards_are_written_once_resumed_and_refused_when_made_otherwise(tmp_path, capsys) -> None:
    out = tmp_path / "corpus"
    run(out, tokens=1000)
    names = sorted(p.name for p in out.glob("*.safetensors"))
    assert names[0] == "held-out-00000.safetensors" and names[1:] == [f"train-{i:05d}.safetensors"
                                                                        for i in range(len(names) - 1)]
    summary = json.loads((out / "corpus.json").read_text())
    assert summary["train"]["answer_tokens"] >= 1000 and summary["held-out"]["shards"] == 1
    shard = load_file(str(out / names[1]))
    lengths, starts = shard["lengths"].long(), shard["answer_starts"].long()
    assert int(lengths.sum()) == len(shard["tokens"]) and bool((starts < lengths).all())
    kinds = [corpus.KINDS[k] for k in shard["kinds"].tolist()]
    assert kinds.count("grounded") + kinds.count("follow-up") > 0  # second turns follow the first answers
    err = capsys.readouterr().err
    assert re.search(r"train-00000\.safetensors: \d+ answers, \d+ tokens in \d+ s \(\d+ tokens/s\); \d+/1000 "
                     r"training tokens, about \d+ min left", err)
    # a rerun writes nothing; a shard lost is written again with the same tokens (seeded sampling included)
    def tensors() -> dict[str, list[list[int]]]:
        return {p.name: [t.tolist() for t in load_file(str(p)).values()] for p in out.glob("*.safetensors")}
    before = tensors()
    run(out, tokens=1000)
    assert "already written" in capsys.readouterr().err
    (out / names[1]).unlink()
    run(out, tokens=1000)
    assert tensors() == before
    # asking for more continues after the last shard
    run(out, tokens=summary["train"]["answer_tokens"] + 1)
    assert len(list(out.glob("train-*.safetensors"))) == len(names)
    with pytest.raises(ConfigError, match=r"^out: .*train-00000.safetensors was made with .*pass another --out"):
        run(out, answer_tokens=16)


def test_bad_corpus_arguments_are_one_line(tmp_path, capsys) -> None:
    for flag, value in (("--tokens", "10"), ("--answer-tokens", "2000"), ("--batch", "0"), ("--shard-prompts", "1")):
        assert train_main(["corpus", "--out", str(tmp_path / "c"), flag, value]) == 2
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and flag[2:].replace("-", "_") in err


def test_an_eagle_head_trains_on_a_corpus_folder_from_the_targets_own_features(tmp_path, target, capsys,
                                                                               monkeypatch) -> None:
    """`eagle --corpus-dir`: the shards' sequences, features from the forward the engine runs (no corpus written
    here), and a report that names the folder instead of prompt options it did not use. Features kept in files
    (`--features`) are the same rows, read back by a later pass instead of running the target again; a pass stopped
    part way goes on where its files end."""
    from playground.models.eagle import load_head

    folder = tmp_path / "corpus"
    run(folder, tokens=1000)
    train_corpus, seconds = corpus.read(folder, "train", tokens=200)
    assert 200 <= train_corpus.answer_tokens() < 400 and seconds > 0  # whole shards, in order, until the budget
    held, _ = corpus.read(folder, "held-out")
    assert not {tuple(s) for s in held.sequences} & {tuple(s) for s in train_corpus.sequences}
    # the features are the target model's own final-norm states; its soft labels, the top-k at each answer position
    states, labelled = corpus.target_pass(target, train_corpus, labels=True, keep=torch.float32)
    assert [len(s) for s in states] == [len(s) for s in train_corpus.sequences]
    assert labelled.topk_ids.shape == (train_corpus.answer_tokens(), 16) and corpus.target_pass(
        target, train_corpus)[1].topk_ids.shape[0] == 0  # labels only when asked
    monkeypatch.setattr(corpus, "FEATURE_ROWS", 64)  # several files
    store = tmp_path / "features"
    stored = corpus.target_pass(target, train_corpus, keep=torch.float32, store=store)[0]
    assert len(list(store.glob("features-*.safetensors"))) > 1 and len(stored) == len(states)
    assert all(torch.equal(a, b) for a, b in zip(stored, states))

    def not_again(*args, **kwargs):
        raise AssertionError("the target ran again")

    with monkeypatch.context() as patch:
        patch.setattr(target.model, "forward", not_again)
        again = corpus.target_pass(target, train_corpus, keep=torch.float32, store=store)[0]
        assert all(torch.equal(a, b) for a, b in zip(again, states))
        with pytest.raises(AssertionError, match="ran again"):  # other taps: other features
            corpus.target_pass(target, train_corpus, taps=(3,), keep=torch.float32, store=store)
    # a pass stopped part way (here: its target fails at the 7th sequence) goes on after its last file
    forward, calls, stop = target.model.forward, [], [7]

    def failing(*args, **kwargs):
        calls.append(1)
        if len(calls) in stop:
            raise RuntimeError("stopped")
        return forward(*args, **kwargs)

    stopped = tmp_path / "stopped"
    with monkeypatch.context() as patch:
        patch.setattr(target.model, "forward", failing)
        with pytest.raises(RuntimeError, match="stopped"):
            corpus.target_pass(target, train_corpus, keep=torch.float32, store=stopped)
        kept = len(json.loads((stopped / corpus.FEATURES).read_text())["spans"])
        assert 0 < kept <= 6  # the sequences in its files: those after them are run again
        calls.clear()
        stop.clear()
        resumed = corpus.target_pass(target, train_corpus, keep=torch.float32, store=stopped)[0]
    assert len(calls) == len(train_corpus.sequences) - kept
    assert all(torch.equal(a, b) for a, b in zip(resumed, states)) and len(resumed) == len(states)
    assert train_main(["eagle", "--features", str(store), "--out", str(tmp_path / "x")]) == 2
    assert "features: keeping the target's features in files needs --corpus-dir" in capsys.readouterr().err
    # teacher-forced, the target's argmax at an answer position is the greedy answer's next token where it was greedy
    first = labelled.topk_ids[:, 0].tolist()
    answers = [t for s, a in zip(train_corpus.sequences, train_corpus.answer_starts) for t in s[a:]]
    assert sum(f == t for f, t in zip(first, answers)) > 0.6 * len(answers)
    out = tmp_path / "head"
    assert train_main(["eagle", "--corpus-dir", str(folder), "--corpus-tokens", "200", "--epochs", "1", "--batch",
                       "4", "--head-vocab", "300", "--eval-prompts", "1", "--out", str(out)]) == 0
    assert "the target's forward: " in capsys.readouterr().err
    report = json.loads((out / "train_report.json").read_text())
    assert report["corpus_dir"] == str(folder) and report["train_answer_tokens"] == train_corpus.answer_tokens()
    assert report["targets_forward"] == "the engine's own" and "first_stage_prompts" not in report
    assert report["train_prompts"] == len(train_corpus.sequences) and report["held_out_tokens_per_target_forward"] >= 1
    assert len(load_head(str(out), target).vocab_ids) == 300
    # the Medusa heads and the draft learn from the same folder, with the soft labels of that one pass
    for kind, extra in (("medusa", ["--heads", "2", "--batch", "64"]),
                        ("draft", ["--hidden", "32", "--layers", "1", "--eval-prompts", "1"])):
        folder_out = tmp_path / kind
        assert train_main([kind, "--corpus-dir", str(folder), "--corpus-tokens", "200", "--epochs", "1",
                           "--answer-tokens", "8", "--out", str(folder_out), *extra]) == 0, capsys.readouterr().err
        report = json.loads((folder_out / "train_report.json").read_text())
        assert report["corpus_dir"] == str(folder) and report["train_prompts"] == len(train_corpus.sequences)
        capsys.readouterr()
    for kind in ("eagle", "medusa", "draft"):  # a folder without shards: one line, before any model loads
        assert train_main([kind, "--corpus-dir", str(tmp_path / "none"), "--out", str(out)]) == 2
        err = capsys.readouterr().err
        assert "corpus_dir: " in err and "holds no train shards" in err and "Loading" not in err


def test_an_eagle_head_goes_on_from_a_trained_one_on_the_shards_after_its_own(tmp_path, target, capsys) -> None:
    """`--corpus-skip` leaves out the first shards (whole ones, as `--corpus-tokens` takes them), so a second run reads
    the shards after the first run's; `--init` starts from the first run's head with its vocabulary, and a head that
    does not fit the options is refused in one line before the target's forward runs."""
    from playground.models.eagle import WEIGHTS, load_head

    folder = tmp_path / "corpus"
    run(folder, tokens=1000)
    first, _ = corpus.read(folder, "train", tokens=200)
    later, _ = corpus.read(folder, "train", tokens=200, skip=200)
    everything, _ = corpus.read(folder, "train")
    assert later.sequences and not {tuple(s) for s in first.sequences} & {tuple(s) for s in later.sequences}
    assert everything.sequences[len(first.sequences):][: len(later.sequences)] == later.sequences  # the next shards
    base = ["eagle", "--corpus-dir", str(folder), "--corpus-tokens", "200", "--epochs", "1", "--batch", "4",
            "--head-vocab", "300", "--eval-prompts", "1"]
    assert train_main(base + ["--out", str(tmp_path / "a")]) == 0
    capsys.readouterr()
    # a learning rate too small to move a float16 weight: the head saved is the one it started from
    assert train_main(base + ["--corpus-skip", "200", "--lr", "1e-12", "--init", str(tmp_path / "a"),
                              "--out", str(tmp_path / "b")]) == 0
    report = json.loads((tmp_path / "b" / "train_report.json").read_text())
    assert report["init"] == str(tmp_path / "a") and report["corpus_skip"] == 200
    assert report["train_prompts"] == len(later.sequences)
    a, b = (load_file(str(tmp_path / name / WEIGHTS)) for name in ("a", "b"))
    assert a.keys() == b.keys() and all(torch.equal(a[name], b[name]) for name in a)
    vocabularies = [load_head(str(tmp_path / name), target).vocab_ids for name in ("a", "b")]
    assert torch.equal(*vocabularies)
    capsys.readouterr()
    for bad, message in ((["--head-vocab", "200"], "pass no --taps and --head-vocab 300"),
                         (["--taps", "3"], "taps layers [] and scores 300 tokens"),
                         (["--init", str(tmp_path / "none")], "is not a folder with config.json and eagle")):
        assert train_main(base + ["--init", str(tmp_path / "a"), "--out", str(tmp_path / "c"), *bad]) == 2
        err = capsys.readouterr().err
        assert message in err and "the target's forward" not in err and len(err.strip().splitlines()) == 1
    assert train_main(["eagle", "--corpus-skip", "5", "--out", str(tmp_path / "c")]) == 2
    assert "corpus_skip: reads a corpus folder; pass --corpus-dir DIR" in capsys.readouterr().err


def test_an_eagle_run_stopped_after_an_epoch_resumes_to_the_same_head(tmp_path, target, monkeypatch) -> None:
    """The trainer saves its state after every epoch (safetensors, never pickled); a run stopped there and started
    again ends with the head a run never stopped ends with, bit for bit. Another run's checkpoint is refused."""
    from argparse import Namespace as Args

    from playground.models.eagle import EagleHead, head_config
    from playground.models.vocab import rows_of
    from playground.train import eagle

    run(tmp_path / "corpus", tokens=1000)
    data, _ = corpus.read(tmp_path / "corpus", "train", tokens=120)
    states, _ = corpus.target_pass(target, data)
    output = rows_of(target.model.output_weight.detach().float(), torch.arange(300))  # (300, E)
    args = Args(device="cpu", seed=0, batch=4, epochs=2, lr=1e-3, dtype="bfloat16", noise=0.1, unroll=2,
                token_weight=0.5, taps=[], head_vocab=300, init=None)

    def trained(checkpoint, stop_after: int | None = None) -> dict[str, torch.Tensor]:
        torch.manual_seed(0)
        head = EagleHead(head_config(target.model), ())
        save = eagle.save_checkpoint

        def stopping(path, *state_and_epochs):
            save(path, *state_and_epochs)
            if state_and_epochs[4] == stop_after:
                raise KeyboardInterrupt
        monkeypatch.setattr(eagle, "save_checkpoint", stopping)
        eagle.train(target, head, data, states, output, args, checkpoint)
        return {name: value.clone() for name, value in head.state_dict().items()}

    whole = trained(None)
    checkpoint = tmp_path / "head" / eagle.CHECKPOINT
    checkpoint.parent.mkdir()
    with pytest.raises(KeyboardInterrupt):
        trained(checkpoint, stop_after=1)
    resumed = trained(checkpoint)
    assert all(torch.equal(whole[name], resumed[name]) for name in whole)
    args.lr = 2e-3
    with pytest.raises(ConfigError, match="is the checkpoint of another run"):
        trained(checkpoint)
