"""The CLI contract: JSON output fields, and one-line errors (no traceback) for bad input."""

from __future__ import annotations

import dataclasses
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from playground.__main__ import main
from playground.trace import Trace

METRIC_KEYS = {"tokens_per_s", "wall_s", "ttft_s", "target_forwards", "mean_accepted_tokens", "acceptance_rate",
               "kept_of_drafted", "kv_bytes"}


def cli(*args: str, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "playground", *args], capture_output=True, text=True,
                          env={**os.environ, **env}, timeout=600)


def test_generate_json_and_trace(tmp_path, target) -> None:
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"prompt": "Say hi."}\n\n{"prompt": "Count to three."}\n')
    result = cli("generate", "--prompts-file", str(prompts), "--max-new-tokens", "6", "--json",
                 "--trace-out", str(tmp_path / "trace.json"))
    assert result.returncode == 0, result.stderr
    records = [json.loads(line) for line in result.stdout.splitlines()]
    assert [r["prompt"] for r in records] == ["Say hi.", "Count to three."]
    for i, record in enumerate(records):
        assert set(record) == {"prompt", "text", "token_ids", "metrics", "plan", "drafting_note"}
        assert record["plan"] == "measured" and record["drafting_note"] is None  # plain decoding drafts nothing
        assert set(record["metrics"]) == METRIC_KEYS
        assert record["metrics"]["mean_accepted_tokens"] is None and record["metrics"]["acceptance_rate"] is None
        assert 1 <= len(record["token_ids"]) <= 6
        assert Trace.load(tmp_path / f"trace-{i}.json").finish().token_ids == record["token_ids"]


def test_generate_reads_every_format(target) -> None:
    """--weights gguf-int8 (the default's choice for the embedded model), gguf and float32 each run; the
    float-activation blocks give float32's tokens (the 8-bit activations' quality is measured in test_gguf)."""
    runs = [cli("generate", "--prompt", "Name a colour.", "--max-new-tokens", "8", "--json", "--weights", weights)
            for weights in ("gguf-int8", "gguf", "float32")]
    assert all(run.returncode == 0 for run in runs), [run.stderr for run in runs]
    integer, gguf, float32 = (json.loads(run.stdout)["token_ids"] for run in runs)
    assert gguf == float32 and len(gguf) >= 1 and len(integer) >= 1


@pytest.fixture
def unsupported_folder(tmp_path):
    folder = tmp_path / "gpt2ish"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"model_type": "gpt2", "n_layer": 1}))
    return str(folder)


@pytest.mark.parametrize("args, message", [
    (["--prompt", ""], "prompt must be a non-empty string"),
    (["--prompt", "hi", "--max-new-tokens", "0"], r"max_new_tokens must be an integer in \[1, 4096\]"),
    (["--prompt", "hi", "--max-new-tokens", "5000"], r"max_new_tokens must be an integer in \[1, 4096\]"),
    (["--prompt", "hi", "--temperature", "-1"], r"temperature must be in \[0, 100\]"),
    (["--prompt", "hi", "--top-p", "0"], r"top_p must be in \(0, 1\]"),
    (["--prompt", "hi", "--top-p", "1.5"], r"top_p must be in \(0, 1\]"),
    (["--prompt", "hi", "--top-k", "-2"], r"top_k must be an integer in \[0, inf\]"),
    (["--prompt", "hi", "--model", "nobody/no-such-model"], "could not fetch 'nobody/no-such-model'"),
    (["--prompt", "hi", "--model", "./missing.gguf"], "does not exist"),
    (["--prompt", "hi", "--model", "UNSUPPORTED"], "supported: llama, mistral, qwen2, qwen3"),
    (["--prompt", "hi", "--device", "tpu"], "argument --device: invalid choice"),
    (["--prompt", "hi", "--weights", "q4"], "argument --weights: invalid choice"),
    (["--prompt", "hi", "--weights", "gguf", "--dtype", "bfloat16"], "weights: gguf needs the CPU"),
    (["--prompt", "hi", "--top-k", "many"], "argument --top-k: invalid int value"),
    (["--prompt", "hi", "--algo", "speculative", "--model", "nobody/no-draft"],
     "draft: --algo speculative needs --draft SPEC"),
    (["--prompt", "hi", "--algo", "speculative", "--draft", "embedded", "--gamma", "0"],
     r"gamma must be an integer in \[1, 16\]"),
    (["--prompt", "hi", "--algo", "speculative", "--draft", "embedded", "--copy-ngram", "9"],
     r"copy_ngram must be an integer in \[1, 8\]"),
    (["--prompt", "hi", "--algo", "speculative", "--draft", "embedded", "--copy-tokens", "0"],
     r"copy_tokens must be an integer in \[1, 16\]"),
    (["--prompt", "hi", "--algo", "lookahead", "--copy-ngram", "2"],
     r"copy-ngram: a setting of --algo medusa or speculative or eagle, not lookahead"),
    (["--prompt", "hi", "--algo", "medusa", "--copy-ngram", "-1"], r"copy_ngram must be an integer in \[1, 8\]"),
    (["--prompt", "hi", "--algo", "medusa", "--copy-tokens", "4"], "copy-tokens sizes the copies --copy-ngram adds"),
    (["--prompt", "hi", "--gamma", "3"], "gamma: a setting of --algo speculative, not ar"),
    (["--prompt", "hi", "--algo", "medusa", "--no-prompt-pool"], "no-prompt-pool: a setting of --algo lookahead, "
                                                                  "not medusa"),
    (["--prompt", "hi", "--algo", "medusa", "--tree-nodes", "65"], r"nodes must be an integer in \[1, 64\]"),
    (["--prompt", "hi", "--algo", "medusa", "--tree", "small", "--tree-nodes", "8"],
     "nodes sizes the dynamic tree only; tree 'small' has its own nodes"),
    (["--prompt", "hi", "--algo", "eagle", "--eagle-nodes", "65"], r"nodes must be an integer in \[1, 64\]"),
    (["--prompt", "hi", "--algo", "eagle", "--eagle-top-k", "0"], r"top_k must be an integer in \[1, 16\]"),
    (["--prompt", "hi", "--algo", "medusa", "--eagle-depth", "3"],
     "eagle-depth: a setting of --algo eagle, not medusa"),
    (["--prompt", "hi", "--algo", "eagle", "--eagle-head", "/nonexistent"],
     "eagle head: '/nonexistent' is not a folder"),
    (["--prompt", "hi", "--algo", "prompt-lookup", "--max-ngram", "9"], r"max_ngram must be an integer in \[1, 8\]"),
    (["--prompt", "hi", "--algo", "lookahead", "--ngram", "1"], r"ngram must be an integer in \[2, 8\]"),
    (["--prompt", "hi", "--algo", "lookahead", "--text-ngram", "17"], r"text_ngram must be an integer in \[2, 16\]"),
    (["--prompt", "hi", "--algo", "lookahead", "--corpus", "/no/such/answers.safetensors"],
     r"corpus: '/no/such/answers.safetensors' is not a file"),
    (["--prompt", "hi", "--kv", "paged", "--block-size", "0"], r"block_size must be an integer in \[1, 256\]"),
    (["--prompt", "hi", "--kv", "pages"], "argument --kv: invalid choice"),
])
def test_bad_input_is_one_line(args, message, unsupported_folder) -> None:
    args = [unsupported_folder if a == "UNSUPPORTED" else a for a in args]
    result = cli("generate", *args, HF_HUB_OFFLINE="1")
    assert result.returncode != 0
    errors = [line for line in result.stderr.splitlines() if line.startswith(("error:", "python -m playground"))]
    assert len(errors) == 1, result.stderr
    assert "Traceback" not in result.stderr
    assert re.search(message, errors[0]), errors[0]


def test_speculative_json_reports_acceptance(target, tmp_path) -> None:
    result = cli("generate", "--algo", "speculative", "--draft", "embedded", "--gamma", "3", "--prompt",
                 "Say hello.", "--max-new-tokens", "8", "--json")
    assert result.returncode == 0, result.stderr
    metrics = json.loads(result.stdout)["metrics"]
    assert metrics["acceptance_rate"] is None or metrics["acceptance_rate"] > 0.9  # the target drafting for itself
    # the shipped draft (the default): the target as its own draft would out-propose every copy
    result = cli("generate", "--algo", "speculative", "--copy-ngram", "2", "--copy-tokens", "5", "--prompt",
                 "Repeat exactly: one two three four five six. one two three four five six.", "--max-new-tokens", "16",
                 "--json", "--trace-out", str(tmp_path / "copy.json"))
    assert result.returncode == 0, result.stderr
    trace = Trace.load(tmp_path / "copy.json")
    assert trace.params["copy_max_ngram"] == 2 and trace.params["copy_num_draft"] == 5
    assert trace.params["weights"].startswith("Q4_1 and Q8_0 blocks, 8-bit activations (")  # as the header says
    assert "Its products read Q4_1 and Q8_0 blocks, 8-bit activations (" in result.stderr
    copies = [e.noted("copied") for e in trace.events if e.KIND == "draft" and e.noted("copied")]
    assert copies and all(c["source"][1] - c["source"][0] <= 5 for c in copies)


def test_draft_free_algorithms_medusa_and_eagle_with_copies_match_plain_and_trace_proposals(target, tmp_path) -> None:
    prompt = "Repeat exactly: one two three four five six. one two three four five six."
    outputs = {}
    for algo, extra in (("ar", []), ("prompt-lookup", []), ("lookahead", ["--text-ngram", "4"]),
                        ("medusa", ["--tree", "small", "--copy-ngram", "2", "--copy-tokens", "5"]),
                        ("eagle", ["--eagle-top-k", "2", "--eagle-nodes", "6", "--copy-ngram", "2"])):
        result = cli("generate", "--algo", algo, *extra, "--prompt", prompt, "--max-new-tokens", "16", "--json",
                     "--trace-out", str(tmp_path / f"{algo}.json"))
        assert result.returncode == 0, result.stderr
        outputs[algo] = json.loads(result.stdout)
    assert outputs["prompt-lookup"]["token_ids"] == outputs["ar"]["token_ids"]
    assert outputs["prompt-lookup"]["metrics"]["mean_accepted_tokens"] > 1.0
    trace = Trace.load(tmp_path / "prompt-lookup.json")
    assert trace.params["max_ngram"] == 3 and any(e.KIND == "draft" and e.noted("copied") for e in trace.events)
    assert outputs["lookahead"]["token_ids"] == outputs["ar"]["token_ids"]
    trace = Trace.load(tmp_path / "lookahead.json")
    assert trace.params["window"] == 1 and trace.params["output_pool"] and trace.params["text_ngram"] == 4
    assert any(e.KIND == "draft" and e.noted("jacobi") and e.note["candidates"] for e in trace.events)
    assert outputs["medusa"]["token_ids"] == outputs["ar"]["token_ids"]
    trace = Trace.load(tmp_path / "medusa.json")
    assert trace.params["copy_max_ngram"] == 2 and trace.params["copy_num_draft"] == 5
    assert any(e.KIND == "draft" and e.noted("copied") for e in trace.events)  # copies were grafted onto trees
    assert outputs["eagle"]["token_ids"] == outputs["ar"]["token_ids"]
    trace = Trace.load(tmp_path / "eagle.json")
    assert trace.params["top_k"] == 2 and trace.params["nodes"] == 6 and trace.params["copy_max_ngram"] == 2
    assert all(len(e.tokens) <= 6 for e in trace.events if e.KIND == "draft")
    assert any(e.KIND == "draft" and e.noted("copied") for e in trace.events)


def test_serving_benchmark_reports_every_mode(tmp_path, target) -> None:
    out = tmp_path / "serving.json"
    # float32 weights: read as GGUF blocks, one-token forwards cost little enough that lookahead's wide window may
    # never pay on this machine's measured costs (a subprocess plans from them, not from the tests' fixed curve)
    result = cli("bench", "--suite", "serving", "--requests", "3", "--max-new-tokens", "8", "--block-size", "4",
                 "--weights", "float32", "--json", str(out), "--markdown", str(tmp_path / "serving.md"))
    assert result.returncode == 0, result.stderr
    serving = json.loads(out.read_text())["serving"]
    for key in ("continuous_tokens_per_s", "static_tokens_per_s", "sequential_tokens_per_s", "kv_waste_fraction",
                "prompt_lookup_vs_continuous", "prompt_lookup_vs_sequential", "medusa_vs_continuous",
                "medusa_vs_sequential",
                "both_vs_sequential", "draft_vs_continuous", "draft_vs_sequential", "lookahead_vs_continuous",
                "lookahead_vs_sequential", "eagle_vs_continuous", "eagle_vs_sequential", "rest_vs_continuous",
                "rest_vs_sequential", "self_spec_vs_continuous", "self_spec_vs_sequential"):
        assert serving[key] > 0
    assert serving["same_tokens_in_every_mode"] and set(serving["modes"]) == {
        "continuous", "static", "sequential", "continuous + prompt lookup", "sequential + prompt lookup",
        "continuous + lookahead", "sequential + lookahead", "continuous + Medusa", "sequential + Medusa",
        "sequential + both", "continuous + draft", "sequential + draft", "continuous + EAGLE", "sequential + EAGLE",
        "continuous + REST", "sequential + REST", "continuous + self-spec", "sequential + self-spec"}
    assert serving["modes"]["sequential"]["mean_running"] == 1
    assert serving["modes"]["sequential"]["proposals"] == {}
    assert serving["modes"]["sequential + Medusa"]["proposals"]["medusa"]["proposed"] > 0
    assert serving["modes"]["sequential + draft"]["proposals"]["draft"]["proposed"] > 0
    assert serving["modes"]["sequential + lookahead"]["proposals"]["lookahead"]["proposed"] > 0
    assert serving["modes"]["continuous + EAGLE"]["proposals"]["eagle"]["proposed"] > 0
    markdown = (tmp_path / "serving.md").read_text()
    assert "| sequential + prompt lookup |" in markdown and "| sequential + both |" in markdown
    assert "- EAGLE (tree) in the batch: " in markdown and "x sequential (the same tokens)" in markdown
    bad = cli("bench", "--suite", "serving", "--requests", "0")
    assert bad.returncode == 2 and "requests must be an integer in [1, 256]" in bad.stderr


def test_serving_benchmark_without_shipped_proposers_skips_their_modes(target, monkeypatch) -> None:
    """A model with no shipped Medusa heads, draft, EAGLE head or REST corpus still gets the serving benchmark,
    without their modes, and says so."""
    from playground.bench import serving as bench_serving

    shipping = {name: spec for name, spec in bench_serving.ALGORITHMS.items() if spec.ships is not None}
    for name, spec in shipping.items():
        monkeypatch.setitem(bench_serving.ALGORITHMS, name, dataclasses.replace(spec, ships=lambda source: None))
    said = []
    serving = bench_serving.run_serving(target, 2, 4, 2, 8, 64, said.append)
    assert set(serving["modes"]) == {"continuous", "static", "sequential", "continuous + prompt lookup",
                                     "sequential + prompt lookup", "continuous + lookahead",
                                     "sequential + lookahead", "continuous + self-spec",
                                     "sequential + self-spec"} and "medusa_vs_continuous" not in serving
    for spec in shipping.values():
        assert any(f"no weights of {spec.label} ship for this model" in line for line in said)
    assert "draft_vs_continuous" not in serving and "eagle_vs_continuous" not in serving
    report = {"serving": serving, "model": "m", "environment": {"device": "cpu", "dtype": "float32"}}
    markdown = bench_serving.markdown_serving(report)
    for spec in shipping.values():
        assert f"{spec.label} in the batch: not run (no weights of it ship for this model)" in markdown
    # HTTP on a kept-alive connection against a fresh one: figures for the report, no goal asserted here
    http = serving["http"]
    assert http["client"].startswith("the openai client") and http["requests"] == 40
    assert http["keep_alive_s"] > 0 and http["fresh_s"] > 0 and "on a kept-alive connection" in markdown


@pytest.fixture(scope="module")
def broken_folders(target, tmp_path_factory) -> dict[str, str]:
    """Model folders a user may well have: each broken in one way."""
    root = tmp_path_factory.mktemp("broken")
    source = target.folder

    def folder(name: str, files: tuple[str, ...]) -> Path:
        path = root / name
        path.mkdir()
        for file in files:
            shutil.copy(source / file, path / file)
        return path
    tokenizer = tuple(p.name for p in source.iterdir() if p.name.startswith(("tokenizer", "special_tokens")))
    folder("bad-config", ("model.safetensors", *tokenizer))
    (root / "bad-config" / "config.json").write_text("{not json")
    folder("corrupt-weights", ("config.json", *tokenizer))
    (root / "corrupt-weights" / "model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00garbage")
    folder("no-tokenizer", ("config.json", "model.safetensors"))
    folder("no-weight-map", ("config.json", *tokenizer))
    (root / "no-weight-map" / "model.safetensors.index.json").write_text('{"metadata": {}}')
    # weights under another name beside a pickled copy: this project reads them, transformers would want the pickle
    pickled = folder("pickled-peer", ("config.json", *tokenizer))
    shutil.copy(source / "model.safetensors", pickled / "weights.safetensors")
    (pickled / "pytorch_model.bin").write_bytes(b"not a pickle you should open")
    config = json.loads((source / "config.json").read_text())
    for name, change in {"zero-heads": {"num_attention_heads": 0}, "negative-vocab": {"vocab_size": -5},
                         "doubled-hidden": {"hidden_size": 2 * config["hidden_size"]}}.items():
        changed = folder(name, ("model.safetensors", *tokenizer))
        (changed / "config.json").write_text(json.dumps({**config, **change}))
    # an index naming a shard out of its folder (the target's weights), or a shard linked out of it
    escape = folder("shard-escape", ("config.json", *tokenizer))
    (escape / "model.safetensors.index.json").write_text(json.dumps(
        {"weight_map": {"model.embed_tokens.weight": os.path.relpath(source / "model.safetensors", escape)}}))
    linked = folder("shard-link", ("config.json", *tokenizer))
    (linked / "model.safetensors").symlink_to(source / "model.safetensors")
    remote = folder("remote-code", tokenizer)
    (remote / "config.json").write_text(json.dumps({"model_type": "evil", "auto_map": {"AutoConfig": "evil.Config"}}))
    (remote / "evil.py").write_text("raise SystemExit('ran')\n")
    bad_generation = folder("bad-generation-config", ("config.json", "model.safetensors", *tokenizer))
    (bad_generation / "generation_config.json").write_text('{"eos_token_id": ')
    return {p.name: str(p) for p in root.iterdir()}


@pytest.mark.parametrize("argv, message", [
    (["generate", "--prompt", "hi", "--model", "bad-config"], r"bad-config/config.json is not a readable JSON file"),
    (["generate", "--prompt", "hi", "--model", "corrupt-weights"],
     r"corrupt-weights/model.safetensors is not a readable safetensors file"),
    (["generate", "--prompt", "hi", "--model", "no-tokenizer"],
     r"no-tokenizer has no tokenizer \(none of tokenizer.json, tokenizer.model, vocab.json\)"),
    (["generate", "--prompt", "hi", "--model", "no-weight-map"], r"index.json has no weight_map object"),
    (["generate", "--prompt", "caf\udcff"], r"prompt must be valid Unicode text; character 3 is a lone surrogate"),
    (["generate", "--prompts-file", "PROMPTS"], r"prompts-file line 2: not UTF-8 text \(byte 0xff\)"),
    (["generate", "--prompt", "hi", "--trace-out", "/no/such/folder/trace.json"],
     r"trace-out: no such folder /no/such/folder"),
    (["generate", "--prompt", "hi", "--model", "zero-heads"],
     r"config.json num_attention_heads must be an integer in \[1, 16777216\], got 0"),
    (["generate", "--prompt", "hi", "--model", "negative-vocab"], r"config.json vocab_size must be an integer in"),
    (["generate", "--prompt", "hi", "--model", "doubled-hidden"],
     r"the weights do not match config.json \(\d+ problem\(s\); first: size mismatch"),
    (["generate", "--prompt", "hi", "--model", "shard-escape"],
     r"names the weights file '\.\./.*', outside the folder; refused"),
    (["generate", "--prompt", "hi", "--model", "shard-link"],
     r"the weights file 'model.safetensors' of .*shard-link links to .*, outside the folder; refused"),
    (["generate", "--prompt", "hi", "--model", "remote-code"],
     r"remote-code is a 'evil' model and asks to run code of its own, which is never run here; supported: llama"),
    (["bench", "--json", "DIR"], r"json: .* is a folder; give a file name"),
    (["bench", "--markdown", "PROMPTS/x.md"], r"markdown: .*PROMPTS.jsonl is a file, not a folder"),
    (["serve", "--api-key", ""], r"api-key is empty: give a key, or leave it out to serve without one"),
    (["serve", "--allowed-origins", "evil.example"], r"allowed-origins: 'evil.example' is not an origin"),
    (["generate", "--prompt", "hi", "--model", "bad-generation-config"],
     r"generation_config.json is not a readable JSON file"),
    (["generate", "--prompt", "hi", "--cache-dir", "PROMPTS"], r"cache_dir: .* is a file; give a folder"),
    (["generate", "--prompts-file", "SURROGATE"], r"prompts-file line 1: prompt must be valid Unicode text"),
    (["generate", "--prompts-file", "NESTED"], r"prompts-file line 1: not valid JSON \(nested too deeply\)"),
    (["generate", "--prompts-file", "BIGINT"], r"prompts-file line 1: not valid JSON \(an integer too long to read\)"),
    (["generate", "--prompt", "hi", "--trace-out", "/dev/full"], r"trace-out: /dev/full is not a regular file"),
    (["generate", "--prompt", "hi", "--trace-out", "/proc/x.json"], r"trace-out: cannot write /proc/x.json"),
    (["generate", "--prompt", "hi", "--trace-out", "/sys/x.json"], r"trace-out: cannot write /sys/x.json"),
    (["generate", "--prompt", "hi", "--trace-out", "LONG"], r"trace-out: cannot write .*… \(File name too long\)"),
    (["generate", "--prompts-file", "TWO", "--trace-out", "T"], r"trace-out: .*t-1.json is a folder; give a file name"),
    (["bench", "--model", "pickled-peer", "--limit", "1", "--max-new-tokens", "2", "--algos", "prompt-lookup",
      "--json", "JSON", "--markdown", "MD"],
     r"peer: transformers could not load .*pickled-peer .*; --no-peers skips the transformers peers"),
])
def test_broken_inputs_are_one_line(argv, message, broken_folders, tmp_path, capsys) -> None:
    """Each of these printed a traceback once; they must end in one line and exit code 2, before any long work."""
    files = {"PROMPTS": b'{"prompt": "fine"}\n{"prompt": "caf\xff"}\n', "SURROGATE": b'{"prompt": "a\\ud800"}\n',
             "NESTED": b"[" * 100_000 + b"\n", "BIGINT": b'{"prompt": "a", "n": ' + b"9" * 5001 + b"}\n",
             "TWO": b'{"prompt": "one"}\n{"prompt": "two"}\n'}
    paths = {**broken_folders, "JSON": str(tmp_path / "b.json"), "MD": str(tmp_path / "b.md"), "DIR": str(tmp_path),
             "LONG": str(tmp_path / ("t" * 300 + ".json")), "T": str(tmp_path / "t.json")}
    for name, data in files.items():
        paths[name] = str(tmp_path / f"{name}.jsonl")
        (tmp_path / f"{name}.jsonl").write_bytes(data)
    (tmp_path / "t-1.json").mkdir()
    assert main([paths.get(a, a).replace("PROMPTS/", paths["PROMPTS"] + "/") for a in argv]) == 2
    err = capsys.readouterr().err
    errors = [line for line in err.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "Traceback" not in err, err
    assert re.search(message, errors[0]), errors[0]
    if "--model" not in argv:  # refused before the model loads
        assert "Loading model" not in err


@pytest.mark.parametrize("argv", [
    ["generate", "--prompt", "Tell a long story.", "--max-new-tokens", "4096"],
    ["bench", "--limit", "1", "--no-peers", "--json", "JSON", "--markdown", "MD"],
])
def test_ctrl_c_ends_a_command_with_one_line(argv, tmp_path) -> None:
    """Ctrl+C while a command works: exit code 130 and one line, never a traceback."""
    argv = [{"JSON": str(tmp_path / "b.json"), "MD": str(tmp_path / "b.md")}.get(a, a) for a in argv]
    process = subprocess.Popen([sys.executable, "-m", "playground", *argv], cwd=Path(__file__).resolve().parent.parent,
                               stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                               env={**os.environ, "PYTHONUNBUFFERED": "1"},
                               # a test run started in the background inherits SIGINT ignored; a terminal's does not
                               preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        seen = [process.stderr.readline()]
        while "Loading model" not in seen[-1]:
            seen.append(process.stderr.readline())
            assert seen[-1], "".join(seen)
        time.sleep(2)  # inside the work: loading, warming up or decoding
        process.send_signal(signal.SIGINT)
        rest = process.stderr.read()
        code = process.wait(timeout=60)
        # 130, as the command returns; about one run in ten on a 2-core host ends by SIGINT itself (-2) after the
        # line, as the interpreter shuts down: interrupted either way, and nothing more is printed
        assert code in (130, -signal.SIGINT), (code, rest)
    finally:
        process.kill()
    assert rest.endswith("Interrupted.\n") and "Traceback" not in rest, rest
