"""Racing an OpenAI-compatible endpoint: `bench --endpoint` and the Race tab's remote lane, live against the
project's own server (and llama.cpp's, where llama-cpp-python's server is installed: `bash scripts/setup.sh
--llama`); a bad URL, an unreachable server or a refusal is one line naming the endpoint, before any model loads."""

from __future__ import annotations

import importlib.util
import json
import socket
import statistics
import subprocess
import sys
import time
import urllib.request

import gradio as gr
import pytest
from openai import OpenAI

from playground.__main__ import main
from playground.bench.report import markdown_endpoint
from playground.config import ConfigError, EngineParams
from playground.models.loader import embedded_gguf
from playground.remote import Remote, endpoint_url, endpoint_urls
from playground.ui import race as race_tab
from playground.ui.models import Access, catalog

from .test_server import running

KEY = "sekret"
PROMPT = "Name three colours."


@pytest.fixture(scope="module")
def service(target):
    with running(target, EngineParams(num_blocks=128, block_size=8, max_running=2), api_key=KEY) as srv:
        yield srv


def base(srv) -> str:
    return f"http://{srv.host}:{srv.port}/v1"


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.mark.parametrize(("given", "url"), [
    ("http://127.0.0.1:8000", "http://127.0.0.1:8000/v1"), ("http://127.0.0.1:8000/", "http://127.0.0.1:8000/v1"),
    (" https://api.example.com/v1/ ", "https://api.example.com/v1"),
    ("http://[::1]:9000/openai/v1", "http://[::1]:9000/openai/v1")])
def test_an_endpoint_is_a_base_url(given: str, url: str) -> None:
    assert endpoint_url(given) == url


@pytest.mark.parametrize("given", ["", "127.0.0.1:8000", "ftp://host/v1", "http://", "http://host:99999/v1",
                                   "http://host/v1?key=1", "http://host/v1#x", None])
def test_a_malformed_endpoint_is_refused_naming_the_field(given) -> None:
    with pytest.raises(ConfigError, match=r"^endpoint: expected an OpenAI-compatible server's base URL"):
        endpoint_url(given)


def test_a_list_of_endpoints_names_each_server_once() -> None:
    assert endpoint_urls("http://a:1,http://b:2/v1") == ("http://a:1/v1", "http://b:2/v1")
    with pytest.raises(ConfigError, match="^endpoint: .* names a server twice"):
        endpoint_urls("http://a:1,http://a:1/v1/")


def test_a_stream_from_our_server_is_timed_and_counted_as_it_answers(service) -> None:
    """The model is the first the server lists; the streamed text and the usage count are what the same request
    answers unstreamed; each chunk's time is after the one before and within the run."""
    remote = Remote(base(service), api_key=KEY)
    assert remote.model == service.worker.target.name  # the first model it lists
    run = remote.stream(PROMPT, 12)
    whole = OpenAI(base_url=base(service), api_key=KEY).chat.completions.create(
        model=remote.model, messages=[{"role": "user", "content": PROMPT}], max_tokens=12, temperature=0)
    assert run.counted == "usage" and run.tokens == whole.usage.completion_tokens
    assert run.text == whole.choices[0].message.content and run.finish_reason == whole.choices[0].finish_reason
    assert 0 < run.first_token_s <= run.wall_s and list(run.chunk_s) == sorted(run.chunk_s)
    assert run.chunk_s[-1] <= run.wall_s and run.tokens_per_s == run.tokens / run.wall_s
    assert remote.label == f"{remote.model} @ {service.host}:{service.port}"
    stopped = remote.stream(PROMPT, 12, stopped=lambda: True)  # Stop ends a stream after its first chunk
    assert len(stopped.pieces) <= 1


def test_a_refusing_or_absent_server_is_one_line_naming_the_endpoint(service) -> None:
    with pytest.raises(ConfigError, match=r"^endpoint: http://.* refused the API key \(401\); pass its key$"):
        Remote(base(service), api_key="wrong")
    with pytest.raises(ConfigError, match=r"^endpoint: http://.* serves 'SmolLM2-135M-Instruct', not "
                                          r"'no-such-model' \(model\)$"):
        Remote(base(service), "no-such-model", KEY)
    remote = Remote(base(service), api_key=KEY)
    with pytest.raises(ConfigError, match=r"^endpoint: http://.* answered 400: max_tokens must be") as caught:
        remote.stream(PROMPT, 5000)  # over the server's limit: its own message, on one line
    assert "\n" not in str(caught.value)
    with pytest.raises(ConfigError, match=r"^endpoint: cannot reach http://127\.0\.0\.1:\d+/v1 \(.+\)$"):
        Remote(f"http://127.0.0.1:{free_port()}", "m", KEY)


def test_the_bench_races_an_endpoint_beside_plain_decoding(service, tmp_path, capsys) -> None:
    """`bench --endpoint`: each prompt streamed from the server in the local rounds; per prompt and in the summary
    its wall-clock tok/s, its ratio to plain decoding and its first-text time, labelled a remote measurement."""
    out, md = tmp_path / "b.json", tmp_path / "b.md"
    assert main(["bench", "--algos", "prompt-lookup", "--limit", "2", "--max-new-tokens", "6", "--rounds", "2",
                 "--no-peers", "--device", "cpu", "--endpoint", base(service), "--endpoint-key", KEY,
                 "--json", str(out), "--markdown", str(md)]) == 0
    report = json.loads(out.read_text())
    [(label, summary)] = report["summary"]["endpoints"].items()
    assert summary["url"] == base(service) and summary["counted"] == ["usage"] and label.endswith(
        f"@ {service.host}:{service.port}")
    assert summary["median_tokens_per_s"] > 0 and summary["median_ratio_vs_ar"] > 0
    assert 0 < summary["median_first_token_s"] == statistics.median(
        row["endpoints"][label]["first_token_s"] for row in report["prompts"])
    # a server that sent no text has no first-text time (not 0 s)
    silent = dict(summary, median_first_token_s=None)
    assert markdown_endpoint(label, silent, report["prompts"])[-1].endswith("plain decoding, no text came")
    for row in report["prompts"]:
        remote = row["endpoints"][label]
        assert 1 <= remote["tokens"] <= 6 and remote["first_token_s"] <= remote["wall_s"]
    text = md.read_text()
    assert f"## remote: {label}" in text and "A remote measurement: no steps, no exactness check" in text
    assert "(remote)" in capsys.readouterr().err  # the progress line names the remote lane
    # refused before any model loads: a bad URL, an unreachable server
    assert main(["bench", "--endpoint", "ftp://host"]) == 2
    assert main(["bench", "--endpoint", f"http://127.0.0.1:{free_port()}"]) == 2
    assert "endpoint: cannot reach" in capsys.readouterr().err


def test_the_race_tab_runs_a_remote_lane_except_in_a_public_app(service, monkeypatch) -> None:
    """The remote lane replays its text at the times it arrived, uncoloured and escaped, with a table row and a
    dotted chart line that say remote; a public app offers no such lane and refuses one asked for."""
    frames = list(race_tab.run_race(PROMPT, [race_tab.REMOTE], 8, 0.0, 0, "measured", "embedded", "", "cpu",
                                    "float32", "auto", base(service), "", KEY, []))
    lanes, done, rows, checks, chart, history = frames[-1]
    assert 'class="pg-remote"' in lanes and race_tab.REMOTE_NOTE.replace("'", "&#x27;") in lanes
    [remote_row] = [row for row in rows if row[0].startswith(race_tab.REMOTE)]
    assert remote_row[1] > 0 and remote_row[2].endswith("(remote, wall clock)") and remote_row[6] == (
        "not checked (remote)")
    assert "wall-clock time over HTTP" in done and "tokens counted by its server's usage count" in checks
    assert any(trace.line.dash == "dot" for trace in chart.data) and len(history) == 1  # plain's run only
    with pytest.raises(gr.Error, match="endpoint: expected"):  # refused before anything loads
        list(race_tab.run_race(PROMPT, [race_tab.REMOTE], 8, 0.0, 0, "measured", "embedded", "", "cpu", "float32",
                               "auto", "nowhere", "", "", []))
    monkeypatch.setattr(catalog, "access", Access(public=True))
    with pytest.raises(gr.Error, match=r"unknown: OpenAI endpoint"):
        list(race_tab.run_race(PROMPT, [race_tab.REMOTE], 8, 0.0, 0, "measured", "embedded", "", "cpu", "float32",
                               "auto", base(service), "", KEY, []))


@pytest.mark.skipif(importlib.util.find_spec("llama_cpp") is None, reason="llama-cpp-python is not installed "
                    "(bash scripts/setup.sh --llama)")
def test_the_bench_races_llama_cpps_server(tmp_path) -> None:
    """llama-cpp-python's OpenAI-compatible server on the embedded GGUF file: it streams no usage, so its tokens are
    counted as its chunks, and the report says so."""
    port = free_port()
    server = subprocess.Popen([sys.executable, "-m", "llama_cpp.server", "--model", str(embedded_gguf()), "--port",
                               str(port), "--n_ctx", "1024", "--n_threads", "2"],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 120
        while True:
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/models", timeout=5)
                break
            except OSError:
                assert server.poll() is None and time.monotonic() < deadline, "llama.cpp's server did not start"
                time.sleep(0.5)
        out = tmp_path / "b.json"
        assert main(["bench", "--algos", "prompt-lookup", "--limit", "1", "--max-new-tokens", "6", "--rounds", "1",
                     "--no-peers", "--device", "cpu", "--endpoint", f"http://127.0.0.1:{port}", "--json", str(out),
                     "--markdown", str(tmp_path / "b.md")]) == 0
        [(label, summary)] = json.loads(out.read_text())["summary"]["endpoints"].items()
        assert label.startswith("SmolLM2-135M-Instruct.Q4_1.gguf @ ") and summary["counted"] == ["chunks"]
        assert summary["median_tokens_per_s"] > 0
        assert "tokens counted by the streamed chunks" in (tmp_path / "b.md").read_text()
    finally:
        server.terminate()
        server.wait(timeout=30)
