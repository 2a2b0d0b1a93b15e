"""The HTTP server (`python -m playground serve`): requests served together get exactly their solo outputs,
streaming adds up to the whole text, bad requests get JSON errors naming the field, no request can hurt another or
the server, and the engine keeps no record of finished or abandoned requests."""

from __future__ import annotations

import http.client
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from playground.__main__ import main
from playground.api import CompletionRequest, Service, listen, parse_job
from playground.config import ConfigError, EngineParams, GenerationParams, SamplingParams
from playground.decoding import encode_prompt
from playground.decoding.base import chat_ids
from playground.decoding.prompt_lookup import PromptLookupParams
from playground.decoding.registry import build_proposer
from playground.engine import generate
from playground.server import ApiError, EngineWorker, settled_text

from .prompts import PROMPTS

TOKENS = 24


# fixture name -> (algorithm, prompt lookup's copies grafted onto its trees)
PROPOSERS = {"plain": ("ar", None), "proposals": ("medusa", PromptLookupParams()),
             "drafts": ("speculative", PromptLookupParams()), "lookahead": ("lookahead", None)}


@contextmanager
def running(target, params: EngineParams, **options) -> Iterator[Service]:
    """A server on a free port, its engine's worker on a thread of its own, until the block ends."""
    service = Service(target, params, listen("127.0.0.1", 0), quiet=True, **options)
    service.start()
    worker = threading.Thread(target=service.worker.run)
    worker.start()
    while not service.http.started:
        time.sleep(0.01)
    try:
        yield service
    finally:
        service.worker.close()
        worker.join()
        service.stop()


@pytest.fixture(scope="module", params=list(PROPOSERS))
def server(target, request):
    """Every test runs against plain decoding and against proposals in the batch (prompt lookup's copies with the
    Medusa heads' trees, or with the draft's chains; lookahead's windows and candidates), which must answer alike."""
    # 4 running at most, so that of 8 requests sent together some wait and join the batch as others finish
    algo, copies = PROPOSERS[request.param]
    with running(target, EngineParams(num_blocks=256, block_size=8, max_running=4),
                 proposer=build_proposer(target, algo, copies=copies)) as service:
        yield service


JSON = {"Content-Type": "application/json"}


def post(srv: Service, path: str, body, raw: bytes | None = None) -> tuple[int, dict]:
    connection = http.client.HTTPConnection(srv.host, srv.port, timeout=120)
    connection.request("POST", path, raw if raw is not None else json.dumps(body), JSON)
    response = connection.getresponse()
    return response.status, json.loads(response.read())


def get(srv: Service, path: str) -> tuple[int, dict]:
    connection = http.client.HTTPConnection(srv.host, srv.port, timeout=120)
    connection.request("GET", path)
    response = connection.getresponse()
    return response.status, json.loads(response.read())


def events(srv: Service, path: str, body) -> list:
    """A streamed request's server-sent events: JSON chunks, then the string "[DONE]"."""
    connection = http.client.HTTPConnection(srv.host, srv.port, timeout=120)
    connection.request("POST", path, json.dumps({**body, "stream": True}), JSON)
    response = connection.getresponse()
    assert response.status == 200 and response.getheader("Content-Type").startswith("text/event-stream")
    out = []
    for line in response.read().decode().split("\n\n"):
        if line:
            assert line.startswith("data: ")
            data = line[len("data: "):]
            out.append(data if data == "[DONE]" else json.loads(data))
    return out


def solo(target, prompt_ids: list[int], sampling: SamplingParams, max_tokens: int, stop: tuple[str, ...] = ()):
    """Plain decoding of one prompt on its own."""
    return generate(target, prompt_ids, None, sampling, GenerationParams(max_new_tokens=max_tokens, stop=stop))[0]


def chat(prompt: str) -> list[dict[str, str]]:
    return [{"role": "user", "content": prompt}]


def test_requests_sent_together_get_their_solo_greedy_outputs(server, target):
    prompts = PROMPTS[:8]
    bodies = [{"messages": chat(p), "max_tokens": TOKENS} for p in prompts[:6]]
    bodies += [{"prompt": p, "max_tokens": TOKENS - 5} for p in prompts[6:]]  # raw completions of another length
    with ThreadPoolExecutor(len(bodies)) as pool:
        replies = list(pool.map(
            lambda b: post(server, "/v1/chat/completions" if "messages" in b else "/v1/completions", b), bodies))
    for body, (status, reply) in zip(bodies, replies):
        assert status == 200, reply
        if "messages" in body:
            ids = encode_prompt(target, body["messages"][0]["content"], GenerationParams())
            text = reply["choices"][0]["message"]["content"]
            assert reply["object"] == "chat.completion" and reply["choices"][0]["message"]["role"] == "assistant"
        else:
            ids = list(target.tokenizer(body["prompt"]).input_ids)
            text = reply["choices"][0]["text"]
            assert reply["object"] == "text_completion"
        expected = solo(target, ids, SamplingParams(), body["max_tokens"])
        assert text == expected.text
        assert reply["usage"] == {"prompt_tokens": len(ids), "completion_tokens": len(expected.token_ids),
                                  "total_tokens": len(ids) + len(expected.token_ids)}
        assert reply["choices"][0]["finish_reason"] == ("length" if expected.finish_reason == "length" else "stop")
        assert reply["model"] == target.name


def test_a_conversation_goes_through_the_chat_template(server, target):
    messages = [{"role": "system", "content": "You answer in one short sentence."},
                {"role": "user", "content": "What is the largest planet?"},
                {"role": "assistant", "content": "Jupiter is the largest planet."},
                {"role": "user", "content": "And the smallest?"}]
    status, reply = post(server, "/v1/chat/completions", {"messages": messages, "max_tokens": TOKENS})
    assert status == 200
    ids = chat_ids(target.tokenizer, messages)
    assert reply["usage"]["prompt_tokens"] == len(ids)
    assert reply["choices"][0]["message"]["content"] == solo(target, ids, SamplingParams(), TOKENS).text


@pytest.mark.parametrize("path, body", [
    ("/v1/chat/completions", {"messages": chat("Translate into French: 'The weather is lovely, isn't it?'")}),
    # characters split over several tokens: their bytes arrive one token at a time
    ("/v1/chat/completions", {"messages": chat("Write 'I love pizza' using emoji only.")}),
    ("/v1/chat/completions", {"messages": chat("Translate into Japanese: 'Good morning'")}),
    ("/v1/completions", {"prompt": "A list of colours:\n1. Red\n2.", "stop": "\n4."}),
    ("/v1/chat/completions", {"messages": chat(PROMPTS[3]), "stop": ["\n\n", "vitamin"]}),
    ("/v1/completions", {"prompt": "def add(a, b):\n", "max_tokens": 40}),
])
def test_streamed_pieces_add_up_to_the_whole_text(server, path, body):
    body = {"max_tokens": TOKENS, **body}
    status, whole = post(server, path, body)
    assert status == 200
    streamed = events(server, path, body)
    assert streamed[-1] == "[DONE]"
    chunks = streamed[:-1]
    is_chat = path == "/v1/chat/completions"
    pieces = [c["choices"][0]["delta"]["content"] if is_chat else c["choices"][0]["text"] for c in chunks]
    text = whole["choices"][0]["message"]["content"] if is_chat else whole["choices"][0]["text"]
    assert "".join(pieces) == text
    assert len(chunks) > 2  # streamed piece by piece, not at the end
    assert all(c["choices"][0]["finish_reason"] is None for c in chunks[:-1])
    assert chunks[-1]["choices"][0]["finish_reason"] == whole["choices"][0]["finish_reason"]
    assert chunks[-1]["usage"] == whole["usage"]
    assert len({c["id"] for c in chunks}) == 1
    if is_chat:
        assert chunks[0]["object"] == "chat.completion.chunk"
        assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    if "stop" in body:
        assert not any(s in text for s in ([body["stop"]] if isinstance(body["stop"], str) else body["stop"]))


def test_sampling_follows_the_seed(server, target):
    prompt = "Write a short poem about the sea."
    body = {"messages": chat(prompt), "max_tokens": TOKENS, "temperature": 0.9, "top_p": 0.95}
    texts = [post(server, "/v1/chat/completions", {**body, "seed": seed})[1]["choices"][0]["message"]["content"]
             for seed in (7, 7, 8)]
    assert texts[0] == texts[1] != texts[2]
    ids = encode_prompt(target, prompt, GenerationParams())
    alone = solo(target, ids, SamplingParams(temperature=0.9, top_p=0.95, seed=7), TOKENS)
    assert texts[0] == alone.text


@pytest.mark.parametrize("path, body, status, message", [
    ("/v1/completions", {"prompt": ""}, 400, "prompt must be a non-empty string"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 0}, 400, "max_tokens must be an integer in [1, 4096], got 0"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 5000}, 400, "max_tokens must be an integer in [1, 4096]"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 2100}, 400, "this server's pool holds 256 (its --num-blocks)"),
    ("/v1/completions", {"prompt": "hi", "temperature": -0.5}, 400, "temperature must be in [0, 100]"),
    ("/v1/completions", {"prompt": "hi", "top_p": 1.5}, 400, "top_p must be in (0, 1]"),
    ("/v1/completions", {"prompt": "hi", "top_k": -1}, 400, "top_k must be an integer in [0, inf]"),
    ("/v1/completions", {"prompt": "hi", "seed": "x"}, 400, "seed: Input should be a valid integer, got 'x'"),
    ("/v1/completions", {"prompt": "hi", "stop": ["a", ""]}, 400, "stop must be a string of 1..1000 characters"),
    ("/v1/completions", {"prompt": "hi", "stream": 1}, 400, "stream: Input should be a valid boolean, got 1"),
    ("/v1/completions", {"prompt": "hi", "n": 3}, 400, "n is not supported by this server (only 1)"),
    ("/v1/completions", {"prompt": "hi", "frequency_penalty": 0.5}, 400, "frequency_penalty is not supported"),
    # a boolean is not the number it equals in Python
    ("/v1/completions", {"prompt": "hi", "n": True}, 400, "n is not supported by this server (only 1)"),
    ("/v1/completions", {"prompt": "hi", "frequency_penalty": False}, 400, "frequency_penalty is not supported"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": int("9" * 4000)}, 400, "got 99999999"),
    ("/v1/completions", {"prompt": "hi", "stream_options": {"include_usage": True}}, 400,
     "stream_options is only allowed with stream: true"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 3, "max_completion_tokens": 4}, 400,
     "max_tokens and max_completion_tokens differ"),
    ("/v1/completions", {"prompt": "hi", "max_completion_tokens": 0}, 400, "max_completion_tokens must be an integer"),
    ("/v1/completions", {"prompt": "hi", "tools": []}, 400, "unknown field 'tools'"),
    ("/v1/completions", {"prompt": "hi", "model": "gpt-4o"}, 404, "model must be 'SmolLM2-135M-Instruct'"),
    ("/v1/completions", {"messages": chat("hi")}, 400, "unknown field 'messages'"),
    ("/v1/completions", ["hi"], 400, "the request body must be a JSON object"),
    ("/v1/chat/completions", {"messages": []}, 400, "messages must be a non-empty list"),
    ("/v1/chat/completions", {"messages": [{"role": "robot", "content": "hi"}]}, 400,
     "messages[0].role: Input should be 'system', 'user' or 'assistant', got 'robot'"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": 3}]}, 400,
     "messages[0].content: Input should be a valid string, got 3"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi", "name": "Ann"}]}, 400,
     "unknown field 'messages[0].name'; a message takes role, content"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "  "}]}, 400, "messages must hold some text"),
    ("/v1/chat/completions", {"prompt": "hi"}, 400, "unknown field 'prompt'"),
    ("/v1/embeddings", {"input": "hi"}, 404, "no such endpoint POST /v1/embeddings"),
    ("/health", {}, 405, "/health takes GET, not POST"),
])
def test_bad_requests_are_refused_naming_the_field(server, path, body, status, message):
    got, reply = post(server, path, body)
    assert got == status
    assert message in reply["error"]["message"] and len(reply["error"]["message"]) < 400
    assert reply["error"]["type"] == "invalid_request_error"


def test_neutral_openai_fields_are_accepted_and_bodies_checked(server):
    status, _ = post(server, "/v1/completions", {"prompt": "Hello", "max_tokens": 2, "n": 1, "presence_penalty": 0,
                                                 "logprobs": None, "model": "embedded", "user": "ann"})
    assert status == 200
    status, reply = post(server, "/v1/completions", None, raw=b"{not json")
    assert status == 400 and "not valid JSON" in reply["error"]["message"]
    status, reply = post(server, "/v1/completions", {"prompt": "Hello there. " * 1500, "max_tokens": 4000})
    assert status == 400 and reply["error"]["param"] == "max_tokens"
    assert "prompt tokens + max_tokens must be <= 8192 (the model's context length)" in reply["error"]["message"]


def test_the_read_endpoints(server, target):
    assert get(server, "/health") == (200, {"status": "ok"})
    status, models = get(server, "/v1/models")
    assert status == 200 and [m["id"] for m in models["data"]] == [target.name]
    status, reply = get(server, "/v1/complete")
    assert status == 404 and "GET /v1/engine" in reply["error"]["message"]
    post(server, "/v1/completions", {"prompt": "One, two,", "max_tokens": 4})
    post(server, "/v1/chat/completions", {"messages": chat("Copy exactly: red, green, blue, red, green, blue.")})
    status, state = get(server, "/v1/engine")
    assert status == 200
    assert state["running"] == state["waiting"] == 0 and state["finished"] >= 1 and state["steps"] >= 4
    assert state["kv"]["blocks_used"] == 0 and state["kv"]["blocks_total"] == 256
    assert state["params"]["max_running"] == 4
    proposer = state["proposer"]
    if proposer is not None and proposer["proposer"] == "lookahead":  # the pools' candidates were verified, some kept
        ahead = proposer["counts"]["lookahead"]
        assert proposer["proposer"] == "lookahead" and list(proposer["counts"]) == ["lookahead"]
        assert proposer["window"] == 1 and proposer["ngram"] >= 2 and proposer["guesses"] == 2 and ahead["steps"] > 0
        assert 0 < ahead["accepted"] < ahead["proposed"]
    elif proposer is None:
        assert server.worker.engine.proposer is None
    else:  # copies and the heads' trees or the draft's chains were verified, some of their tokens accepted
        copies = proposer["counts"]["copy"]
        assert proposer["copy_max_ngram"] == 3
        if proposer["proposer"] == "medusa":
            guesses = proposer["counts"]["medusa"]
            assert proposer["proposer"] == "medusa" and proposer["depth"] == 4
            assert proposer["heads"] == "medusa-smollm2-135m"  # the folder's name: no local path leaves
        else:
            guesses = proposer["counts"]["draft"]
            assert proposer["proposer"] == "draft" and proposer["gamma"] == 4
            assert proposer["draft"] == "draft-smollm2-135m"
        assert copies["steps"] > 0 and copies["proposed"] > 0 and guesses["steps"] > 0
        assert 0 < copies["accepted"] + guesses["accepted"] < copies["proposed"] + guesses["proposed"]
    assert not server.worker.engine.requests  # finished requests are forgotten
    assert not server.worker.engine.events  # and the engine keeps no history


def test_a_client_that_hangs_up_stops_its_request(server):
    finished = get(server, "/v1/engine")[1]["finished"]
    sock = socket.create_connection((server.host, server.port))
    body = json.dumps({"prompt": "1, 2, 3, 4, 5, 6,", "max_tokens": 400, "stream": True}).encode()
    sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\n"
                 b"Content-Length: %d\r\n\r\n%s"
                 % (len(body), body))
    received = b""
    while b"data: " not in received:  # the headers come first, then the first piece of text: decoding has begun
        chunk = sock.recv(4096)
        assert chunk, "the server closed the stream before any text"
        received += chunk
    sock.close()
    deadline = time.monotonic() + 60
    while get(server, "/v1/engine")[1]["running"] and time.monotonic() < deadline:
        time.sleep(0.05)
    state = get(server, "/v1/engine")[1]
    assert state["running"] == 0 and state["finished"] == finished  # aborted, not run to its 400 tokens
    assert not server.worker.engine.requests and state["kv"]["blocks_used"] == 0


def test_an_engine_failure_fails_its_requests_and_serving_goes_on(server):
    engine = server.worker.engine

    def broken_step():
        raise RuntimeError("simulated failure")

    engine.step = broken_step
    status, reply = post(server, "/v1/completions", {"prompt": "Hello", "max_tokens": 3})
    assert status == 500 and "the engine failed: simulated failure" in reply["error"]["message"]
    assert server.worker.engine is not engine  # a fresh engine and KV pool
    status, reply = post(server, "/v1/completions", {"prompt": "Hello", "max_tokens": 3})
    assert status == 200 and reply["usage"]["completion_tokens"] == 3


@pytest.mark.parametrize("text, stop, settled", [
    ("Hello wor", (), "Hello wor"),
    ("Hello ", (), "Hello"),  # a space may yet be dropped before punctuation
    ("caf\ufffd", (), "caf"),  # the rest of the character's bytes are still to come
    ("one\n", ("\n\n",), "one"),
    ("see the EN", ("END",), "see the"),
    ("see the E", ("END", "EXIT"), "see the"),
    ("ends with N", ("END",), "ends with N"),
    ("a \ufffd \n", (), "a"),
])
def test_settled_text_holds_back_what_may_change(text, stop, settled):
    assert settled_text(text, stop) == settled


def held_back(text: str, stop: str) -> int:
    """The definition: the longest tail of text, shorter than stop, that stop begins with."""
    return max((k for k in range(1, min(len(stop), len(text) + 1)) if text.endswith(stop[:k])), default=0)


@given(st.text("abE ", max_size=30), st.lists(st.text("abEN", min_size=1, max_size=6), max_size=3))
def test_settled_text_compares_only_where_a_stop_string_can_begin(text, stop):
    """The fast search gives what the definition gives, stop string by stop string."""
    cut = text
    while True:
        shorter = cut.rstrip().rstrip("\ufffd")
        for s in stop:
            shorter = shorter[: len(shorter) - held_back(shorter, s)]
        if shorter == cut:
            break
        cut = shorter
    assert settled_text(text, tuple(stop)) == cut


def test_stop_strings_are_bounded_in_number_and_length():
    long = "x" * 1001
    for stop in (("a",) * 5, (long,)):
        with pytest.raises(ConfigError, match="stop must be at most 4 strings of 1..1000 characters"):
            GenerationParams(stop=stop)
    for stop in (long, ["a"] * 5, ["a", ""]):
        with pytest.raises(ApiError, match="stop must be a string of 1..1000 characters or a list of 1..4") as refused:
            parse_job(json.dumps({"prompt": "hi", "stop": stop}).encode(), CompletionRequest, ("m",), None)
        assert refused.value.param == "stop"


def test_cli_errors_before_loading_a_model(capsys):
    for argv, message in [
            (["serve", "--port", "70000"], "port must be an integer in [0, 65535], got 70000"),
            (["serve", "--num-blocks", "0"], "num_blocks must be an integer in [1,"),
            (["serve", "--num-draft", "4"], "num-draft: a setting of --algo prompt-lookup, not ar"),
            (["serve", "--algo", "prompt-lookup", "--max-ngram", "0"], "max_ngram must be an integer in [1, 8], got 0"),
            (["serve", "--algo", "lookahead", "--medusa-depth", "2"], "medusa-depth: a setting of --algo medusa, not "
                                                                      "lookahead"),
            (["serve", "--algo", "medusa", "--tree-nodes", "65"], "nodes must be an integer in [1, 64], got 65"),
            (["serve", "--algo", "medusa", "--medusa-depth", "0"], "depth must be an integer in [1, 16], got 0"),
            (["serve", "--port", "0", "--algo", "medusa", "--medusa-heads", "/no/such/heads"],
             "medusa heads: '/no/such/heads' is not a folder"),
            (["serve", "--gamma", "2"], "gamma: a setting of --algo speculative, not ar"),
            (["serve", "--algo", "speculative", "--gamma", "17"], "gamma must be an integer in [1, 16], got 17"),
            (["serve", "--algo", "lookahead", "--copy-ngram", "3"], "copy-ngram: a setting of --algo medusa or "
                                                                    "speculative or eagle, not lookahead"),
            (["serve", "--window", "2"], "window: a setting of --algo lookahead, not ar"),
            (["serve", "--algo", "lookahead", "--window", "0"], "window must be an integer in [1, 16], got 0"),
            (["serve", "--allowed-hosts", ","], "allowed_hosts must name at least one host (or * for any)"),
    ]:
        assert main(argv) == 2, argv
        assert message in capsys.readouterr().err, argv
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        assert main(["serve", "--port", str(taken.getsockname()[1])]) == 2
    err = capsys.readouterr().err
    assert "port: cannot listen on 127.0.0.1:" in err and "Loading model" not in err


@pytest.fixture
def ctrl_c_raises():
    """Python's Ctrl+C handler for the test, whatever this process inherited: a test run started as a background job
    of a non-interactive shell inherits SIGINT ignored, and so would the commands it starts."""
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, previous)


def test_ctrl_c_landing_on_another_thread_still_stops_the_idle_engine_thread(target, ctrl_c_raises):
    """The kernel may hand a process's SIGINT to any of its threads (HTTP, OpenMP workers); Python then only flags
    it for the main thread, which must not sleep on its queue for ever (found when `serve` once ignored a Ctrl+C)."""
    worker = EngineWorker(target, EngineParams(num_blocks=16))

    def interrupt() -> None:
        time.sleep(0.5)
        signal.pthread_kill(threading.get_ident(), signal.SIGINT)  # to this thread, not the main one
        time.sleep(5)
        worker.close()  # wakes the main thread if the interrupt never reached it: run() then returns normally
    threading.Thread(target=interrupt, daemon=True).start()
    started = time.perf_counter()
    with pytest.raises(KeyboardInterrupt):
        worker.run()
    assert time.perf_counter() - started < 5


def test_the_serve_command_answers_and_stops_on_ctrl_c(ctrl_c_raises):
    root = Path(__file__).resolve().parent.parent
    # the child inherits the handler set above as the default action, as a command started from a terminal does
    process = subprocess.Popen([sys.executable, "-m", "playground", "serve", "--port", "0"], cwd=root,
                               stderr=subprocess.PIPE, text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    try:
        line = ""
        while "Serving" not in line:
            line = process.stderr.readline()
            assert line, "the server exited before serving"
        url = line.split(" at ", 1)[1].split()[0]
        host, port = url.removeprefix("http://").split(":")
        connection = http.client.HTTPConnection(host, int(port), timeout=120)
        connection.request("POST", "/v1/completions", json.dumps({"prompt": "Hello", "max_tokens": 3}), JSON)
        response = connection.getresponse()
        assert response.status == 200 and json.loads(response.read())["usage"]["completion_tokens"] == 3
        process.send_signal(signal.SIGINT)
        assert process.wait(timeout=60) == 0
        assert "Stopped." in process.stderr.read()
    finally:
        process.kill()


def test_the_load_script_finds_the_same_answers_both_ways(server):
    root = Path(__file__).resolve().parent.parent
    done = subprocess.run([sys.executable, "scripts/serve_load.py", "--url", server.url, "--requests", "3",
                           "--max-tokens", "6"], cwd=root, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert lines[0].startswith("3 requests, ") and "all at once" in lines[0] and "one at a time" in lines[0]
    assert lines[1] == "same greedy answer both ways: 3 of 3"
    refused = subprocess.run([sys.executable, "scripts/serve_load.py", "--requests", "0"], cwd=root,
                             capture_output=True, text=True, timeout=600)
    assert refused.returncode == 2 and "--requests must be in [1, 14], got 0" in refused.stderr
