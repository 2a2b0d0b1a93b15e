"""No request can hurt the server or another request: bad text, tiny temperatures, malformed HTTP, clients that
hang up or never finish sending, too many requests, a failure inside one request, shutdown with streams in flight;
with the official `openai` client as well as raw HTTP."""

from __future__ import annotations

import http.client
import json
import logging
import os
import queue
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import openai
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from playground import api
from playground.api import ChatRequest, CompletionRequest, parse_job
from playground.config import EngineParams, GenerationParams, SamplingParams
from playground.decoding import encode_prompt
from playground.engine import Engine
from playground.server import ApiError, EngineWorker, Job

from .test_server import JSON, chat, events, get, post, running, solo

TOKENS = 8
PARAMS = EngineParams(num_blocks=256, block_size=8, max_running=4)


@pytest.fixture(scope="module")
def srv(target):
    with running(target, PARAMS) as service:
        yield service


def raw_exchange(srv, data: bytes, wait_s: float = 30) -> bytes:
    """What the server sends back, until it closes the connection, for raw bytes sent."""
    with socket.create_connection((srv.host, srv.port), timeout=wait_s) as sock:
        sock.sendall(data)
        received = b""
        while chunk := sock.recv(65536):
            received += chunk
    return received


def request_bytes(path: str, body: bytes, headers: str = "", kind: str | None = "application/json") -> bytes:
    typed = f"Content-Type: {kind}\r\n" if kind is not None else ""
    return (f"POST {path} HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\nContent-Length: {len(body)}\r\n"
            f"{typed}{headers}\r\n".encode() + body)


def wait_for(condition, timeout_s: float = 60) -> bool:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def idle(srv) -> bool:
    state = get(srv, "/v1/engine")[1]
    return state["running"] == state["waiting"] == 0 and state["kv"]["blocks_used"] == 0 and srv.worker.held == 0


def test_a_lone_surrogate_is_a_400_and_the_server_stays_up(srv):
    for path, body in [("/v1/completions", b'{"prompt": "abc\\ud800", "max_tokens": 4}'),
                       ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "x\\udfff"}]}'),
                       ("/v1/completions", b'{"prompt": "abc", "stop": ["\\ud800"]}')]:
        status, reply = post(srv, path, None, raw=body)
        assert status == 400 and "must be valid Unicode text" in reply["error"]["message"], reply
        assert reply["error"]["param"] in ("prompt", "messages", "stop")
    assert get(srv, "/health") == (200, {"status": "ok"})
    assert post(srv, "/v1/completions", {"prompt": "Hello", "max_tokens": 2})[0] == 200


def test_a_request_the_tokenizer_cannot_take_fails_alone(target):
    """Past the API's checks (a job submitted directly), the worker still isolates an admission failure."""
    worker = EngineWorker(target, PARAMS)
    thread = threading.Thread(target=worker.run)
    thread.start()
    try:
        bad, good = (Job(SamplingParams(), GenerationParams(max_new_tokens=3, raw=True), False, queue.Queue(),
                         prompt=p) for p in ("abc\ud800", "Hello"))
        worker.submit(bad)
        worker.submit(good)
        error = bad.replies.get(timeout=60).error
        assert error is not None and error.status == 500 and "could not be admitted" in str(error)
        assert good.replies.get(timeout=60).usage["completion_tokens"] == 3
    finally:
        worker.close()
        thread.join()
    assert worker.held == 0


def test_a_tiny_temperature_decodes_greedily(srv, target):
    assert SamplingParams(temperature=1e-38).greedy and SamplingParams(temperature=1e-5).greedy is False
    prompt = "Name three colours."
    bodies = [{"messages": chat(prompt), "max_tokens": TOKENS, "temperature": t, "seed": 1} for t in (1e-38, 1e-300)]
    bodies.append({"messages": chat("Count to five."), "max_tokens": TOKENS})  # a neighbour in the same batch
    with ThreadPoolExecutor(3) as pool:
        replies = list(pool.map(lambda b: post(srv, "/v1/chat/completions", b), bodies))
    assert all(status == 200 for status, _ in replies), replies
    greedy = solo(target, encode_prompt(target, prompt, GenerationParams()), SamplingParams(), TOKENS).text
    assert [r["choices"][0]["message"]["content"] for _, r in replies[:2]] == [greedy, greedy]


@pytest.mark.parametrize("raw, message", [
    (b'{"prompt": "hi", "max_tokens": ' + b"9" * 5000 + b"}", "an integer too long to read"),
    (b"[" * 100_000 + b"]" * 100_000, "nested too deeply"),
    (b'{"prompt": "hi", "temperature": 1e400}', "temperature: Input should be a finite number"),
    (b'{"prompt": "hi", "top_p": NaN}', "top_p: Input should be a finite number"),
    (b'\xff\xfe', "not valid JSON"),
])
def test_malformed_bodies_get_json_400s(srv, raw, message):
    status, reply = post(srv, "/v1/completions", None, raw=raw)
    assert status == 400 and message in reply["error"]["message"]


def test_malformed_http_gets_an_answer(srv):
    reply = raw_exchange(srv, b"POST /v1/completions HTTP/1.1\r\nHost: localhost\r\nContent-Length: \xb2\r\n\r\n{}")
    assert reply.startswith(b"HTTP/1.1 400") and b"application/json" in reply
    assert json.loads(reply.split(b"\r\n\r\n", 1)[1])["error"]["message"].startswith("the request is not valid HTTP")
    too_big = request_bytes("/v1/completions", b"", f"X-Pad: {'a' * 70_000}\r\n")
    assert raw_exchange(srv, too_big).startswith(b"HTTP/1.1 4")
    status, reply = post(srv, "/v1/completions", None, raw=b'{"prompt": "' + b"a" * (1 << 20) + b'"}')
    assert status == 413 and "at most 1048576 bytes" in reply["error"]["message"]


def test_idle_connections_cannot_lock_clients_out(srv, monkeypatch):
    """Connections that send nothing: past MAX_FRESH of them each new one closes the oldest, so a client that keeps
    reopening them never starves real requests; past MAX_CONNECTIONS in all, a JSON 503 with Retry-After."""
    monkeypatch.setattr(api, "MAX_FRESH", 8)
    idlers = [socket.create_connection((srv.host, srv.port), timeout=10) for _ in range(40)]
    try:
        for _ in range(3):  # a client reopening what was closed
            for i, sock in enumerate(idlers):
                sock.setblocking(False)
                try:
                    closed = sock.recv(1) == b""
                except BlockingIOError:
                    closed = False
                if closed:
                    sock.close()
                    idlers[i] = socket.create_connection((srv.host, srv.port), timeout=10)
            assert get(srv, "/health") == (200, {"status": "ok"})
            assert post(srv, "/v1/completions", {"prompt": "Hello", "max_tokens": 2})[0] == 200
        open_now = sum(1 for c in api._OPEN[srv.http.server_state] if c.fresh)
        assert open_now <= 8
        monkeypatch.setattr(api, "MAX_CONNECTIONS", 1)  # the idle ones are open: a new one is past it
        refused = raw_exchange(srv, b"")
        head, body = refused.split(b"\r\n\r\n", 1)
        assert head.startswith(b"HTTP/1.1 503") and b"retry-after: 1" in head.lower()
        assert "connections, its most" in json.loads(body)["error"]["message"]
    finally:
        for sock in idlers:
            sock.close()


def test_only_json_from_this_machines_names_is_served(srv):
    """A web page elsewhere cannot use a server bound to this machine: its DNS-rebound Host is refused, a body that
    is not JSON (a form, text/plain: sent without asking the server first) too; no redirect, schema or docs page."""
    body = json.dumps({"prompt": "hi", "max_tokens": 2}).encode()
    evil = raw_exchange(srv, request_bytes("/v1/completions", body, "Origin: http://evil.example\r\n").replace(
        b"Host: localhost", b"Host: evil.example"))
    assert evil.startswith(b"HTTP/1.1 403") and b"is not one this server answers to" in evil
    assert b"access-control" not in evil.lower()
    for kind in ("text/plain", "application/x-www-form-urlencoded", "multipart/form-data; boundary=x", None):
        reply = raw_exchange(srv, request_bytes("/v1/completions", body, kind=kind))
        assert reply.startswith(b"HTTP/1.1 415") and b"Content-Type must be application/json" in reply, kind
    for origin in ("http://evil.example", "null", "http://localhost:8000", "not an origin"):
        reply = raw_exchange(srv, request_bytes("/v1/completions", body, f"Origin: {origin}\r\n"))
        assert reply.startswith(b"HTTP/1.1 403") and b"requests from web pages at" in reply, origin
        assert b"access-control" not in reply.lower()
    served = raw_exchange(srv, request_bytes("/v1/completions", body))
    assert served.startswith(b"HTTP/1.1 200")
    for path in ("/openapi.json", "/docs", "/redoc", "/health/"):
        status, reply = get(srv, path)
        assert status == 404 and "no such endpoint" in reply["error"]["message"], path
    assert post(srv, "/v1/completions/", {"prompt": "hi"})[0] == 404
    assert api.hosts_for("127.0.0.1", None) == api.hosts_for("::1", None) == api.LOCAL_HOSTS
    assert api.hosts_for("0.0.0.0", None) is None and api.hosts_for("127.0.0.1", ("*",)) is None
    assert api.hosts_for("127.0.0.1", ("Box.example:8000",)) == ("box.example",)
    assert [api.host_name(h) for h in ("[::1]:80", "LOCALHOST", "a.b:1")] == ["[::1]", "localhost", "a.b"]


def test_a_head_over_the_limit_is_a_431_however_it_arrives(srv):
    line = f"X-Pad: {'a' * 70_000}\r\n"
    whole = raw_exchange(srv, request_bytes("/v1/completions", b"{}", line))
    with socket.create_connection((srv.host, srv.port), timeout=30) as sock:  # in pieces, as a slow client
        for piece in (b"GET /health HTTP/1.1\r\nHost: localhost\r\n", line.encode()[:9000], line.encode()[9000:]):
            try:
                sock.sendall(piece)
            except OSError:
                break  # closed as soon as the head passed the limit
            time.sleep(0.05)
        pieces = b""
        while chunk := sock.recv(65536):
            pieces += chunk
    for reply in (whole, pieces):
        assert reply.startswith(b"HTTP/1.1 431") and b"at most 16384 bytes" in reply


def test_a_body_too_large_is_answered_once(srv):
    """A 10 MB upload refused by its length: one 413, and the rest of the body, arriving after it, is read to its
    end and dropped, never as a further request (it was once, and answered with a 431); the connection then serves
    the next request."""
    size, chunk = 10 * 2**20, 1 << 16
    with socket.create_connection((srv.host, srv.port), timeout=30) as sock:
        sock.sendall(request_bytes("/v1/completions", b"").replace(b"Connection: close\r\n", b"").replace(
            b"Content-Length: 0", f"Content-Length: {size}".encode()))  # a connection kept alive
        for _ in range(size // chunk):
            sock.sendall(b"a" * chunk)
            time.sleep(0.001)  # arriving after the answer, as over a real network
        sock.sendall(request_bytes("/v1/completions", json.dumps({"prompt": "Hi", "max_tokens": 2}).encode()))
        received = b""
        while data := sock.recv(65536):
            received += data
    assert re.findall(rb"HTTP/1\.1 (\d{3}) ", received) == [b"413", b"200"], received[:600]


def test_a_field_name_or_label_that_is_not_unicode_is_named(srv):
    for body, message, param in [
            ('{"prompt": "hi", "\\ud800": 1}', "a field name is not valid Unicode (a lone surrogate", None),
            ('{"prompt": "hi", "metadata": {"k\\udc00": "v"}}', "a field name in metadata is not valid Unicode",
             "metadata"),
            ('{"prompt": "hi", "user": "a\\ud800"}', "user must be valid Unicode text", "user"),
            ('{"prompt": "hi", "metadata": {"k": "\\udfff"}}', "metadata.k must be valid Unicode text", "metadata")]:
        status, reply = post(srv, "/v1/completions", None, raw=body.encode())
        assert status == 400 and reply["error"]["message"].startswith(message), (body, reply)
        assert reply["error"]["param"] == param, (body, reply)


def test_a_page_at_an_allowed_origin_may_use_the_server(target):
    with running(target, PARAMS, allowed_origins=("http://app.example:3000",)) as service:
        connection = http.client.HTTPConnection(service.host, service.port, timeout=120)
        connection.request("POST", "/v1/completions", json.dumps({"prompt": "Hi", "max_tokens": 2}),
                           {**JSON, "Origin": "http://app.example:3000"})
        response = connection.getresponse()
        assert response.status == 200 and response.getheader("access-control-allow-origin") == \
            "http://app.example:3000"
        response.read()
        connection.request("POST", "/v1/completions", "{}", {**JSON, "Origin": "http://app.example:3001"})
        assert connection.getresponse().status == 403


def test_a_client_that_hangs_up_mid_body_leaves_no_traceback(srv, caplog):
    uvicorn_log = logging.getLogger("uvicorn.error")  # uvicorn's loggers do not reach the root's handlers
    uvicorn_log.addHandler(caplog.handler)
    try:
        with socket.create_connection((srv.host, srv.port)) as sock:
            sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\n"
                         b"Content-Length: 100\r\n\r\n{")
            time.sleep(0.3)
        time.sleep(0.5)
        assert get(srv, "/health")[0] == 200
    finally:
        uvicorn_log.removeHandler(caplog.handler)
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR], caplog.text


@pytest.mark.parametrize("method", ["HEAD", "OPTIONS", "PUT", "DELETE", "PATCH"])
def test_other_methods_get_a_json_405(srv, method):
    connection = http.client.HTTPConnection(srv.host, srv.port, timeout=30)
    connection.request(method, "/v1/completions")
    response = connection.getresponse()
    body = response.read()
    assert response.status == 405 and response.getheader("Content-Type") == "application/json"
    if method != "HEAD":
        assert json.loads(body)["error"]["message"] == f"/v1/completions takes POST, not {method}"


def test_a_client_that_never_finishes_its_request_is_dropped(srv, monkeypatch):
    monkeypatch.setattr(api, "HEAD_TIMEOUT_S", 0.5)
    monkeypatch.setattr(api, "BODY_TIMEOUT_S", 0.5)
    threads = threading.active_count()
    sockets = [socket.create_connection((srv.host, srv.port)) for _ in range(100)]
    try:
        for sock in sockets:
            sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: localhost\r\n")  # a head that never ends
        assert threading.active_count() == threads  # no thread per connection
        for sock in sockets:
            sock.settimeout(10)
            try:  # closed by the server: at its deadline, or before, as the oldest of more than MAX_FRESH idlers
                assert sock.recv(1024) == b""
            except ConnectionResetError:  # closed with the head's bytes unread: a reset, as good a close
                pass
    finally:
        for sock in sockets:
            sock.close()
    with socket.create_connection((srv.host, srv.port), timeout=10) as sock:  # a body that never ends
        sent = time.monotonic()
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\n"
                     b"Content-Length: 100\r\n\r\n{\"prompt\"")
        reply = b""
        while b"}}" not in reply and (chunk := sock.recv(65536)):  # the head and the JSON body may come apart
            reply += chunk
        waited = time.monotonic() - sent
    assert reply.startswith(b"HTTP/1.1 408") and b"did not arrive within" in reply
    assert waited < api.BODY_TIMEOUT_S + 2, waited  # at the deadline, not seconds after it
    assert get(srv, "/health")[0] == 200


def test_a_kept_alive_connection_has_a_deadline_for_each_head_and_none_for_an_answer(srv, monkeypatch):
    """The guard in front of uvicorn's protocol reads nothing of uvicorn's state: a head's deadline runs from its
    first byte, so a long answer is never cut while the client waits, and a second request whose head trickles is
    dropped at its deadline."""
    from uvicorn.protocols.http.h11_impl import H11Protocol

    assert not issubclass(api.Guarded, H11Protocol)
    monkeypatch.setattr(api, "HEAD_TIMEOUT_S", 0.2)
    body = json.dumps({"prompt": "Count from one to a hundred.", "max_tokens": 160}).encode()
    with socket.create_connection((srv.host, srv.port), timeout=30) as sock:
        sent = time.monotonic()
        sock.sendall(request_bytes("/v1/completions", body).replace(b"Connection: close\r\n", b""))
        reply = b""
        while b'"usage"' not in reply and (chunk := sock.recv(65536)):
            reply += chunk
        assert reply.startswith(b"HTTP/1.1 200") and time.monotonic() - sent > api.HEAD_TIMEOUT_S  # answered whole
        sock.sendall(b"GET /health HTTP/1.1\r\n")  # a second head that never ends
        started = time.monotonic()
        assert sock.recv(1024) == b"" and time.monotonic() - started < api.HEAD_TIMEOUT_S + 2


def test_a_non_streaming_client_that_hangs_up_stops_its_request(srv):
    finished = get(srv, "/v1/engine")[1]["finished"]
    sock = socket.create_connection((srv.host, srv.port))
    sock.sendall(request_bytes("/v1/completions", json.dumps({"prompt": "1, 2, 3,", "max_tokens": 1000}).encode()))
    assert wait_for(lambda: get(srv, "/v1/engine")[1]["running"] == 1)
    sock.close()
    assert wait_for(lambda: idle(srv), 30)
    assert get(srv, "/v1/engine")[1]["finished"] == finished  # aborted, not run to its 1000 tokens


def test_the_waiting_queue_is_bounded(target):
    with running(target, EngineParams(num_blocks=256, block_size=8, max_running=1), max_waiting=1) as service:
        holders = [socket.create_connection((service.host, service.port)) for _ in range(2)]
        for sock in holders:  # one running, one waiting
            sock.sendall(request_bytes("/v1/completions",
                                       json.dumps({"prompt": "1, 2,", "max_tokens": 1000, "stream": True}).encode()))
        assert wait_for(lambda: service.worker.held == 2)
        connection = http.client.HTTPConnection(service.host, service.port, timeout=30)
        connection.request("POST", "/v1/completions", json.dumps({"prompt": "Hi", "max_tokens": 2}), JSON)
        response = connection.getresponse()
        assert response.status == 503 and response.getheader("Retry-After") == "1"
        assert "holds 2 requests, its most" in json.loads(response.read())["error"]["message"]
        for sock in holders:
            sock.close()
        assert wait_for(lambda: idle(service), 30)
        assert post(service, "/v1/completions", {"prompt": "Hi", "max_tokens": 2})[0] == 200


def test_an_api_key_is_required_when_set(target):
    with running(target, PARAMS, api_key="sesame") as service:
        assert get(service, "/health")[0] == 200
        status, reply = get(service, "/v1/models")
        assert status == 401 and reply["error"]["type"] == "authentication_error"
        assert post(service, "/v1/completions", {"prompt": "Hi", "max_tokens": 2})[0] == 401
        client = openai.OpenAI(base_url=f"{service.url}/v1", api_key="sesame", max_retries=0)
        assert client.completions.create(model=target.name, prompt="Hi", max_tokens=2).usage.completion_tokens == 2
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=f"{service.url}/v1", api_key="wrong", max_retries=0).models.list()


def test_the_openai_client_gets_what_raw_http_gets(srv, target):
    client = openai.OpenAI(base_url=f"{srv.url}/v1", api_key="unused", max_retries=0)
    assert [m.id for m in client.models.list().data] == [target.name]
    prompt = "Translate into French: 'Good morning'"
    reply = client.chat.completions.create(model=target.name, messages=chat(prompt), max_tokens=TOKENS)
    expected = post(srv, "/v1/chat/completions", {"messages": chat(prompt), "max_tokens": TOKENS})[1]
    assert reply.choices[0].message.content == expected["choices"][0]["message"]["content"]
    assert reply.usage.completion_tokens == expected["usage"]["completion_tokens"]
    pieces = [c.choices[0].delta.content or "" for c in client.chat.completions.create(
        model=target.name, messages=chat(prompt), max_tokens=TOKENS, stream=True)]
    assert "".join(pieces) == expected["choices"][0]["message"]["content"]
    text = client.completions.create(model=target.name, prompt="One, two,", max_tokens=TOKENS).choices[0].text
    assert text == post(srv, "/v1/completions", {"prompt": "One, two,", "max_tokens": TOKENS})[1]["choices"][0]["text"]
    with pytest.raises(openai.BadRequestError, match="max_tokens must be an integer in"):
        client.completions.create(model=target.name, prompt="Hi", max_tokens=0)


def test_fields_openai_clients_send_are_served(srv, target):
    """stream_options.include_usage ends a stream with a usage chunk; max_completion_tokens is max_tokens; store,
    metadata and service_tier change nothing here."""
    client = openai.OpenAI(base_url=f"{srv.url}/v1", api_key="unused", max_retries=0)
    prompt = "Name a colour."
    expected = post(srv, "/v1/chat/completions", {"messages": chat(prompt), "max_tokens": TOKENS})[1]
    chunks = list(client.chat.completions.create(model=target.name, messages=chat(prompt), max_completion_tokens=TOKENS,
                                                 stream=True, stream_options={"include_usage": True}, store=False,
                                                 metadata={"run": "test"}, service_tier="auto"))
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == expected["usage"]["completion_tokens"]
    text = "".join(c.choices[0].delta.content or "" for c in chunks[:-1])
    assert text == expected["choices"][0]["message"]["content"]
    plain = client.chat.completions.create(model=target.name, messages=chat(prompt), max_completion_tokens=TOKENS)
    assert plain.choices[0].message.content == text


def test_a_failure_inside_one_request_ends_it_alone(target):
    """A request whose sampling fails mid-batch ends with an error; its neighbours get their solo tokens."""
    engine = Engine(target, PARAMS)
    prompts = ["Name a fruit.", "Name a river.", "Name a city."]
    ids = [engine.add_request(p, generation=GenerationParams(max_new_tokens=TOKENS)) for p in prompts]
    broken = engine.requests[ids[1]]
    pushes = broken.stopper.push

    def fail_on_third(token: int) -> bool:
        if len(broken.stopper.tokens) == 2:
            raise RuntimeError("simulated sampling failure")
        return pushes(token)
    broken.stopper.push = fail_on_third
    outputs, errors = {}, {}
    for out in engine.stream():
        if out.error is not None:
            errors[out.id] = out.error
        elif out.finished:
            outputs[out.id] = out.output
    assert errors == {ids[1]: "RuntimeError: simulated sampling failure"}
    for rid, prompt in zip((ids[0], ids[2]), (prompts[0], prompts[2])):
        expected = solo(target, encode_prompt(target, prompt, GenerationParams()), SamplingParams(), TOKENS)
        assert outputs[rid].token_ids == expected.token_ids
    assert engine.cache.memory().blocks_used == 0
    engine.add_request(prompts[0], generation=GenerationParams(max_new_tokens=TOKENS))

    def fail(token: int) -> bool:
        raise RuntimeError("simulated")
    engine.requests[max(engine.requests)].stopper.push = fail
    with pytest.raises(RuntimeError, match=r"request \d+ failed: RuntimeError: simulated"):
        engine.run_all()


JSON_VALUES = st.recursive(st.none() | st.booleans() | st.integers() | st.floats() | st.text(),
                           lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(), inner, max_size=3),
                           max_leaves=8)
FIELDS = ["prompt", "messages", "model", "max_tokens", "temperature", "top_p", "top_k", "seed", "stop", "stream",
          "user", "n", "logprobs", "echo", "role", "content", "frequency_penalty", "max_completion_tokens",
          "stream_options", "include_usage", "store", "metadata", "service_tier"]
BODIES = st.dictionaries(st.sampled_from(FIELDS), JSON_VALUES | st.lists(st.fixed_dictionaries(
    {"role": st.sampled_from(["user", "system", "robot"]), "content": JSON_VALUES}), max_size=2)
    | st.fixed_dictionaries({"include_usage": JSON_VALUES}), max_size=6)  # stream_options' one field


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(body=BODIES | JSON_VALUES, chat_endpoint=st.booleans(), surrogate=st.booleans())
def test_fuzzed_request_bodies_are_a_job_or_a_400(body, chat_endpoint, surrogate):
    raw = json.dumps(body, allow_nan=True)
    if surrogate:
        raw = raw.replace("a", "\\ud800")
    try:
        job, usage_chunk = parse_job(raw.encode(), ChatRequest if chat_endpoint else CompletionRequest, ("m",), None)
    except ApiError as exc:
        assert exc.status in (400, 404) and str(exc) and "\n" not in str(exc) and len(str(exc)) < 400
    else:
        assert isinstance(job, Job) and 1 <= job.generation.max_new_tokens <= 4096
        assert job.stream or not usage_chunk


def test_32_streams_some_hanging_up(srv, target):
    """A bounded load beside 200 sockets opened and left idle: 32 streams at once, every fourth client hanging up
    after its first piece; the server stays up, the rest get the CLI's greedy answers, and every KV block comes
    back."""
    prompts = [f"Write one sentence about the number {i}." for i in range(32)]
    idlers = [socket.create_connection((srv.host, srv.port)) for _ in range(200)]

    def one(i: int) -> str | None:
        body = {"messages": chat(prompts[i]), "max_tokens": TOKENS, "stream": True}
        if i % 4:
            return "".join(c["choices"][0]["delta"]["content"] for c in events(srv, "/v1/chat/completions", body)[:-1])
        with socket.create_connection((srv.host, srv.port), timeout=60) as sock:
            sock.sendall(request_bytes("/v1/chat/completions", json.dumps(body).encode()))
            while b"data: " not in sock.recv(4096):
                pass
        return None
    try:
        assert get(srv, "/health") == (200, {"status": "ok"})
        with ThreadPoolExecutor(32) as pool:
            texts = list(pool.map(one, range(32)))
    finally:
        for sock in idlers:
            sock.close()
    for i, text in enumerate(texts):
        if text is not None:
            ids = encode_prompt(target, prompts[i], GenerationParams())
            assert text == solo(target, ids, SamplingParams(), TOKENS).text, i
    assert wait_for(lambda: idle(srv), 60)
    assert get(srv, "/health")[0] == 200


def test_sigterm_ends_streams_with_an_error_and_done():
    root = Path(__file__).resolve().parent.parent
    process = subprocess.Popen([sys.executable, "-m", "playground", "serve", "--port", "0", "--max-running", "2"],
                               cwd=root, stderr=subprocess.PIPE, text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    try:
        line = ""
        while "Serving" not in line:
            line = process.stderr.readline()
            assert line, "the server exited before serving"
        host, port = line.split(" at ", 1)[1].split()[0].removeprefix("http://").split(":")
        sock = socket.create_connection((host, int(port)), timeout=60)
        sock.sendall(request_bytes("/v1/completions",
                                   json.dumps({"prompt": "1, 2, 3,", "max_tokens": 2000, "stream": True}).encode()))
        received = b""
        while b"data: " not in received:
            received += sock.recv(4096)
        process.send_signal(signal.SIGTERM)
        while chunk := sock.recv(65536):
            received += chunk
        sock.close()
        assert b'"error"' in received and b"the server is shutting down" in received
        assert b"data: [DONE]\n\n" in received and received.endswith(b"0\r\n\r\n")  # the last chunk: a clean end
        assert process.wait(timeout=60) == 0
        assert "Stopped." in process.stderr.read()
    finally:
        process.kill()
