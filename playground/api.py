"""`python -m playground serve`: the OpenAI-style HTTP API over an `EngineWorker` (FastAPI on uvicorn):

    POST /v1/completions        {"prompt": "..."}: the prompt as is, no chat template
    POST /v1/chat/completions   {"messages": [{"role": ..., "content": ...}, ...]}: the tokenizer's chat template
    GET  /v1/models             the model served
    GET  /v1/engine             the engine now: requests running and waiting, KV blocks and bytes, steps, seconds
    GET  /health                {"status": "ok"} (never needs the API key)

Both POST endpoints take max_tokens (1..4096, default 128), temperature (0..100, default 0: greedy, so a request gets
exactly plain decoding's tokens; below 1e-5 also greedy), top_p, top_k (0 = off), seed, stop (a string or a list of
up to 4) and stream (server-sent events in OpenAI's chunk format, then `data: [DONE]`). Fields OpenAI clients send
by default (n, penalties, logprobs, ...) are accepted at the value that changes nothing and refused otherwise. Every
error is JSON, {"error": {"message", "type", "param", "code"}}, the message naming the field and its allowed range.
"""

from __future__ import annotations

import asyncio
import json
import secrets
import signal
import socket
import sys
import threading
import time
import uuid
from collections.abc import AsyncIterator
from http import HTTPStatus
from typing import Any, Literal

import h11
import uvicorn
from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import BaseModel, ConfigDict, ValidationError, model_validator
from starlette.background import BackgroundTask
from starlette.exceptions import HTTPException
from uvicorn.protocols.http.h11_impl import H11Protocol

from .config import (MAX_NEW_TOKENS_LIMIT, ConfigError, EngineParams, GenerationParams, SamplingParams, check_int,
                     check_text)
from .decoding.proposer import Proposer
from .models import LoadedModel
from .server import ApiError, EngineWorker, Job, Mailbox, Reply

MAX_BODY_BYTES = 1 << 20
BODY_TIMEOUT_S = 30.0  # a request's body must arrive within this
HEAD_TIMEOUT_S = 10.0  # a connection must send a request's whole head within this
SHUTDOWN_GRACE_S = 5  # uvicorn's wait for connections to close once the worker has answered every request
DISCONNECT_POLL_S = 0.5  # how often a non-streaming request checks that its client is still there
MAX_STOP_STRINGS = 4
DEFAULT_MAX_TOKENS = 128
# Fields OpenAI clients may send on their own: accepted only at the value that changes nothing here.
NEUTRAL = {"n": (1,), "best_of": (1,), "presence_penalty": (0,), "frequency_penalty": (0,), "logprobs": (False, 0),
           "top_logprobs": (0,), "echo": (False,), "suffix": ("",), "logit_bias": ({},),
           "parallel_tool_calls": (False,)}
ROUTES = {"GET": ("/health", "/v1/models", "/v1/engine"), "POST": ("/v1/completions", "/v1/chat/completions")}
STRICT = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)


class Message(BaseModel):
    model_config = STRICT
    role: Literal["system", "user", "assistant"]
    content: str


class Options(BaseModel):
    """The fields both endpoints take; null counts as not given, as OpenAI's API has it."""

    model_config = STRICT
    model: str | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stream: bool | None = None
    user: str | None = None  # a client's label for its end user, which changes nothing here

    @model_validator(mode="before")
    @classmethod
    def _neutral(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data
        for name, allowed in NEUTRAL.items():
            value = data.get(name)
            if value is not None and value not in allowed:
                raise ApiError(f"{name} is not supported by this server (only {allowed[0]!r})", param=name)
        return {k: v for k, v in data.items() if k not in NEUTRAL}

    def job(self, replies: Mailbox, prompt: str | None = None,
            messages: list[dict[str, str]] | None = None) -> Job:
        max_tokens = DEFAULT_MAX_TOKENS if self.max_tokens is None else self.max_tokens
        check_int("max_tokens", max_tokens, 1, MAX_NEW_TOKENS_LIMIT)
        stop = [self.stop] if isinstance(self.stop, str) else self.stop or []
        if len(stop) > MAX_STOP_STRINGS or not all(stop):
            raise ConfigError(f"stop must be a non-empty string or a list of 1..{MAX_STOP_STRINGS} of them")
        for i, s in enumerate(stop):
            check_text(f"stop[{i}]", s)
        sampling = SamplingParams(temperature=0.0 if self.temperature is None else self.temperature,
                                  top_k=self.top_k or 0, top_p=1.0 if self.top_p is None else self.top_p,
                                  seed=self.seed)
        generation = GenerationParams(max_new_tokens=max_tokens, stop=tuple(stop), raw=True)
        return Job(sampling, generation, bool(self.stream), replies, prompt=prompt, messages=messages)


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


def parse_job(raw: bytes, model: type[CompletionRequest | ChatRequest], model_ids: tuple[str, ...],
              replies: Mailbox) -> Job:
    """A request body as a job for the worker; ApiError, naming the field, for anything else."""
    try:
        # Python's parser, not pydantic's: it keeps a lone surrogate, which check_text then names
        data = json.loads(raw)
    except RecursionError:
        raise ApiError("the request body is not valid JSON (nested too deeply)") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ApiError(f"the request body is not valid JSON ({exc})") from None
    except ValueError:  # Python reads integers of at most 4,300 digits
        raise ApiError("the request body is not valid JSON (an integer too long to read)") from None
    try:
        body = model.model_validate(data)
        if body.model is not None and body.model not in model_ids:
            raise ApiError(f"model must be {' or '.join(repr(m) for m in model_ids)} (the model this server runs), "
                           f"got {body.model!r}", param="model", status=HTTPStatus.NOT_FOUND)
        return body.to_job(replies)
    except ValidationError as exc:
        raise refusal(exc, model) from None
    except ConfigError as exc:
        raise ApiError(str(exc), param=field_of(str(exc))) from None


def build_app(worker: EngineWorker, api_key: str | None = None) -> FastAPI:
    """The API over a worker whose `run` is serving on another thread. api_key: when set, /v1 requests must send
    `Authorization: Bearer <api_key>`."""
    app = FastAPI(title="decoding playground", docs_url=None, redoc_url=None)
    model_ids = tuple(dict.fromkeys((worker.target.name, worker.target.spec.source)))
    expected = None if api_key is None else f"Bearer {api_key}".encode()

    @app.exception_handler(ApiError)
    async def api_error(request: Request, exc: ApiError) -> JSONResponse:
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
        job = parse_job(await read_body(request), model, model_ids, Mailbox(asyncio.get_running_loop()))
        worker.submit(job)
        chat = model is ChatRequest
        reply = await first_reply(request, job)
        if reply is None:  # the client hung up before its answer: a 499 nobody reads
            return JSONResponse({}, status_code=499)
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
        return StreamingResponse(stream(job, reply, head, chat), media_type="text/event-stream",
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

    async def stream(job: Job, reply: Reply, head: dict[str, Any], chat: bool) -> AsyncIterator[str]:
        """Server-sent events: a chunk per reply, the last with the usage (or an error chunk), then [DONE]."""
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
                break
            yield event(chunk)
            first = False
            reply = await job.replies.get()
        yield "data: [DONE]\n\n"

    app.include_router(v1)
    return app


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
    return b"".join(chunks)


# -- uvicorn ----------------------------------------------------------------------------------------------------------


class HeadTimeoutH11(H11Protocol):
    """uvicorn's HTTP/1.1 protocol with a deadline for each request's head, which uvicorn does not have (a client
    that opens a connection and sends its request slowly, or never, is dropped after HEAD_TIMEOUT_S), and OpenAI's
    JSON error for a request that is not valid HTTP, where uvicorn answers in plain text."""

    _head_timer: asyncio.TimerHandle | None = None

    def send_400_response(self, msg: str) -> None:
        body = json.dumps(ApiError(f"the request is not valid HTTP ({msg})").body()).encode()
        for part in (h11.Response(status_code=400, reason=b"Bad Request",
                                  headers=[(b"content-type", b"application/json"), (b"connection", b"close")]),
                     h11.Data(data=body), h11.EndOfMessage()):
            self.transport.write(self.conn.send(part))
        self.transport.close()

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._arm()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        self._arm()

    def connection_lost(self, exc: Exception | None) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
        super().connection_lost(exc)

    def _arm(self) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
        self._head_timer = self.loop.call_later(HEAD_TIMEOUT_S, self._expire)

    def _expire(self) -> None:
        waiting_for_head = self.cycle is None or self.cycle.response_complete
        if waiting_for_head and not self.transport.is_closing():
            self.transport.close()


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
                 max_waiting: int = 64, quiet: bool = False, proposer: Proposer | None = None) -> None:
        self.worker = EngineWorker(target, params, max_waiting, proposer)
        self.url = url_of(sock)
        self.host, self.port = sock.getsockname()[:2]
        # connections are bounded (a 503 past them); idle keep-alive and request heads are timed out
        self.http = uvicorn.Server(uvicorn.Config(
            build_app(self.worker, api_key), http=HeadTimeoutH11, limit_concurrency=self.worker.capacity + 64,
            timeout_keep_alive=5, timeout_graceful_shutdown=SHUTDOWN_GRACE_S, h11_max_incomplete_event_size=16 * 1024,
            lifespan="off", log_level="warning" if quiet else "info", access_log=not quiet))
        self._thread = threading.Thread(target=self.http.run, kwargs={"sockets": [sock]}, name="playground-http",
                                        daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self.http.should_exit = True
        self._thread.join(SHUTDOWN_GRACE_S + 5)


def serve(target: LoadedModel, params: EngineParams, sock: socket.socket, api_key: str | None = None,
          max_waiting: int = 64, proposer: Proposer | None = None) -> None:
    """Serve until SIGINT (Ctrl+C) or SIGTERM; `proposer`: what every step proposes (None: plain decoding)."""
    service = Service(target, params, sock, api_key, max_waiting, proposer=proposer)
    service.start()
    previous = signal.signal(signal.SIGTERM, lambda *_: service.worker.close())
    url = service.url
    print(f"Serving {target.name} at {url} (OpenAI-style: POST /v1/completions, /v1/chat/completions; GET "
          f"/v1/models, /v1/engine, /health{'; a Bearer API key required on /v1' if api_key else ''}). Try:\n"
          f"  curl {url}/v1/chat/completions -d "
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
