"""Racing an OpenAI-compatible endpoint (vLLM, SGLang, llama.cpp's server, this project's own `serve`): the same
prompt streamed through `/v1/chat/completions` with the official `openai` client, timed by this process's wall clock
from the request to the stream's end. A remote run has no steps and no exactness check: its weights, its server and
the network between are its own, so the bench and the Race tab label it as a remote measurement."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit, urlunsplit

from .config import ConfigError, shown

CONNECT_S = 10.0  # an endpoint that does not answer a connection in this long is unreachable
READ_S = 300.0  # nor one that sends nothing for this long within a stream
MESSAGE_CHARS = 200  # a server's error message, as quoted


def endpoint_url(text: str) -> str:
    """An endpoint's base URL: http(s)://host[:port][/path], with `/v1` added to a bare host (the clients' base URL
    convention); ConfigError naming the field otherwise."""
    raw = text.strip() if isinstance(text, str) else ""
    try:
        parts = urlsplit(raw)
        parts.port  # noqa: B018 (a malformed port raises here)
    except ValueError:
        parts = None
    if parts is None or parts.scheme not in ("http", "https") or not parts.hostname or parts.query or parts.fragment:
        raise ConfigError(f"endpoint: expected an OpenAI-compatible server's base URL such as "
                          f"http://127.0.0.1:8000/v1; got {shown(text)}")
    path = parts.path.rstrip("/") or "/v1"
    return urlunsplit((parts.scheme, parts.netloc, path, "", ""))


def endpoint_urls(text: str) -> tuple[str, ...]:
    """`--endpoint`'s comma-separated base URLs (`endpoint_url` each), none repeated."""
    urls = tuple(endpoint_url(part) for part in text.split(","))
    if len(set(urls)) < len(urls):
        raise ConfigError(f"endpoint: {shown(text, 120)} names a server twice")
    return urls


@dataclass(frozen=True, slots=True)
class RemoteRun:
    """One streamed answer. tokens: the server's usage count where it sent one, else the chunks that carried text
    (`counted` says which); chunk_s: seconds from the request to each chunk that carried text, whose texts are
    `pieces`."""

    tokens: int
    wall_s: float
    chunk_s: tuple[float, ...]
    pieces: tuple[str, ...]
    counted: str  # "usage" | "chunks"
    finish_reason: str | None

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.wall_s if self.wall_s > 0 else 0.0

    @property
    def first_token_s(self) -> float | None:
        return self.chunk_s[0] if self.chunk_s else None

    @property
    def text(self) -> str:
        return "".join(self.pieces)


def median_round(runs: list[RemoteRun]) -> RemoteRun:
    """A lane's median round by tok/s (the upper middle of an even count)."""
    return sorted(runs, key=lambda r: r.tokens_per_s)[len(runs) // 2]


def median_ratio(runs: list[RemoteRun], local_tokens_per_s: list[float]) -> float:
    """The median over rounds of a remote run's tok/s over the local tok/s of the same round."""
    return statistics.median(r.tokens_per_s / local for r, local in zip(runs, local_tokens_per_s))


class Remote:
    """One endpoint: its base URL, the model asked for (given, else the first the server lists at /models; asked
    for either way, so an unreachable server, a wrong key or a model it does not serve is refused at once) and an
    API key."""

    def __init__(self, url: str, model: str | None = None, api_key: str | None = None) -> None:
        from openai import OpenAI, Timeout

        self.url = endpoint_url(url)
        # no retries: a retried request would be timed as one
        self.client = OpenAI(base_url=self.url, api_key=api_key or "none", max_retries=0,
                             timeout=Timeout(READ_S, connect=CONNECT_S))
        listed = self._call(lambda: [m.id for m in self.client.models.list()])  # reachable, and the key is right
        self.model = model.strip() if model and model.strip() else (listed or [""])[0]
        if self.model not in listed:
            served = ", ".join(repr(m) for m in listed[:5]) + (", ..." if len(listed) > 5 else "") or "none"
            raise ConfigError(f"endpoint: {self.url} serves {served}, not {shown(self.model, 80)} (model)")

    @property
    def label(self) -> str:
        """How the reports name it: the model (the last part of a path or hub id) at the host."""
        return f"{self.model.rstrip('/').rsplit('/', 1)[-1]} @ {urlsplit(self.url).netloc}"

    def stream(self, prompt: str, max_tokens: int, temperature: float = 0.0, seed: int | None = None,
               stopped: Callable[[], bool] | None = None) -> RemoteRun:
        """The prompt as one user message, streamed to its end (or until `stopped()` says so between two chunks); at
        temperature 0 greedy as the server decodes it."""
        from openai import omit

        start = time.perf_counter()

        def run() -> RemoteRun:
            times: list[float] = []
            pieces: list[str] = []
            usage, reason = None, None
            with self.client.chat.completions.create(
                    model=self.model, messages=[{"role": "user", "content": prompt}], max_tokens=max_tokens,
                    temperature=temperature, stream=True, stream_options={"include_usage": True},
                    seed=omit if seed is None or temperature == 0 else seed) as chunks:
                for chunk in chunks:
                    usage = chunk.usage or usage
                    for choice in chunk.choices:
                        if choice.delta is not None and choice.delta.content:
                            times.append(time.perf_counter() - start)
                            pieces.append(choice.delta.content)
                        reason = choice.finish_reason or reason
                    if stopped is not None and stopped():
                        break
            wall = time.perf_counter() - start
            if usage is not None and usage.completion_tokens is not None:
                return RemoteRun(usage.completion_tokens, wall, tuple(times), tuple(pieces), "usage", reason)
            return RemoteRun(len(pieces), wall, tuple(times), tuple(pieces), "chunks", reason)
        return self._call(run)

    def _call(self, call: Callable[[], Any]) -> Any:
        """A call to the server; its failure as one ConfigError line naming the endpoint and what went wrong."""
        import openai

        try:
            return call()
        except openai.AuthenticationError:
            raise ConfigError(f"endpoint: {self.url} refused the API key (401); pass its key") from None
        except openai.APIStatusError as exc:
            said = exc.body.get("message") if isinstance(exc.body, dict) else None  # the server's own words
            message = " ".join(str(said or exc.message).removeprefix(f"Error code: {exc.status_code}").lstrip(
                " -").split())[:MESSAGE_CHARS]
            raise ConfigError(f"endpoint: {self.url} answered {exc.status_code}: {message or 'no message'}") from None
        except openai.APIConnectionError as exc:
            cause = " ".join(str(exc.__cause__ or exc).split())[:MESSAGE_CHARS]
            raise ConfigError(f"endpoint: cannot reach {self.url} ({cause})") from None
        except openai.APIError as exc:  # an error the server sent within a stream
            message = " ".join(str(exc.message).split())[:MESSAGE_CHARS]
            raise ConfigError(f"endpoint: {self.url} failed: {message}") from None
