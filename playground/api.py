"""`python -m playground serve`: the OpenAI-style HTTP API over an `EngineWorker` (FastAPI on uvicorn):

    POST /v1/completions        {"prompt": "..."}: the prompt as is, no chat template
    POST /v1/chat/completions   {"messages": [{"role": ..., "content": ...}, ...]}: the tokenizer's chat template
    GET  /v1/models             the model served
    GET  /v1/engine             the engine now: requests running and waiting, KV blocks and bytes, steps, seconds
    GET  /health                {"status": "ok"} (never needs the API key)

Both POST endpoints take max_tokens (1..4096, default 128; or max_completion_tokens), temperature (0..100, default 0:
greedy, so a request gets exactly plain decoding's tokens; below 1e-5 also greedy), top_p, top_k (0 = off), seed,
stop (a string or a list of up to 4) and stream (server-sent events in OpenAI's chunk format, then `data: [DONE]`;
stream_options.include_usage adds a usage chunk). Fields OpenAI clients send by default (n, penalties, logprobs, ...)
are accepted at the value that changes nothing and refused otherwise; labels (user, store, metadata, service_tier)
change nothing. Every error is JSON, {"error": {"message", "type", "param", "code"}}, the message naming the field
and its allowed range. Bodies must be JSON, a web page's request must come from an allowed origin and, bound to this
machine only, the Host must be one of its names (`guard`).
"""

from __future__ import annotations

import asyncio
import ipaddress
import json
import secrets
import signal
import socket
import sys
import threading
import time
import typing
import uuid
import weakref
from collections.abc import AsyncIterator
from http import HTTPStatus
from typing import Any, Literal
from urllib.parse import urlsplit

import h11
import uvicorn
from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ConfigDict, ValidationError, model_validator
from starlette.background import BackgroundTask
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect
from uvicorn.protocols.http.h11_impl import H11Protocol

from .config import (
    MAX_NEW_TOKENS_LIMIT,
    MAX_STOP_CHARS,
    MAX_STOP_STRINGS,
    ConfigError,
    EngineParams,
    GenerationParams,
    SamplingParams,
    check_int,
    check_text,
)
from .decoding.proposer import Proposer
from .models import LoadedModel
from .prometheus import CONTENT_TYPE
from .server import ApiError, EngineWorker, Job, Mailbox, Reply

MAX_BODY_BYTES = 1 << 20
BODY_TIMEOUT_S = 30.0  # a request's body must arrive within this
HEAD_TIMEOUT_S = 10.0  # a connection must send a request's whole head within this
MAX_HEAD_BYTES = 16 * 1024  # a request's line and headers
MAX_FRESH = 64  # connections open that have sent no request yet: a new one closes the oldest
MAX_CONNECTIONS = 512  # open at once (well under a process's usual 1,024 files): past it, a 503
SHUTDOWN_GRACE_S = 5  # uvicorn's wait for connections to close once the worker has answered every request
CLIENT_GONE = 499  # nginx's status for a request whose client closed the connection first
DISCONNECT_POLL_S = 0.5  # how often a non-streaming request checks that its client is still there
DEFAULT_MAX_TOKENS = 128
# Fields OpenAI clients may send on their own: accepted only at the value that changes nothing here.
NEUTRAL: dict[str, tuple[Any, ...]] = {
    "n": (1,), "best_of": (1,), "presence_penalty": (0,), "frequency_penalty": (0,), "logprobs": (False, 0),
    "top_logprobs": (0,), "echo": (False,), "suffix": ("",), "logit_bias": ({},), "parallel_tool_calls": (False,)}
ROUTES = {"GET": ("/health", "/metrics", "/v1/models", "/v1/engine"),
          "POST": ("/v1/completions", "/v1/chat/completions")}
LOCAL_HOSTS = ("localhost", "127.0.0.1", "[::1]")
STRICT = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)


class Message(BaseModel):
    model_config = STRICT
    role: Literal["system", "user", "assistant"]
    content: str


class StreamOptions(BaseModel):
    """include_usage: a last chunk, with no choices, carries the request's token counts (the chunk that finishes
    the text carries them too)."""

    model_config = STRICT
    include_usage: bool | None = None


class Options(BaseModel):
    """The fields both endpoints take; null counts as not given, as OpenAI's API has it."""

    model_config = STRICT
    model: str | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    seed: int | None = None
    max_completion_tokens: int | None = None  # the chat API's newer name for max_tokens
    stop: str | list[str] | None = None
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    # labels a client may send that change nothing here: its end user, storage and metadata for OpenAI's dashboard,
    # the processing tier it asks for
    user: str | None = None
    store: bool | None = None
    metadata: dict[str, str] | None = None
    service_tier: str | None = None

    @model_validator(mode="before")
    @classmethod
    def _neutral(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data
        for name, allowed in NEUTRAL.items():
            value = data.get(name)
            # a boolean is not a number here, though Python's True == 1
            if value is not None and not any(value == a and isinstance(value, bool) == isinstance(a, bool)
                                             for a in allowed):
                raise ApiError(f"{name} is not supported by this server (only {allowed[0]!r})", param=name)
        return {k: v for k, v in data.items() if k not in NEUTRAL}

    def job(self, replies: Mailbox, prompt: str | None = None,
            messages: list[dict[str, str]] | None = None) -> Job:
        if self.stream_options is not None and not self.stream:
            raise ApiError("stream_options is only allowed with stream: true", param="stream_options")
        given = {n for n in (self.max_tokens, self.max_completion_tokens) if n is not None}
        if len(given) > 1:
            raise ApiError("max_tokens and max_completion_tokens differ: send one of them", param="max_tokens")
        max_tokens = given.pop() if given else DEFAULT_MAX_TOKENS
        check_int("max_tokens" if self.max_completion_tokens is None else "max_completion_tokens", max_tokens, 1,
                  MAX_NEW_TOKENS_LIMIT)
        stop = [self.stop] if isinstance(self.stop, str) else self.stop or []
        if len(stop) > MAX_STOP_STRINGS or not all(0 < len(s) <= MAX_STOP_CHARS for s in stop):
            raise ConfigError(f"stop must be a string of 1..{MAX_STOP_CHARS} characters or a list of "
                              f"1..{MAX_STOP_STRINGS} of them")
        for i, s in enumerate(stop):
            check_text(f"stop[{i}]", s)
        sampling = SamplingParams(temperature=0.0 if self.temperature is None else self.temperature,
                                  top_k=self.top_k or 0, top_p=1.0 if self.top_p is None else self.top_p,
                                  seed=self.seed)
        generation = GenerationParams(max_new_tokens=max_tokens, stop=tuple(stop), raw=True)
        return Job(sampling, generation, bool(self.stream), replies, prompt=prompt, messages=messages)

    @property
    def usage_chunk(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class CompletionRequest(Options):
    prompt: str

    def to_job(self, replies: Mailbox) -> Job:
        check_text("prompt", self.prompt)
        if not self.prompt.strip():
            raise ConfigError("prompt must be a non-empty string")
        return self.job(replies, prompt=self.prompt)


class ChatRequest(Options):
    messages: list[Message]

    def to_job(self, replies: Mailbox) -> Job:
        if not self.messages:
            raise ConfigError('messages must be a non-empty list of {"role": ..., "content": ...}')
        for i, message in enumerate(self.messages):
            check_text(f"messages[{i}].content", message.content)
        if not any(m.content.strip() for m in self.messages):
            raise ConfigError("messages must hold some text")
        return self.job(replies, messages=[m.model_dump() for m in self.messages])


def field_of(message: str) -> str | None:
    """The field a ConfigError's message starts with (`messages[0].content must ...` -> messages)."""
    head = message.split(" ", 1)[0].split("[", 1)[0].split(".", 1)[0]
    return head if head in CompletionRequest.model_fields or head in ChatRequest.model_fields else None


def refusal(exc: ValidationError, model: type[Options]) -> ApiError:
    """The first problem pydantic found, as one line naming the field."""
    # an unknown field first: a body meant for the other endpoint is told so, not that its text field is missing
    error = min(exc.errors(include_url=False), key=lambda e: e["type"] != "extra_forbidden")
    loc, kind = error["loc"], error["type"]
    where = "".join(f"[{part}]" if isinstance(part, int) else f".{part}" for part in loc).lstrip(".")
    param = str(loc[0]) if loc else None
    if not loc and kind in ("model_type", "dataclass_type"):
        return ApiError("the request body must be a JSON object")
    if kind == "extra_forbidden":
        takes = ", ".join(model.model_fields) if len(loc) == 1 else "role, content"
        return ApiError(f"unknown field {where!r}; {'this endpoint' if len(loc) == 1 else 'a message'} takes {takes}",
                        param=param)
    if kind == "value_error":
        cause = error["ctx"]["error"]
        if isinstance(cause, ApiError):
            return cause
        return ApiError(str(cause), param=field_of(str(cause)))
    got = repr(error["input"]) if not isinstance(error["input"], (dict, list)) else type(error["input"]).__name__
    return ApiError(f"{where}: {error['msg']}, got {got[:80]}", param=param)


def check_unicode(data: Any, where: str = "") -> None:
    """Every string of a request body, its field names included, is valid Unicode: JSON may escape a lone surrogate,
    which no text may hold. An ApiError names the first one's place (`messages[0].content`, `metadata`)."""
    field = where.split("[", 1)[0].split(".", 1)[0]  # the top-level field a place is in
    if isinstance(data, str):
        try:
            check_text(where, data)
        except ConfigError as exc:
            raise ApiError(str(exc), param=field) from None
    elif isinstance(data, list):
        for i, item in enumerate(data):
            check_unicode(item, f"{where}[{i}]")
    elif isinstance(data, dict):
        for key, value in data.items():
            try:
                key.encode("utf-8")
            except UnicodeEncodeError:
                raise ApiError(f"a field name{f' in {where}' if where else ''} is not valid Unicode (a lone "
                               f"surrogate: {key[:40]!r})", param=field or None) from None
            check_unicode(value, f"{where}.{key}" if where else key)


def parse_job(raw: bytes, model: type[CompletionRequest | ChatRequest], model_ids: tuple[str, ...],
              replies: Mailbox) -> tuple[Job, bool]:
    """A request body as a job for the worker, and whether its stream ends with a usage chunk
    (`stream_options.include_usage`); ApiError, naming the field, for anything else."""
    try:
        # Python's parser, not pydantic's: it keeps a lone surrogate, which check_text then names
        data = json.loads(raw)
    except RecursionError:
        raise ApiError("the request body is not valid JSON (nested too deeply)") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ApiError(f"the request body is not valid JSON ({exc})") from None
    except ValueError:  # Python reads integers of at most 4,300 digits
        raise ApiError("the request body is not valid JSON (an integer too long to read)") from None
    check_unicode(data)
    try:
        body = model.model_validate(data)
        if body.model is not None and body.model not in model_ids:
            raise ApiError(f"model must be {' or '.join(repr(m) for m in model_ids)} (the model this server runs), "
                           f"got {body.model!r}", param="model", status=HTTPStatus.NOT_FOUND)
        return body.to_job(replies), body.usage_chunk
    except ValidationError as exc:
        raise refusal(exc, model) from None
    except ConfigError as exc:
        raise ApiError(str(exc), param=field_of(str(exc))) from None


def host_name(header: str) -> str:
    """The name in a Host header, without its port: `127.0.0.1:8000` -> 127.0.0.1, `[::1]:80` -> [::1]."""
    header = header.strip().lower()
    return header[: header.index("]") + 1] if header.startswith("[") and "]" in header else header.split(":", 1)[0]


def hosts_for(bound: str, allowed: tuple[str, ...] | None) -> tuple[str, ...] | None:
    """The Host names a server answers to: `allowed` when given ("*" alone: any); else, bound to this machine only
    (a loopback address), this machine's names, so that a web page whose name resolves here (DNS rebinding) is
    refused; else any."""
    if allowed is not None:
        return None if "*" in allowed else tuple(host_name(h) for h in allowed)
    try:
        local = ipaddress.ip_address(bound).is_loopback
    except ValueError:
        local = bound == "localhost"
    return LOCAL_HOSTS if local else None


def build_app(worker: EngineWorker, api_key: str | None = None, hosts: tuple[str, ...] | None = None,
              metrics_public: bool = False, origins: tuple[str, ...] | None = ()) -> FastAPI:
    """The API over a worker whose `run` is serving on another thread. api_key: when set, /v1 requests (and /metrics,
    unless `metrics_public`) must send `Authorization: Bearer <api_key>`. hosts: the Host names it answers to (None:
    any; see `hosts_for`). origins: the web pages (`scheme://host[:port]`) that may use it (None: any; see `guard`),
    which get CORS headers so that they can read the answers.

    Bodies are JSON: a POST whose Content-Type is not application/json (a browser's form, text/plain or none at all,
    which any web page may send without asking) is refused, and so is a request from a web page whose origin is not
    one of `origins`: no page elsewhere can use the server unless it is named.
    No route beyond `ROUTES` (no OpenAPI schema or docs page) and no redirect (`/health/` is a 404)."""
    async def guarded(request: Request) -> None:
        guard(hosts, origins, request)

    app = FastAPI(title="decoding playground", docs_url=None, redoc_url=None, openapi_url=None,
                  redirect_slashes=False, dependencies=[Depends(guarded)])
    if origins != ():
        app.add_middleware(CORSMiddleware, allow_origins=["*"] if origins is None else list(origins),
                           allow_methods=["GET", "POST"], allow_headers=["Authorization", "Content-Type"])
    model_ids = tuple(dict.fromkeys((worker.target.name, worker.target.spec.source)))
    expected = None if api_key is None else f"Bearer {api_key}".encode()

    @app.exception_handler(ApiError)
    async def api_error(request: Request, exc: ApiError) -> JSONResponse:
        worker.metrics.failed(exc.status)
        retry = {"Retry-After": "1"} if exc.status == HTTPStatus.SERVICE_UNAVAILABLE else None
        return JSONResponse(exc.body(), status_code=exc.status, headers=retry)

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, exc: HTTPException) -> JSONResponse:
        path, method = request.url.path.rstrip("/") or "/", request.method
        if exc.status_code == HTTPStatus.METHOD_NOT_ALLOWED:
            others = [m for m, paths in ROUTES.items() if path in paths]
            error = ApiError(f"{path} takes {' or '.join(others)}, not {method}", status=exc.status_code)
        elif exc.status_code == HTTPStatus.NOT_FOUND:
            error = ApiError(f"no such endpoint {method} {path}; this server has "
                             + ", ".join(f"{m} {p}" for m, paths in ROUTES.items() for p in paths),
                             status=exc.status_code)
        else:
            error = ApiError(str(exc.detail), status=exc.status_code)
        return await api_error(request, error)

    @app.exception_handler(Exception)
    async def unexpected(request: Request, exc: Exception) -> JSONResponse:
        return await api_error(request, ApiError(f"the server failed: {exc}", status=500, kind="server_error"))

    async def authorize(request: Request) -> None:
        if expected is not None:
            given = request.headers.get("authorization", "").encode("latin-1")
            if not secrets.compare_digest(given, expected):
                raise ApiError("a valid API key is required: send the header 'Authorization: Bearer <key>'",
                               status=HTTPStatus.UNAUTHORIZED, kind="authentication_error")

    v1 = APIRouter(prefix="/v1", dependencies=[Depends(authorize)])

    @app.get("/health")
    async def health() -> dict[str, str]:
        return {"status": "ok"}

    @app.get("/metrics", dependencies=[] if metrics_public else [Depends(authorize)])
    async def metrics() -> Response:
        return Response(worker.metrics.render(), media_type=CONTENT_TYPE)

    @v1.get("/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [{"id": model_ids[0], "object": "model", "created": 0,
                                            "owned_by": "playground"}]}

    @v1.get("/engine")
    async def engine() -> dict[str, Any]:
        return worker.state

    @v1.post("/completions")
    async def completions(request: Request) -> Any:
        return await complete(request, CompletionRequest)

    @v1.post("/chat/completions")
    async def chat_completions(request: Request) -> Any:
        return await complete(request, ChatRequest)

    async def complete(request: Request, model: type[CompletionRequest | ChatRequest]) -> Any:
        job, usage_chunk = parse_job(await read_body(request), model, model_ids, Mailbox(asyncio.get_running_loop()))
        worker.submit(job)
        chat = model is ChatRequest
        reply = await first_reply(request, job)
        if reply is None:  # the client hung up before its answer: a 499 nobody reads
            return JSONResponse({}, status_code=CLIENT_GONE)
        if reply.error is not None:
            raise reply.error
        head = {"id": f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex[:24]}", "created": int(time.time()),
                "model": model_ids[0]}
        if not job.stream:
            choice = ({"message": {"role": "assistant", "content": reply.text}} if chat
                      else {"text": reply.text, "logprobs": None})
            return {**head, "object": "chat.completion" if chat else "text_completion",
                    "choices": [{"index": 0, **choice, "finish_reason": reply.finish_reason}], "usage": reply.usage}
        # Starlette runs the background task once the response ends, also when the client hung up (even before the
        # first chunk): the job is then stopped; a job that has ended is left alone
        return StreamingResponse(stream(job, reply, head, chat, usage_chunk), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache"}, background=BackgroundTask(worker.cancel, job))

    async def first_reply(request: Request, job: Job) -> Reply | None:
        """The job's first reply (its whole answer unless it streams); None, and the job cancelled, when the
        client hangs up first."""
        while True:
            try:
                return await asyncio.wait_for(job.replies.get(), DISCONNECT_POLL_S)
            except TimeoutError:
                if await request.is_disconnected():
                    worker.cancel(job)
                    return None

    async def stream(job: Job, reply: Reply, head: dict[str, Any], chat: bool,
                     usage_chunk: bool) -> AsyncIterator[str]:
        """Server-sent events: a chunk per reply, the last with the usage (or an error chunk), with usage_chunk one
        more that has no choices and the usage alone, as OpenAI's `include_usage` sends it; then [DONE]."""
        first = True
        while True:
            if reply.error is not None:  # the status is sent already: the error goes in the stream
                yield event({"error": reply.error.body()["error"]})
                break
            delta = {"role": "assistant", "content": reply.text} if first else {"content": reply.text}
            choice = {"delta": delta} if chat else {"text": reply.text, "logprobs": None}
            chunk = {**head, "object": "chat.completion.chunk" if chat else "text_completion",
                     "choices": [{"index": 0, **choice, "finish_reason": reply.finish_reason}]}
            if reply.finish_reason is not None:
                yield event({**chunk, "usage": reply.usage})
                if usage_chunk:
                    yield event({**chunk, "choices": [], "usage": reply.usage})
                break
            yield event(chunk)
            first = False
            reply = await job.replies.get()
        yield "data: [DONE]\n\n"

    app.include_router(v1)
    return app


def origin_of(text: str) -> str:
    """An origin as browsers send it, `scheme://host[:port]` in lower case (`https://App.example/` ->
    https://app.example); a ValueError for anything else."""
    parts = urlsplit(text.strip().lower())
    if parts.scheme not in ("http", "https") or not parts.hostname or parts.path not in ("", "/") or parts.query \
            or parts.fragment or parts.username or parts.password:
        raise ValueError(text)
    try:
        port = parts.port
    except ValueError:
        raise ValueError(text) from None
    host = f"[{parts.hostname}]" if ":" in parts.hostname else parts.hostname
    return f"{parts.scheme}://{host}" + (f":{port}" if port is not None else "")


def guard(hosts: tuple[str, ...] | None, origins: tuple[str, ...] | None, request: Request) -> None:
    """Every route's first check: the Host header; the Origin a browser sends with a web page's request (none from
    a program such as curl or the openai client; `null` from a sandboxed page or a file); then a POST's
    Content-Type, which must be JSON: a body of another type, or of none, is what a page may send without asking."""
    if hosts is not None and host_name(request.headers.get("host", "")) not in hosts:
        raise ApiError(f"Host {request.headers.get('host', '')[:80]!r} is not one this server answers to "
                       f"({', '.join(hosts)}); start it with --allowed-hosts to add a name", param="Host",
                       status=HTTPStatus.FORBIDDEN)
    origin = request.headers.get("origin")
    if origin is not None and origins is not None:
        try:
            allowed = origin_of(origin) in origins
        except ValueError:
            allowed = False
        if not allowed:
            raise ApiError(f"requests from web pages at {origin[:80]!r} are refused; start the server with "
                           "--allowed-origins to let a page use it", param="Origin", status=HTTPStatus.FORBIDDEN)
    if request.method == "POST":
        kind = request.headers.get("content-type")
        media = (kind or "").split(";", 1)[0].strip().lower()
        if media != "application/json" and not media.endswith("+json"):
            raise ApiError(f"Content-Type must be application/json, got {'none' if kind is None else repr(kind[:80])}",
                           param="Content-Type", status=HTTPStatus.UNSUPPORTED_MEDIA_TYPE)


def event(payload: dict[str, Any]) -> str:
    return f"data: {json.dumps(payload, ensure_ascii=False)}\n\n"


async def read_body(request: Request) -> bytes:
    """The request's body: at most MAX_BODY_BYTES, arriving within BODY_TIMEOUT_S."""
    length = request.headers.get("content-length")
    if length is not None and length.isdigit() and int(length) > MAX_BODY_BYTES:
        raise ApiError(f"the request body must be at most {MAX_BODY_BYTES} bytes, got {length}",
                       status=HTTPStatus.REQUEST_ENTITY_TOO_LARGE)
    chunks, size = [], 0
    try:
        async with asyncio.timeout(BODY_TIMEOUT_S):
            async for chunk in request.stream():
                size += len(chunk)
                if size > MAX_BODY_BYTES:
                    raise ApiError(f"the request body must be at most {MAX_BODY_BYTES} bytes",
                                   status=HTTPStatus.REQUEST_ENTITY_TOO_LARGE)
                chunks.append(chunk)
    except TimeoutError:
        raise ApiError(f"the request body did not arrive within {BODY_TIMEOUT_S:.0f} s",
                       status=HTTPStatus.REQUEST_TIMEOUT) from None
    except ClientDisconnect:  # nobody reads the answer; nothing failed here, so nothing is logged
        raise ApiError("the client hung up before its request body arrived", status=CLIENT_GONE) from None
    return b"".join(chunks)


# -- uvicorn ----------------------------------------------------------------------------------------------------------


class Guarded(asyncio.Protocol):
    """uvicorn's HTTP/1.1 protocol with what it lacks against clients that hold connections without using them, in
    front of it: uvicorn builds this class as it builds any protocol class its configuration names (`http=`), and it
    builds uvicorn's own `H11Protocol` with the same arguments, passed on unread, then hands it the bytes. It reads
    nothing of uvicorn's state: it frames the bytes itself, each request with an `h11` parser of its own (a head,
    then the body its head announces), and so knows where a head begins and ends. It adds:
    - a deadline for each request's head, from its first byte (the connection's first from its opening; a client
      that sends its head slowly, or never, is dropped after HEAD_TIMEOUT_S), and a bound on its size
      (MAX_HEAD_BYTES: a 431), however it arrives; uvicorn's own keep-alive timeout closes a connection idle
      between requests;
    - at most MAX_FRESH connections a server that have sent no whole head yet: a new one closes the oldest of them,
      so sockets opened and left idle can never lock real clients out; past MAX_CONNECTIONS in all, a new one gets a
      503;
    - OpenAI's JSON error for HTTP it cannot read (a 400), where uvicorn answers in plain text;
    - TCP_NODELAY, without which every request on a kept-alive connection waits about 40 ms.
    Requests in flight are bounded by the worker (`max_waiting`), not by counting connections."""

    def __init__(self, **arguments: Any) -> None:
        self.inner = H11Protocol(**arguments)
        self.peers = _OPEN.setdefault(arguments["server_state"], {})  # this server's connections, oldest first
        self.transport: asyncio.Transport | None = None
        self.parser = self._parser()  # frames the current request
        self.fresh = True  # no whole head yet on this connection
        self.in_head = True  # the bytes arriving are a head's
        self.head_bytes = 0
        self.timer: asyncio.TimerHandle | None = None
        self.passing = False  # uvicorn's protocol has the connection

    @staticmethod
    def _parser() -> h11.Connection:
        return h11.Connection(h11.SERVER, max_incomplete_event_size=MAX_HEAD_BYTES)

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport = typing.cast(asyncio.Transport, transport)
        sock = transport.get_extra_info("socket")
        if sock is not None and sock.family in (socket.AF_INET, socket.AF_INET6):
            # a response goes out in two writes (head, body): with Nagle's algorithm on, the body waits for the
            # client's delayed ACK of the head, about 40 ms on every request of a kept-alive connection
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        if len(self.peers) >= MAX_CONNECTIONS:
            self._answer(HTTPStatus.SERVICE_UNAVAILABLE, f"the server holds {MAX_CONNECTIONS} connections, its "
                                                         "most; retry shortly")
            return
        fresh = [peer for peer in self.peers if peer.fresh]
        if len(fresh) >= MAX_FRESH:  # the one idle longest (the first opened) makes room
            fresh[0].fresh = False  # closing: it counts no more
            fresh[0].close()
        self.peers[self] = None
        self._arm()
        self.passing = True
        self.inner.connection_made(transport)

    def data_received(self, data: bytes) -> None:
        if self.transport is None or self.transport.is_closing():
            return
        if self.parser.their_state in (h11.MUST_CLOSE, h11.CLOSED):  # no request follows: uvicorn's to judge
            self.inner.data_received(data)
            return
        if not self.in_head and self.parser.their_state is h11.DONE:  # the next request's head begins
            self._next_head()
        if self.in_head:
            end = data.find(b"\r\n\r\n")
            self.head_bytes += len(data) if end == -1 else end
            if self.head_bytes > MAX_HEAD_BYTES:
                self._answer(HTTPStatus.REQUEST_HEADER_FIELDS_TOO_LARGE,
                             f"the request line and headers must be at most {MAX_HEAD_BYTES} bytes")
                return
        try:
            self._frame(data)
        except h11.RemoteProtocolError as exc:
            self._answer(HTTPStatus.BAD_REQUEST, f"the request is not valid HTTP ({exc})")
            return
        self.inner.data_received(data)

    def _frame(self, data: bytes) -> None:
        """Feed the bytes to this request's parser (and what follows its end to the next one's): a whole head
        stops its deadline."""
        self.parser.receive_data(data)
        while True:
            event = self.parser.next_event()
            if event is h11.NEED_DATA or event is h11.PAUSED:
                if event is h11.PAUSED and self.parser.trailing_data[0]:  # a pipelined request: the next one's
                    rest = self.parser.trailing_data[0]
                    self._next_head()
                    self.parser.receive_data(rest)
                    continue
                return
            if isinstance(event, h11.Request):
                self.fresh = self.in_head = False
                self.head_bytes = 0
                if self.timer is not None:
                    self.timer.cancel()

    def _next_head(self) -> None:
        """A request was framed whole: a fresh parser for the next one, whose head's deadline starts now."""
        self.parser, self.in_head, self.head_bytes = self._parser(), True, 0
        self._arm()

    def connection_lost(self, exc: Exception | None) -> None:
        if self.timer is not None:
            self.timer.cancel()
        self.peers.pop(self, None)
        if self.passing:
            self.inner.connection_lost(exc)

    def eof_received(self) -> None:
        if self.passing:
            self.inner.eof_received()

    def pause_writing(self) -> None:
        self.inner.pause_writing()

    def resume_writing(self) -> None:
        self.inner.resume_writing()

    def close(self) -> None:
        if self.transport is not None and not self.transport.is_closing():
            self.transport.close()

    def _answer(self, status: HTTPStatus, message: str) -> None:
        """An error as the connection's last words: JSON, then close."""
        assert self.transport is not None
        error = ApiError(message, status=status, kind="server_error" if status >= 500 else "invalid_request_error")
        body = json.dumps(error.body()).encode()
        # written out whole, whatever a response uvicorn's protocol may have begun
        retry = "retry-after: 1\r\n" if status == HTTPStatus.SERVICE_UNAVAILABLE else ""
        head = (f"HTTP/1.1 {status.value} {status.phrase}\r\ncontent-type: application/json\r\n"
                f"content-length: {len(body)}\r\nconnection: close\r\n{retry}\r\n")
        self.transport.write(head.encode() + body)
        self.close()

    def _arm(self) -> None:
        if self.timer is not None:
            self.timer.cancel()
        self.timer = asyncio.get_running_loop().call_later(HEAD_TIMEOUT_S, self._expire)

    def _expire(self) -> None:
        if self.in_head:
            self.close()


# each server's open connections (`Guarded`), by uvicorn's state object of that server, used as a key alone
_OPEN: weakref.WeakKeyDictionary[Any, dict[Guarded, None]] = weakref.WeakKeyDictionary()


def listen(host: str, port: int) -> socket.socket:
    """A listening socket (made before the model loads, so a taken port fails at once)."""
    check_int("port", port, 0, 65535)
    try:
        family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0][0]
        return socket.create_server((host, port), family=family, backlog=2048)
    except OSError as exc:
        raise ConfigError(f"port: cannot listen on {host}:{port} ({exc.strerror or exc}); choose another --port or "
                          "--host") from exc


def url_of(sock: socket.socket) -> str:
    host, port = sock.getsockname()[:2]
    return f"http://{f'[{host}]' if ':' in host else host}:{port}"


class Service:
    """An `EngineWorker` and uvicorn serving its API on a listening socket: `start` runs HTTP on a thread of its own,
    then the caller runs `worker.run()` (on the thread that loaded the model, see `EngineWorker`); once that has
    returned, having answered every request it held, `stop` closes HTTP."""

    def __init__(self, target: LoadedModel, params: EngineParams, sock: socket.socket, api_key: str | None = None,
                 max_waiting: int = 64, quiet: bool = False, proposer: Proposer | None = None,
                 allowed_hosts: tuple[str, ...] | None = None, metrics_public: bool = False,
                 allowed_origins: tuple[str, ...] | None = ()) -> None:
        self.worker = EngineWorker(target, params, max_waiting, proposer)
        self.url = url_of(sock)
        self.host, self.port = sock.getsockname()[:2]
        # idle keep-alive and request heads are timed out, connections that sent nothing bounded (`Guarded`)
        self.http = uvicorn.Server(uvicorn.Config(
            build_app(self.worker, api_key, hosts_for(self.host, allowed_hosts), metrics_public, allowed_origins),
            http=Guarded,
            timeout_keep_alive=5, timeout_graceful_shutdown=SHUTDOWN_GRACE_S,
            h11_max_incomplete_event_size=MAX_HEAD_BYTES,
            lifespan="off", log_level="warning" if quiet else "info", access_log=not quiet))
        self._thread = threading.Thread(target=self.http.run, kwargs={"sockets": [sock]}, name="playground-http",
                                        daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self.http.should_exit = True
        self._thread.join(SHUTDOWN_GRACE_S + 5)


def access(api_key: str | None, metrics_public: bool, origins: tuple[str, ...] | None) -> str:
    """Who may use the server, as its start-up banner says it."""
    pages = ("No web page may use it." if origins == () else "Web pages anywhere may use it." if origins is None
             else f"Web pages at {', '.join(origins)} may use it.")
    if api_key is None:
        return ("No API key: any program that reaches this address may use it (--api-key or $PLAYGROUND_API_KEY "
                f"sets one). {pages}")
    return ("Requests to /v1" + (" and /metrics" if not metrics_public else "")
            + f" need the API key, sent as 'Authorization: Bearer KEY'. {pages}")


def serve(target: LoadedModel, params: EngineParams, sock: socket.socket, api_key: str | None = None,
          max_waiting: int = 64, proposer: Proposer | None = None,
          allowed_hosts: tuple[str, ...] | None = None, metrics_public: bool = False,
          allowed_origins: tuple[str, ...] | None = ()) -> None:
    """Serve until SIGINT (Ctrl+C) or SIGTERM; `proposer`: what every step proposes (None: plain decoding);
    allowed_hosts: the Host names it answers to (`hosts_for`); metrics_public: /metrics without the API key;
    allowed_origins: the web pages that may use it (`build_app`)."""
    service = Service(target, params, sock, api_key, max_waiting, proposer=proposer, allowed_hosts=allowed_hosts,
                      metrics_public=metrics_public, allowed_origins=allowed_origins)
    service.start()
    previous = signal.signal(signal.SIGTERM, lambda *_: service.worker.close())
    url = service.url
    key = " -H 'Authorization: Bearer KEY'" if api_key else ""
    who = access(api_key, metrics_public, allowed_origins)
    print(f"Serving {target.name} at {url} (OpenAI-style: POST /v1/completions, /v1/chat/completions; GET "
          f"/v1/models, /v1/engine, /health, /metrics (Prometheus)). {who} Try:\n"
          f"  curl {url}/v1/chat/completions -H 'Content-Type: application/json'{key} -d "
          """'{"messages": [{"role": "user", "content": "Hello!"}], "max_tokens": 32}'\n"""
          "Ctrl+C stops.", file=sys.stderr, flush=True)
    try:
        service.worker.run()
    except KeyboardInterrupt:
        pass
    finally:
        signal.signal(signal.SIGTERM, previous)
        service.stop()
        print("Stopped.", file=sys.stderr, flush=True)
