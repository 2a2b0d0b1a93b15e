"""What every decoder shares: prompt encoding, stop rules, the engine clock, and the generator protocol.

A decoder's `run(prompt_ids)` is a generator: it yields trace events as it goes (so a UI can animate live) and
returns a `DecodeOutput`. Its loop is the same named steps for every algorithm:
propose -> verify (one target forward) -> accept -> commit (cache rollback).
"""

from __future__ import annotations

import statistics
import time
from abc import ABC, abstractmethod
from collections.abc import Generator, Iterable, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from ..config import ConfigError, EngineParams, GenerationParams, SamplingParams
from ..kv import ContiguousKVCache, KVCache, PagedKVCache, blocks_for
from ..models import LoadedModel, Transformer
from ..models.vocab import OutputRows
from ..sampling import make_generator, next_token
from ..trace import BonusEvent, CommitEvent, Event, FinishEvent, KVAllocEvent, PrefillEvent, TokenInfo, Trace

EventStream = Generator[Event, None, "DecodeOutput"]


@dataclass(frozen=True, slots=True)
class DecodeOutput:
    token_ids: tuple[int, ...]  # generated ids only, including an end-of-sequence id that ended the run
    text: str
    finish_reason: str  # "eos" | "length" | "stop"
    wall_s: float


def encode_prompt(target: LoadedModel, prompt: str, generation: GenerationParams) -> list[int]:
    """Token ids for a prompt: the tokenizer's own chat template for instruct models (no extra system prompt)
    unless `generation.raw`; checked against the model's context length."""
    if not isinstance(prompt, str) or not prompt.strip():
        raise ConfigError("prompt must be a non-empty string")
    if target.chat and not generation.raw:
        ids = chat_ids(target.tokenizer, [{"role": "user", "content": prompt}])
    else:
        ids = list(target.tokenizer(prompt).input_ids)
    check_context(target, len(ids), generation.max_new_tokens)
    return ids


def chat_ids(tokenizer: Any, messages: list[dict[str, str]]) -> list[int]:
    """A conversation through the tokenizer's chat template, ending where the assistant's reply begins."""
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)
    return list(ids["input_ids"] if isinstance(ids, dict) else ids)


def check_context(target: LoadedModel, prompt_tokens: int, max_new_tokens: int,
                  field: str = "max_new_tokens") -> None:
    """A prompt and its longest continuation must fit the model's context; `field` names the length limit as the
    caller's user knows it."""
    limit = target.model.config.max_position_embeddings
    if prompt_tokens + max_new_tokens > limit:
        raise ConfigError(f"prompt is {prompt_tokens} tokens; prompt tokens + {field} must be <= {limit} "
                          f"(the model's context length), got {prompt_tokens + max_new_tokens}")


def paged_cache(model: Transformer, num_blocks: int, block_size: int) -> PagedKVCache:
    """A paged cache for the model's layers, heads and dtype, on its device."""
    cfg = model.config
    return PagedKVCache(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, num_blocks, block_size,
                        dtype=model.dtype, device=model.device)


def contiguous_cache(model: Transformer, capacity: int) -> ContiguousKVCache:
    """A one-row contiguous cache of `capacity` tokens for the model's layers, heads and dtype, on its device."""
    cfg = model.config
    return ContiguousKVCache(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, capacity, dtype=model.dtype,
                             device=model.device)


def engine_cache(model: Transformer, params: EngineParams) -> PagedKVCache | ContiguousKVCache:
    """The cache of the kind `params.kv` names for an engine's model: the pool of num_blocks x block_size slots,
    paged, or one contiguous row of as many."""
    if params.kv == "paged":
        return paged_cache(model, params.num_blocks, params.block_size)
    return contiguous_cache(model, params.num_blocks * params.block_size)


def new_cache(model: Transformer, capacity: int, generation: GenerationParams) -> KVCache:
    """A one-sequence cache of the kind `generation.kv` names, sized for `capacity` tokens."""
    if generation.kv == "paged":
        return paged_cache(model, blocks_for(capacity, generation.block_size), generation.block_size)
    return contiguous_cache(model, capacity)


@torch.inference_mode()
def forward_tokens(model: Transformer, cache: KVCache, token_ids: list[int], num_logits: int = 1,
                   rows: OutputRows | None = None, scored_only: bool = False) -> torch.Tensor:
    """Append tokens to sequence 0 of the cache in one forward; logits (num_logits, V) of the last positions,
    scored on `rows` only (-inf elsewhere) when given, or with `scored_only` just those (num_logits, V'), in the
    order of rows.ids.

    Inference mode wraps each forward, not a decoder's loop: a generator suspended at `yield` must not leave
    the consumer's code running in it.
    """
    start = cache.length(0)
    ids = torch.tensor([token_ids], device=model.device)  # (1, T)
    positions = torch.arange(start, start + len(token_ids), device=model.device).unsqueeze(0)  # (1, T)
    if rows is None:
        logits, _ = model(ids, positions, cache, (0,), num_logits=num_logits)  # (1, n, V)
        return logits[0]
    _, hidden = model(ids, positions, cache, (0,), num_logits=0)  # hidden: (1, T, E)
    if scored_only:
        return rows.logits(hidden[0, -num_logits:])  # (n, V')
    return rows.full_logits(hidden[0, -num_logits:], model.config.vocab_size)  # (n, V)


@torch.inference_mode()
def forward_tree(model: Transformer, cache: KVCache, token_ids: list[int], depths: Sequence[int],
                 mask: torch.Tensor, num_logits: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Append tokens to sequence 0 of the cache in one forward where they are not one text: token i sits at
    position (cache length + depths[i]) and sees the prefix and the new tokens marked in mask[i] (T, T).
    Returns logits (n, V) of the last num_logits tokens (all by default) and hidden states (T, E)."""
    start = cache.length(0)
    ids = torch.tensor([token_ids], device=model.device)  # (1, T)
    positions = (torch.tensor(list(depths), device=model.device) + start).unsqueeze(0)  # (1, T)
    logits, hidden = model(ids, positions, cache, (0,), attn_mask=mask.to(model.device), num_logits=num_logits)
    return logits[0], hidden[0]


def commit_event(step: int, step_start: float, end: float, draft_s: float, verify_s: float, num_tokens: int,
                 kv_bytes: int) -> CommitEvent:
    """The event closing a step that ran from engine time step_start to end; what was neither drafting nor
    verifying is overhead (acceptance, cache rollback, bookkeeping)."""
    return CommitEvent(step=step, t=end, num_tokens=num_tokens, draft_s=draft_s, verify_s=verify_s,
                       overhead_s=end - step_start - draft_s - verify_s, kv_bytes=kv_bytes)


def prefill_events(t: float, cache: KVCache, num_tokens: int) -> tuple[PrefillEvent, KVAllocEvent]:
    """The events of a target prefill that ended at engine time t."""
    memory = cache.memory()
    return (PrefillEvent(step=0, t=t, num_tokens=num_tokens, wall_s=t),
            KVAllocEvent(step=0, t=t, seq=0, num_tokens=num_tokens, bytes_used=memory.bytes_used,
                         bytes_reserved=memory.bytes_reserved))


class Stopper:
    """Decides, token by token, whether generation is over: end-of-sequence id, length, or a stop string."""

    def __init__(self, tokenizer: Any, eos_ids: Iterable[int], generation: GenerationParams) -> None:
        self.tokenizer = tokenizer
        self.eos_ids = frozenset(eos_ids)
        self.generation = generation
        self.tokens: list[int] = []
        self.reason: str | None = None

    def push(self, token: int) -> bool:
        """Record one generated token; True when it ends generation (it is kept either way)."""
        if self.reason is not None:
            raise RuntimeError("generation already finished")
        self.tokens.append(token)
        if token in self.eos_ids:
            self.reason = "eos"
        elif self.generation.stop and any(s in self._text() for s in self.generation.stop):
            self.reason = "stop"
        elif len(self.tokens) >= self.generation.max_new_tokens:
            self.reason = "length"
        return self.reason is not None

    def _text(self) -> str:
        return self.tokenizer.decode(self.tokens, skip_special_tokens=True)

    def final_text(self) -> str:
        text = self._text()
        if self.reason == "stop":
            text = text[: min(text.find(s) for s in self.generation.stop if s in text)]
        return text

    def output(self, wall_s: float) -> DecodeOutput:
        """The generation's result: the tokens, the text cut at a stop string, and why it ended."""
        return DecodeOutput(tuple(self.tokens), self.final_text(), self.reason or "length", wall_s)


class EngineClock:
    """Seconds of engine work since start, not counting time spent suspended at a `yield` (rendering)."""

    def __init__(self, device: torch.device) -> None:
        self._sync = device.type == "cuda"
        self._paused_at: float | None = None
        self._paused_total = 0.0
        self._start = time.perf_counter()

    def now(self) -> float:
        if self._sync:
            torch.cuda.synchronize()  # GPU work is asynchronous: time it when it has really finished
        return time.perf_counter() - self._start - self._paused_total

    def emit(self, *events: Event) -> Generator[Event, None, None]:
        """Yield events with the clock stopped while the consumer handles them."""
        paused = time.perf_counter()
        yield from events
        self._paused_total += time.perf_counter() - paused


class Decoder(ABC):
    """One decoding algorithm over a target model; instances are cheap and hold no per-run state."""

    algo: ClassVar[str]

    def __init__(self, target: LoadedModel, sampling: SamplingParams, generation: GenerationParams) -> None:
        self.target = target
        self.sampling = sampling
        self.generation = generation

    def params(self) -> dict[str, Any]:
        """Settings recorded in the trace header."""
        return {"temperature": self.sampling.temperature, "top_k": self.sampling.top_k,
                "top_p": self.sampling.top_p, "seed": self.sampling.seed,
                "max_new_tokens": self.generation.max_new_tokens, "raw": self.generation.raw,
                "kv": self.generation.kv, "block_size": self.generation.block_size}

    @abstractmethod
    def run(self, prompt_ids: list[int]) -> EventStream:
        """Generate from prompt ids, yielding trace events; returns the output."""

    def start(self) -> tuple[EngineClock, torch.Generator, Stopper]:
        """Per-run state: the engine clock, the seeded random stream and the stop rules."""
        device = self.target.model.device
        return (EngineClock(device), make_generator(self.sampling.seed, device),
                Stopper(self.target.tokenizer, self.target.eos_token_ids, self.generation))

    def prefill(self, cache: KVCache, prompt_ids: list[int], clock: EngineClock,
                generator: torch.Generator, stopper: Stopper) -> Generator[Event, None, tuple[int, bool]]:
        """Step 0: one target forward over the prompt and the first token drawn from it. Yields the step's events
        and returns (token, done); the token is committed but not yet in the cache."""
        logits = forward_tokens(self.target.model, cache, prompt_ids)[-1]  # (V,)
        return (yield from self.first_token(logits, cache, len(prompt_ids), clock, generator, stopper))

    def first_token(self, logits: torch.Tensor, cache: KVCache, prompt_len: int, clock: EngineClock,
                    generator: torch.Generator, stopper: Stopper) -> Generator[Event, None, tuple[int, bool]]:
        """The rest of step 0 once the prompt's forward gave the logits (V,) of its last position."""
        now = clock.now()
        yield from clock.emit(*prefill_events(now, cache, prompt_len))
        token_t, p_t = next_token(logits, self.sampling, generator)
        token = int(token_t)
        done = stopper.push(token)
        end = clock.now()
        yield from clock.emit(
            BonusEvent(step=0, t=end, token=self.token_info(token, prompt_len, p=float(p_t))),
            commit_event(0, 0.0, end, 0.0, now, 1, cache.memory().bytes_used))
        return token, done

    def token_info(self, token: int, position: int, p: float | None = None, q: float | None = None,
                   parent: int | None = None) -> TokenInfo:
        text = self.target.tokenizer.decode([token])
        return TokenInfo(id=token, text=text, position=position, p=p, q=q, parent=parent)

    def finish(self, stopper: Stopper, clock: EngineClock, step: int) -> tuple[FinishEvent, DecodeOutput]:
        output = stopper.output(clock.now())
        event = FinishEvent(step=step, t=output.wall_s, reason=output.finish_reason, token_ids=list(output.token_ids),
                            text=output.text, wall_s=output.wall_s)
        return event, output


def stream_generate(decoder: Decoder, prompt: str) -> Generator[Event, None, tuple[DecodeOutput, Trace]]:
    """Run a decoder on a text prompt, yielding each trace event as it happens (the engine clock is stopped
    while the consumer handles it); returns the output and the whole trace."""
    prompt_ids = encode_prompt(decoder.target, prompt, decoder.generation)
    trace = Trace(algo=decoder.algo, model=decoder.target.name, prompt=prompt, prompt_ids=prompt_ids,
                  params=decoder.params())
    stream = decoder.run(prompt_ids)
    while True:
        try:
            event = next(stream)
        except StopIteration as stop:
            return stop.value, trace
        trace.events.append(event)
        yield event


def generate(decoder: Decoder, prompt: str) -> tuple[DecodeOutput, Trace]:
    """Run a decoder to the end on a text prompt and collect its trace."""
    stream = stream_generate(decoder, prompt)
    while True:
        try:
            next(stream)
        except StopIteration as stop:
            return stop.value


def decode_step_seconds(model: Any, width: int = 1, steps: int = 20, rows: Any = None) -> float:
    """Median wall time of a forward over `width` new tokens after a 32-token prefill: one decode step for
    width 1, one verification of width - 1 drafted tokens otherwise. `rows`: score only these output rows, as a
    draft with a proposal vocabulary does."""
    cache = new_cache(model, 32 + width, GenerationParams())
    forward_tokens(model, cache, list(range(100, 132)))
    times = []
    for i in range(steps):
        start = time.perf_counter()
        forward_tokens(model, cache, list(range(200 + i, 200 + i + width)), rows=rows)
        if model.device.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
        cache.truncate(0, 32)
    return statistics.median(times)
