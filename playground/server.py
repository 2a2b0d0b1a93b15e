"""The engine's side of `python -m playground serve` (`playground.api` is the HTTP side).

Two threads. The engine and the tokenizer are not thread-safe, so one thread owns both (`EngineWorker.run`; the
command runs it on the main thread, which loaded the model). uvicorn runs the FastAPI app (`playground.api`) on an
event loop in a thread of its own; a request's handler submits a `Job` and awaits its `Reply`s, which the worker
hands over through the job's `Mailbox`. A request that arrives while others decode joins the running batch at the
next step: that is continuous batching, and every request still gets the tokens it would get alone (greedy, or
sampled from its own seed), as tests/test_engine.py checks.

Isolation: whatever fails while admitting, tokenizing, sampling or detokenizing one request ends that request with
an error and nothing else; a failure of the shared forward fails the requests in flight and serving goes on with a
fresh engine. On SIGINT or SIGTERM the worker answers every request it holds with a 503 (a stream gets an error
chunk and `[DONE]`), then uvicorn stops.
"""

from __future__ import annotations

import asyncio
import queue
import threading
import time
import traceback
from dataclasses import asdict, dataclass, field
from http import HTTPStatus
from typing import Any

from .config import MAX_WAITING, ConfigError, EngineParams, GenerationParams, SamplingParams, check_int
from .decoding.base import chat_ids, check_context
from .decoding.proposer import Proposer
from .engine import Engine, RequestOutput
from .kv import blocks_for
from .models import LoadedModel
from .prometheus import ServerMetrics
from .trace import PreemptEvent

FINISH_REASONS = {"eos": "stop", "stop": "stop", "length": "length"}  # ours -> OpenAI's
# An idle engine thread wakes this often: a Ctrl+C that the kernel hands to another thread (HTTP, OpenMP workers)
# only sets Python's flag, which the main thread reads when it next runs, not while it sleeps on a queue.
IDLE_WAKE_S = 0.25


class ApiError(Exception):
    """A request the server refuses: an HTTP status and OpenAI's error object."""

    def __init__(self, message: str, param: str | None = None, status: int = HTTPStatus.BAD_REQUEST,
                 kind: str = "invalid_request_error") -> None:
        super().__init__(message)
        self.param, self.status, self.kind = param, status, kind

    def body(self) -> dict[str, Any]:
        return {"error": {"message": str(self), "type": self.kind, "param": self.param, "code": None}}


def server_error(message: str, status: int = HTTPStatus.INTERNAL_SERVER_ERROR) -> ApiError:
    return ApiError(message, status=status, kind="server_error")


def shutting_down() -> ApiError:
    return server_error("the server is shutting down", HTTPStatus.SERVICE_UNAVAILABLE)


def settled_text(text: str, stop: tuple[str, ...]) -> str:
    """The part of a growing decoded text that the tokens still to come will not change, which streaming may send:
    without trailing U+FFFD (a character whose bytes are not all generated yet), trailing whitespace (a detokenizer
    may drop a space before the punctuation that follows it) or a tail that may begin a stop string (the final text
    is cut before a stop string)."""
    while True:
        cut = text.rstrip().rstrip("\ufffd")
        for s in stop:
            cut = cut[: len(cut) - _stop_start(cut, s)]
        if cut == text:
            return text
        text = cut


def _stop_start(text: str, stop: str) -> int:
    """The length of the longest tail of `text` that begins `stop` without being all of it (0: none): only the
    places where the tail could start, those holding stop's first character, are compared."""
    tail = text[-(len(stop) - 1):] if len(stop) > 1 else ""
    at = tail.find(stop[0])
    while at != -1:
        if stop.startswith(tail[at:]):
            return len(tail) - at
        at = tail.find(stop[0], at + 1)
    return 0


@dataclass(frozen=True, slots=True)
class Reply:
    """Text for a job: a piece of the stream, or (finish_reason set) the rest of it and the usage; or an error."""

    text: str = ""
    finish_reason: str | None = None
    usage: dict[str, int] | None = None
    error: ApiError | None = None


class Mailbox:
    """Replies from the engine's thread to the coroutine serving one request on the event loop."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop, self._queue = loop, asyncio.Queue[Reply]()

    def put(self, reply: Reply) -> None:
        try:
            self._loop.call_soon_threadsafe(self._queue.put_nowait, reply)
        except RuntimeError:  # the event loop has closed: nobody is waiting for this reply
            pass

    async def get(self) -> Reply:
        return await self._queue.get()


@dataclass(frozen=True, slots=True, eq=False)
class Job:
    """One HTTP request to complete: what the worker needs, and where its replies go."""

    sampling: SamplingParams
    generation: GenerationParams
    stream: bool
    replies: Mailbox | queue.Queue
    prompt: str | None = None  # /v1/completions
    messages: list[dict[str, str]] | None = None  # /v1/chat/completions
    arrived: float = field(default_factory=time.monotonic)  # when it was made, its request read


@dataclass(eq=False)
class Running:
    """The worker's record of an admitted job."""

    job: Job
    prompt_tokens: int
    tokens: list[int] = field(default_factory=list)
    sent: str = ""  # text streamed so far
    first_s: float | None = None  # seconds from its arrival to its first generated token


class EngineWorker:
    """Owns the engine: `run` admits jobs, steps the engine while any is unfinished and routes the text, until
    `close`.

    Run it on the thread that loaded the model: OpenMP (PyTorch's and the native kernels') keeps a pool of worker
    threads for every thread that starts parallel work, and once a process holds more such threads than cores a
    thread waiting at one of the layer stack's barriers sleeps instead of spinning (docs/serving.md has the
    measurement).
    """

    def __init__(self, target: LoadedModel, params: EngineParams, max_waiting: int = 64,
                 proposer: Proposer | None = None) -> None:
        """proposer: the engine's (None: the one `params` names)."""
        check_int("max_waiting", max_waiting, 0, MAX_WAITING)
        self.target, self.params = target, params
        self.engine = Engine(target, params, record_blocks=False, proposer=proposer)
        self.finished = 0
        self.preemptions = 0  # over every engine this worker ran
        self.metrics = ServerMetrics(lambda: self.state, target.name)  # read at a scrape, from another thread
        self.capacity = params.max_running + max_waiting  # jobs held at once, running or waiting
        self.held = 0  # jobs submitted and not yet answered for good
        self._inbox: queue.Queue[Job | None] = queue.Queue()  # None: close
        self._cancelled: queue.Queue[Job] = queue.Queue()
        self._running: dict[int, Running] = {}  # engine request id -> its record
        self._lock = threading.Lock()  # orders `submit` against the close, so no job is left unanswered
        self._closed = False
        self._outbox: list[tuple[Job, Reply]] = []  # replies of this round, sent once the state is updated
        self.weights = target.model.formats_read()  # what the products read, in words
        self.state = self._snapshot()

    def submit(self, job: Job) -> None:
        """Queue a job; ApiError (503) when the server is shutting down or holds all the jobs it may."""
        with self._lock:
            if self._closed:
                raise shutting_down()
            if self.held >= self.capacity:
                raise server_error(f"the server holds {self.held} requests, its most ({self.params.max_running} "
                                   "running and --max-waiting waiting); try again shortly",
                                   HTTPStatus.SERVICE_UNAVAILABLE)
            self.held += 1
            self._inbox.put(job)

    def cancel(self, job: Job) -> None:
        """The client went away: stop decoding for it (a job already finished or refused is left alone)."""
        self._cancelled.put(job)

    def close(self) -> None:
        """Make `run` return (from any thread, or a signal handler)."""
        self._inbox.put(None)

    def run(self) -> None:
        """Serve jobs until `close` (or an exception such as Ctrl+C's); every job it holds then gets a 503."""
        try:
            while True:
                jobs = self._arrivals()
                for job in jobs:
                    if job is None:
                        return
                    self._admit(job)
                self._abort_cancelled()
                if self.engine.has_unfinished():
                    self._step()
                self.state = self._snapshot()
                self._send()  # after the snapshot: a client that has its answer reads /v1/engine without it
        finally:
            with self._lock:
                self._closed = True
            self._fail_all(shutting_down())
            while True:  # and the jobs submitted but not admitted
                try:
                    job = self._inbox.get_nowait()
                except queue.Empty:
                    break
                if job is not None:
                    self._answer(job, Reply(error=shutting_down()))
            self._send()

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
        except ApiError as exc:
            self._answer(job, Reply(error=exc))
            return
        except ConfigError as exc:
            self._answer(job, Reply(error=ApiError(str(exc))))
            return
        except Exception as exc:  # the tokenizer or the engine refused this one request: the others go on
            traceback.print_exc()
            self._answer(job, Reply(error=server_error(f"the request could not be admitted: {exc}")))
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
                self._end(request_id)
                with self._lock:
                    self.held -= 1

    def _end(self, request_id: int) -> Job:
        """Stop a request (a no-op for one finished) and drop every record of it."""
        record = self._running.pop(request_id)
        self.engine.abort(request_id)
        self.engine.forget(request_id)
        return record.job

    def _answer(self, job: Job, reply: Reply) -> None:
        """A job's last reply: its result or its error."""
        with self._lock:
            self.held -= 1
        self._outbox.append((job, reply))

    def _send(self) -> None:
        """Hand over the replies of this round, in order."""
        for job, reply in self._outbox:
            job.replies.put(reply)
        self._outbox.clear()

    def _step(self) -> None:
        try:
            outputs = self.engine.step()
        except Exception as exc:  # the shared forward failed (a bug, the device out of memory): keep serving
            traceback.print_exc()
            # a fresh engine over the same proposer (its weights loaded once; its per-request state dropped)
            self.engine.close()
            drafts = self.engine.drafts  # its counters go on (Prometheus's counters never go back)
            self.engine = Engine(self.target, self.params, record_blocks=False, proposer=self.engine.proposer,
                                 costs=self.engine.costs)
            self.engine.drafts = drafts
            self._fail_all(server_error(f"the engine failed: {exc}"))
            return
        # a server keeps no history: it counts the preemptions; the state it reports is read from the cache
        self.preemptions += sum(isinstance(e, PreemptEvent) for e in self.engine.take_events())
        for output in outputs:
            try:
                self._deliver(output)
            except Exception as exc:  # detokenizing this request's text failed: it alone ends
                traceback.print_exc()
                self._answer(self._end(output.id), Reply(error=server_error(f"the request failed: {exc}")))

    def _deliver(self, output: RequestOutput) -> None:
        record = self._running[output.id]
        job = record.job
        if output.error is not None:
            self._answer(self._end(output.id), Reply(error=server_error(f"the request failed: {output.error}")))
            return
        record.tokens.extend(output.new_token_ids)
        if record.first_s is None and record.tokens:
            record.first_s = time.monotonic() - job.arrived
        if output.finished:
            usage = {"prompt_tokens": record.prompt_tokens, "completion_tokens": len(record.tokens),
                     "total_tokens": record.prompt_tokens + len(record.tokens)}
            # the rest of the text: all of it unless pieces were streamed
            final = output.output
            assert final is not None  # a finished request's step output carries its whole output
            reply = Reply(final.text[len(record.sent):], FINISH_REASONS[final.finish_reason], usage)
            self._end(output.id)  # only once the reply is made: a failure before leaves the record to `_step`
            self.finished += 1
            self.metrics.answered(FINISH_REASONS[final.finish_reason], record.prompt_tokens, len(record.tokens),
                                  record.first_s, time.monotonic() - job.arrived)
            self._answer(job, reply)
        elif job.stream:
            text = self.target.tokenizer.decode(record.tokens, skip_special_tokens=True)
            settled = settled_text(text, job.generation.stop)
            if len(settled) > len(record.sent) and settled.startswith(record.sent):
                self._outbox.append((job, Reply(settled[len(record.sent):])))
                record.sent = settled

    def _fail_all(self, error: ApiError) -> None:
        """Answer every admitted job with an error."""
        for record in self._running.values():
            self._answer(record.job, Reply(error=error))
        self._running.clear()

    def _snapshot(self) -> dict[str, Any]:
        engine = self.engine
        memory = engine.cache.memory()
        rests = engine.rests()
        return {"model": self.target.name, "weights": self.weights, "running": len(engine.running),
                "waiting": len(engine.waiting),
                "finished": self.finished, "preemptions": self.preemptions, "steps": engine.step_count,
                "engine_s": round(engine.busy_s, 3),
                "kv": {"block_size": self.params.block_size, "blocks_total": memory.blocks_total,
                       "blocks_used": memory.blocks_used, "blocks_shared": memory.blocks_shared,
                       "bytes_used": memory.bytes_used, "bytes_reserved": memory.bytes_reserved},
                "params": {"num_blocks": self.params.num_blocks, "block_size": self.params.block_size,
                           "max_running": self.params.max_running, "max_batch_tokens": self.params.max_batch_tokens,
                           "prefix_caching": self.params.prefix_caching, "plan": self.params.plan},
                "proposer": None if engine.proposer is None else {
                    **engine.proposer.describe(),
                    "counts": {source: asdict(counts) for source, counts in engine.counts.items()},
                    # times drafting rested, its steps committing fewer tokens a second than plain ones (`Payoff`)
                    "rests": None if rests is None else rests[0]},
                # every proposal verified, as vLLM counts speculative decoding (`engine.Drafts`)
                "drafts": None if engine.proposer is None else {**asdict(engine.drafts),
                                                                "accepted": engine.drafts.accepted}}
