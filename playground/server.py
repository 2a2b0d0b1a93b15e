"""An HTTP server over the continuous-batching engine: `python -m playground serve`.

The endpoints follow OpenAI's API, so its client libraries and curl work against a local model:

    POST /v1/completions        {"prompt": "..."}: the prompt as is, no chat template
    POST /v1/chat/completions   {"messages": [{"role": ..., "content": ...}, ...]}: the tokenizer's chat template
    GET  /v1/models             the model served
    GET  /v1/engine             the engine now: requests running and waiting, KV blocks and bytes, steps, seconds
    GET  /health                {"status": "ok"}

Both POST endpoints take max_tokens (1..4096, default 128), temperature (0..100, default 0: greedy, so a request
gets exactly plain decoding's tokens), top_p, top_k (0 = off), seed, stop (a string or a list of up to 4) and
stream (server-sent events in OpenAI's chunk format, then `data: [DONE]`). Fields OpenAI clients send by default
(n, penalties, logprobs, ...) are accepted at the value that changes nothing and refused otherwise; bad input gets
status 400 and {"error": {"message", "type", "param"}} naming the field and its allowed range.

Threads: the engine and the tokenizer are not thread-safe, so one thread owns both (`EngineWorker.run`; the command
runs it on the main thread, which loaded the model, and the HTTP server on another). It admits submitted requests,
steps the engine while any is unfinished, and hands each request's text to the thread serving its HTTP connection
through a queue. A request that arrives while others decode joins the running batch at the next step:
that is continuous batching, and every request still gets the tokens it would get alone (greedy, or sampled from
its own seed), as tests/test_engine.py checks.
"""

from __future__ import annotations

import json
import queue
import sys
import threading
import time
import traceback
import uuid
from dataclasses import asdict, dataclass, field
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from .config import MAX_NEW_TOKENS_LIMIT, ConfigError, EngineParams, GenerationParams, SamplingParams, check_int
from .decoding.base import chat_ids, check_context
from .engine import Engine, RequestOutput
from .kv import blocks_for
from .models import LoadedModel

MAX_BODY_BYTES = 1 << 20
MAX_STOP_STRINGS = 4
DEFAULT_MAX_TOKENS = 128
CHAT_ROLES = ("system", "user", "assistant")
# user: a client's label for its end user, which changes nothing here
OPTIONS = ("model", "max_tokens", "temperature", "top_p", "top_k", "seed", "stop", "stream", "user")
# Fields OpenAI clients may send on their own: accepted only at the value that changes nothing here.
NEUTRAL = {"n": (1,), "best_of": (1,), "presence_penalty": (0,), "frequency_penalty": (0,), "logprobs": (False, 0),
           "top_logprobs": (0,), "echo": (False,), "suffix": ("",), "logit_bias": ({},), "parallel_tool_calls": (False,)}
FINISH_REASONS = {"eos": "stop", "stop": "stop", "length": "length"}  # ours -> OpenAI's
# An idle engine thread wakes this often: a Ctrl+C that the kernel hands to another thread (HTTP, OpenMP workers)
# only sets Python's flag, which the main thread reads when it next runs, not while it sleeps on a queue.
IDLE_WAKE_S = 0.25
ROUTES = {"GET": ("/health", "/v1/models", "/v1/engine"), "POST": ("/v1/completions", "/v1/chat/completions")}


class ApiError(Exception):
    """A request the server refuses: an HTTP status and OpenAI's error object."""

    def __init__(self, message: str, param: str | None = None, status: int = HTTPStatus.BAD_REQUEST,
                 kind: str = "invalid_request_error") -> None:
        super().__init__(message)
        self.param, self.status, self.kind = param, status, kind

    def body(self) -> dict[str, Any]:
        return {"error": {"message": str(self), "type": self.kind, "param": self.param, "code": None}}


def api_error(exc: Exception) -> ApiError:
    """A refused request's error. A `ConfigError`'s message starts with the field it names and gives its range."""
    if isinstance(exc, ApiError):
        return exc
    name = str(exc).split(" ", 1)[0]
    return ApiError(str(exc), param=name if name in OPTIONS else None)


def settled_text(text: str, stop: tuple[str, ...]) -> str:
    """The part of a growing decoded text that the tokens still to come will not change, which streaming may send:
    without trailing U+FFFD (a character whose bytes are not all generated yet), trailing whitespace (a detokenizer
    may drop a space before the punctuation that follows it) or a tail that may begin a stop string (the final text
    is cut before a stop string)."""
    while True:
        cut = text.rstrip().rstrip("\ufffd")
        for s in stop:
            starts = [k for k in range(1, min(len(s), len(cut) + 1)) if cut.endswith(s[:k])]
            if starts:
                cut = cut[: len(cut) - max(starts)]
        if cut == text:
            return text
        text = cut


@dataclass(frozen=True, slots=True, eq=False)
class Job:
    """One HTTP request to complete: what the worker needs, and the queue its replies go to."""

    sampling: SamplingParams
    generation: GenerationParams
    stream: bool
    prompt: str | None = None  # /v1/completions
    messages: list[dict[str, str]] | None = None  # /v1/chat/completions
    replies: queue.Queue = field(default_factory=queue.Queue)


@dataclass(frozen=True, slots=True)
class Reply:
    """Text for a job: a piece of the stream, or (finish_reason set) the rest of it and the usage; or an error."""

    text: str = ""
    finish_reason: str | None = None
    usage: dict[str, int] | None = None
    error: ApiError | None = None


@dataclass(eq=False)
class Running:
    """The worker's record of an admitted job."""

    job: Job
    prompt_tokens: int
    tokens: list[int] = field(default_factory=list)
    sent: str = ""  # text streamed so far


class EngineWorker:
    """Owns the engine: `run` admits jobs, steps the engine while any is unfinished and routes the text, until
    `close`.

    Run it on the thread that loaded the model. OpenMP (PyTorch's and the native kernels') keeps a pool of worker
    threads for every thread that starts parallel work; once a process holds more such threads than cores, a thread
    waiting at one of the layer stack's barriers sleeps in the kernel almost at once instead of spinning, and each
    wake-up costs tens of microseconds: on a 2-core Zen 3 EPYC an engine step took 25-26 ms on a second thread
    against 16.5-17.9 on the thread that had loaded the model.
    """

    def __init__(self, target: LoadedModel, params: EngineParams) -> None:
        self.target, self.params = target, params
        self.engine = Engine(target, params, record_blocks=False)
        self.finished = 0
        self._inbox: queue.Queue[Job | None] = queue.Queue()  # None: close
        self._cancelled: queue.Queue[Job] = queue.Queue()
        self._running: dict[int, Running] = {}  # engine request id -> its record
        self.state = self._snapshot()

    def submit(self, job: Job) -> None:
        self._inbox.put(job)

    def cancel(self, job: Job) -> None:
        """The client went away: stop decoding for it (a job already finished or refused is left alone)."""
        self._cancelled.put(job)

    def close(self) -> None:
        """Make `run` return (from any thread)."""
        self._inbox.put(None)

    def run(self) -> None:
        """Serve jobs until `close` (or an exception such as Ctrl+C's); the requests in flight then get a 503."""
        try:
            while True:
                jobs = self._arrivals()
                if None in jobs:
                    for job in jobs:  # jobs that came with the close: answered below with those still queued
                        if job is not None:
                            self._inbox.put(job)
                    return
                for job in jobs:
                    self._admit(job)
                self._abort_cancelled()
                if self.engine.has_unfinished():
                    self._step()
                self.state = self._snapshot()
        finally:
            closing = ApiError("the server is shutting down", status=HTTPStatus.SERVICE_UNAVAILABLE,
                               kind="server_error")
            self._fail_all(closing)
            while True:  # and the jobs submitted but not admitted
                try:
                    job = self._inbox.get_nowait()
                except queue.Empty:
                    break
                if job is not None:
                    job.replies.put(Reply(error=closing))

    # -- the engine's thread -----------------------------------------------------------------------------------

    def _arrivals(self) -> list[Job | None]:
        """Jobs submitted since the last step; when the engine is idle, wait for the next one."""
        jobs: list[Job | None] = []
        while not jobs and not self.engine.has_unfinished():
            try:
                jobs.append(self._inbox.get(timeout=IDLE_WAKE_S))
            except queue.Empty:
                pass
        while True:
            try:
                jobs.append(self._inbox.get_nowait())
            except queue.Empty:
                return jobs

    def _admit(self, job: Job) -> None:
        try:
            prompt_ids = self._encode(job)
            request_id = self.engine.add_request(prompt_ids, job.sampling, job.generation)
        except (ApiError, ConfigError) as exc:
            job.replies.put(Reply(error=api_error(exc)))
            return
        self._running[request_id] = Running(job, len(prompt_ids))

    def _encode(self, job: Job) -> list[int]:
        """The job's prompt ids, checked against the context and the KV pool with the API's field names."""
        tokenizer = self.target.tokenizer
        if job.messages is not None:
            if not self.target.chat:
                raise ApiError(f"messages: {self.target.name}'s tokenizer has no chat template; send a prompt to "
                               "/v1/completions instead", param="messages")
            ids = chat_ids(tokenizer, job.messages)
        else:
            ids = list(tokenizer(job.prompt).input_ids)
        max_tokens = job.generation.max_new_tokens
        try:
            check_context(self.target, len(ids), max_tokens, field="max_tokens")
        except ConfigError as exc:
            raise ApiError(str(exc), param="max_tokens") from exc
        need = blocks_for(len(ids) + max_tokens, self.params.block_size)
        if need > self.params.num_blocks:
            raise ApiError(f"max_tokens: prompt tokens + max_tokens ({len(ids)} + {max_tokens}) need {need} KV blocks "
                           f"of {self.params.block_size} tokens and this server's pool holds {self.params.num_blocks} "
                           "(its --num-blocks); ask for fewer tokens", param="max_tokens")
        return ids

    def _abort_cancelled(self) -> None:
        while True:
            try:
                job = self._cancelled.get_nowait()
            except queue.Empty:
                return
            # a job finished or refused meanwhile has no record: nothing to stop
            request_id = next((rid for rid, record in self._running.items() if record.job is job), None)
            if request_id is not None:
                del self._running[request_id]
                self.engine.abort(request_id)
                self.engine.forget(request_id)

    def _step(self) -> None:
        try:
            outputs = self.engine.step()
        except Exception as exc:  # a bug or the device out of memory: fail the requests in flight, keep serving
            traceback.print_exc()
            self.engine = Engine(self.target, self.params, record_blocks=False, heads=self.engine.heads,
                                 draft=self.engine.draft)
            self._fail_all(ApiError(f"the engine failed: {exc}", status=HTTPStatus.INTERNAL_SERVER_ERROR,
                                    kind="server_error"))
            return
        self.engine.take_events()  # a server keeps no history; the state it reports is read from the cache
        for output in outputs:
            self._deliver(output)

    def _deliver(self, output: RequestOutput) -> None:
        record = self._running[output.id]
        record.tokens.extend(output.new_token_ids)
        job = record.job
        if output.finished:
            del self._running[output.id]
            self.engine.forget(output.id)
            self.finished += 1
            usage = {"prompt_tokens": record.prompt_tokens, "completion_tokens": len(record.tokens),
                     "total_tokens": record.prompt_tokens + len(record.tokens)}
            # the rest of the text: all of it unless pieces were streamed
            job.replies.put(Reply(output.output.text[len(record.sent):], FINISH_REASONS[output.output.finish_reason],
                                  usage))
        elif job.stream:
            text = self.target.tokenizer.decode(record.tokens, skip_special_tokens=True)
            settled = settled_text(text, job.generation.stop)
            if len(settled) > len(record.sent) and settled.startswith(record.sent):
                job.replies.put(Reply(settled[len(record.sent):]))
                record.sent = settled

    def _fail_all(self, error: ApiError) -> None:
        """Answer every admitted job with an error."""
        for record in self._running.values():
            record.job.replies.put(Reply(error=error))
        self._running.clear()

    def _snapshot(self) -> dict[str, Any]:
        engine = self.engine
        memory = engine.cache.memory()
        return {"model": self.target.name, "running": len(engine.running), "waiting": len(engine.waiting),
                "finished": self.finished, "steps": engine.step_count, "engine_s": round(engine.busy_s, 3),
                "kv": {"block_size": self.params.block_size, "blocks_total": memory.blocks_total,
                       "blocks_used": memory.blocks_used, "blocks_shared": memory.blocks_shared,
                       "bytes_used": memory.bytes_used, "bytes_reserved": memory.bytes_reserved},
                "params": {"num_blocks": self.params.num_blocks, "block_size": self.params.block_size,
                           "max_running": self.params.max_running, "max_batch_tokens": self.params.max_batch_tokens,
                           "prefix_caching": self.params.prefix_caching},
                "prompt_lookup": None if engine.lookup is None else {
                    "max_ngram": engine.lookup.max_ngram, "num_draft": engine.lookup.num_draft,
                    **asdict(engine.copied)},
                "medusa": None if engine.heads is None else {
                    "heads": str(engine.heads.folder), "depth": engine.depth, **asdict(engine.guessed)},
                "draft": None if engine.draft is None else {
                    "draft": engine.draft.name, "gamma": engine.depth, **asdict(engine.guessed)},
                "lookahead": None if engine.lookahead is None else {
                    "window": engine.lookahead.window, "ngram": engine.lookahead.ngram,
                    "guesses": engine.lookahead.guesses, "text_ngram": engine.lookahead.text_n,
                    **asdict(engine.copied)}}


# -- requests ----------------------------------------------------------------------------------------------------


def option(body: dict[str, Any], name: str, default: Any) -> Any:
    """A request field; JSON null counts as not given, as OpenAI's API has it."""
    value = body.get(name)
    return default if value is None else value


def check_fields(body: dict[str, Any], allowed: tuple[str, ...], model_ids: tuple[str, ...]) -> None:
    for name, value in body.items():
        if name in allowed or value is None:
            continue
        if name in NEUTRAL:
            if value not in NEUTRAL[name]:
                raise ApiError(f"{name} is not supported by this server (only {NEUTRAL[name][0]!r})", param=name)
            continue
        raise ApiError(f"unknown field {name!r}; this endpoint takes {', '.join(allowed)}", param=name)
    model = body.get("model")
    if model is not None and model not in model_ids:
        raise ApiError(f"model must be {' or '.join(repr(m) for m in model_ids)} (the model this server runs), "
                       f"got {model!r}", param="model", status=HTTPStatus.NOT_FOUND)


def parse_job(body: Any, chat: bool, model_ids: tuple[str, ...]) -> Job:
    """A validated job from a request body; ApiError or ConfigError names the field that is wrong."""
    if not isinstance(body, dict):
        raise ApiError("the request body must be a JSON object")
    text_field = "messages" if chat else "prompt"
    check_fields(body, (text_field, *OPTIONS), model_ids)
    max_tokens = option(body, "max_tokens", DEFAULT_MAX_TOKENS)
    check_int("max_tokens", max_tokens, 1, MAX_NEW_TOKENS_LIMIT)
    stop = option(body, "stop", [])
    stop = [stop] if isinstance(stop, str) else stop
    if not isinstance(stop, list) or len(stop) > MAX_STOP_STRINGS or not all(isinstance(s, str) and s for s in stop):
        raise ApiError(f"stop must be a non-empty string or a list of 1..{MAX_STOP_STRINGS} of them", param="stop")
    stream = option(body, "stream", False)
    if not isinstance(stream, bool):
        raise ApiError(f"stream must be true or false, got {stream!r}", param="stream")
    sampling = SamplingParams(temperature=option(body, "temperature", 0.0), top_k=option(body, "top_k", 0),
                              top_p=option(body, "top_p", 1.0), seed=body.get("seed"))
    generation = GenerationParams(max_new_tokens=max_tokens, stop=tuple(stop), raw=True)
    if chat:
        return Job(sampling, generation, stream, messages=parse_messages(body.get("messages")))
    prompt = body.get("prompt")
    if not isinstance(prompt, str) or not prompt.strip():
        raise ApiError("prompt must be a non-empty string", param="prompt")
    return Job(sampling, generation, stream, prompt=prompt)


def parse_messages(messages: Any) -> list[dict[str, str]]:
    if not isinstance(messages, list) or not messages:
        raise ApiError('messages must be a non-empty list of {"role": ..., "content": ...}', param="messages")
    for i, message in enumerate(messages):
        if not isinstance(message, dict) or set(message) != {"role", "content"}:
            raise ApiError(f'messages[{i}] must be an object with "role" and "content"', param="messages")
        if message.get("role") not in CHAT_ROLES:
            raise ApiError(f"messages[{i}].role must be one of {', '.join(CHAT_ROLES)}; got {message.get('role')!r}",
                           param="messages")
        if not isinstance(message.get("content"), str):
            raise ApiError(f"messages[{i}].content must be a string", param="messages")
    if not any(m["content"].strip() for m in messages):
        raise ApiError("messages must hold some text", param="messages")
    return [{"role": m["role"], "content": m["content"]} for m in messages]


# -- HTTP ----------------------------------------------------------------------------------------------------------


class PlaygroundServer(ThreadingHTTPServer):
    """Listens as soon as it is made (so a taken port fails before any model loads); `attach` gives it the model."""

    daemon_threads = True
    request_queue_size = 128  # connections waiting to be accepted: a burst of clients is not turned away

    def __init__(self, host: str, port: int, quiet: bool = False) -> None:
        check_int("port", port, 0, 65535)
        try:
            super().__init__((host, port), Handler)
        except OSError as exc:
            raise ConfigError(f"port: cannot listen on {host}:{port} ({exc.strerror or exc}); choose another "
                              "--port or --host") from exc
        self.quiet = quiet
        self.worker: EngineWorker | None = None
        self.model_ids: tuple[str, ...] = ()

    @property
    def url(self) -> str:
        host, port = self.server_address[:2]
        return f"http://{host}:{port}"

    def attach(self, target: LoadedModel, params: EngineParams) -> None:
        self.worker = EngineWorker(target, params)
        self.model_ids = tuple(dict.fromkeys((target.name, target.spec.source)))

    def close(self) -> None:
        """Stop serving (call from another thread than serve_forever's) and make the worker's `run` return."""
        self.shutdown()
        self.server_close()
        if self.worker is not None:
            self.worker.close()


class Handler(BaseHTTPRequestHandler):
    server: PlaygroundServer
    server_version = "playground"

    def log_message(self, format: str, *args: Any) -> None:
        if not self.server.quiet:
            super().log_message(format, *args)

    def do_GET(self) -> None:
        self._route("GET")

    def do_POST(self) -> None:
        self._route("POST")

    def _route(self, method: str) -> None:
        path = self.path.split("?", 1)[0].rstrip("/") or "/"
        try:
            if path not in ROUTES[method]:
                others = [m for m, paths in ROUTES.items() if path in paths]
                if others:
                    raise ApiError(f"{path} takes {others[0]}, not {method}", status=HTTPStatus.METHOD_NOT_ALLOWED)
                raise ApiError(f"no such endpoint {method} {path}; this server has "
                               + ", ".join(f"{m} {p}" for m, paths in ROUTES.items() for p in paths),
                               status=HTTPStatus.NOT_FOUND)
            if method == "GET":
                self._get(path)
            else:
                self._complete(chat=path.endswith("/chat/completions"))
        except (ApiError, ConfigError) as exc:
            error = api_error(exc)
            self._send_json(error.status, error.body())

    def _get(self, path: str) -> None:
        if path == "/health":
            self._send_json(HTTPStatus.OK, {"status": "ok"})
        elif path == "/v1/models":
            self._send_json(HTTPStatus.OK, {"object": "list", "data": [
                {"id": self.server.model_ids[0], "object": "model", "created": 0, "owned_by": "playground"}]})
        else:
            self._send_json(HTTPStatus.OK, self.server.worker.state)

    def _read_body(self) -> Any:
        length = self.headers.get("Content-Length")
        if length is None or not length.isdigit():
            raise ApiError("the request needs a Content-Length header", status=HTTPStatus.LENGTH_REQUIRED)
        if int(length) > MAX_BODY_BYTES:
            raise ApiError(f"the request body must be at most {MAX_BODY_BYTES} bytes, got {length}",
                           status=HTTPStatus.REQUEST_ENTITY_TOO_LARGE)
        try:
            return json.loads(self.rfile.read(int(length)))
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise ApiError(f"the request body is not valid JSON ({exc})") from exc

    def _complete(self, chat: bool) -> None:
        job = parse_job(self._read_body(), chat, self.server.model_ids)
        worker = self.server.worker
        worker.submit(job)
        reply = job.replies.get()
        if reply.error is not None:
            raise reply.error
        head = {"id": f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex[:24]}", "created": int(time.time()),
                "model": self.server.model_ids[0]}
        if not job.stream:
            choice = ({"message": {"role": "assistant", "content": reply.text}} if chat
                      else {"text": reply.text, "logprobs": None})
            self._send_json(HTTPStatus.OK, {**head, "object": "chat.completion" if chat else "text_completion",
                                            "choices": [{"index": 0, **choice, "finish_reason": reply.finish_reason}],
                                            "usage": reply.usage})
            return
        self.send_response(HTTPStatus.OK)
        self.send_header("Content-Type", "text/event-stream; charset=utf-8")
        self.send_header("Cache-Control", "no-cache")
        self.end_headers()
        first = True
        try:
            while True:
                if reply.error is not None:  # the engine failed mid-stream: the status is sent already
                    self._send_event({"error": reply.error.body()["error"]})
                    break
                if chat:
                    delta = {"role": "assistant", "content": reply.text} if first else {"content": reply.text}
                    choice = {"delta": delta}
                else:
                    choice = {"text": reply.text, "logprobs": None}
                chunk = {**head, "object": "chat.completion.chunk" if chat else "text_completion",
                         "choices": [{"index": 0, **choice, "finish_reason": reply.finish_reason}]}
                if reply.finish_reason is not None:
                    self._send_event({**chunk, "usage": reply.usage})
                    break
                self._send_event(chunk)
                first = False
                reply = job.replies.get()
            self.wfile.write(b"data: [DONE]\n\n")
            self.wfile.flush()
        except (BrokenPipeError, ConnectionResetError):
            worker.cancel(job)

    def _send_event(self, payload: dict[str, Any]) -> None:
        self.wfile.write(b"data: " + json.dumps(payload, ensure_ascii=False).encode() + b"\n\n")
        self.wfile.flush()

    def _send_json(self, status: int, payload: dict[str, Any]) -> None:
        data = json.dumps(payload, ensure_ascii=False).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json; charset=utf-8")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)


def serve(target: LoadedModel, params: EngineParams, server: PlaygroundServer) -> None:
    """Serve until interrupted (Ctrl+C): HTTP on a thread of its own, the engine on this one, which loaded the
    model (see `EngineWorker`)."""
    server.attach(target, params)
    http = threading.Thread(target=server.serve_forever, name="playground-http", daemon=True)
    http.start()
    example = json.dumps({"messages": [{"role": "user", "content": "Hello!"}], "max_tokens": 32})
    print(f"Serving {target.name} at {server.url} (OpenAI-style: POST /v1/completions, /v1/chat/completions; "
          f"GET /v1/models, /v1/engine, /health). Try:\n  curl {server.url}/v1/chat/completions -d '{example}'\n"
          "Ctrl+C stops.", file=sys.stderr, flush=True)
    try:
        server.worker.run()
    except KeyboardInterrupt:
        print("Stopped.", file=sys.stderr)
    finally:
        server.shutdown()
