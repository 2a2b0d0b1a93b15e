"""What generation shares: prompt encoding and its checks, stop rules, the caches a model runs on, and a
one-sequence forward for the notebooks and for timing."""

from __future__ import annotations

import statistics
import time
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch

from ..config import ConfigError, EngineParams, GenerationParams
from ..kv import ContiguousKVCache, KVCache, PagedKVCache, blocks_for
from ..models import LoadedModel, Transformer
from ..models.vocab import OutputRows


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


STOP_MARGIN_TOKENS = 8


class Stopper:
    """Decides, token by token, whether generation is over: end-of-sequence id, length, or a stop string."""

    def __init__(self, tokenizer: Any, eos_ids: Iterable[int], generation: GenerationParams) -> None:
        self.tokenizer = tokenizer
        self.eos_ids = frozenset(eos_ids)
        self.generation = generation
        self.tokens: list[int] = []
        self.reason: str | None = None
        # a stop string the newest token completes lies within the last tokens: L characters span at most 4 L
        # tokens (a character's UTF-8 bytes may come one token each), and a margin keeps the window's first token,
        # which may decode differently alone, clear of it
        self._window = 4 * max(map(len, generation.stop), default=0) + STOP_MARGIN_TOKENS

    def push(self, token: int) -> bool:
        """Record one generated token; True when it ends generation (it is kept either way)."""
        if self.reason is not None:
            raise RuntimeError("generation already finished")
        self.tokens.append(token)
        if token in self.eos_ids:
            self.reason = "eos"
        elif self.generation.stop and any(s in self._tail() for s in self.generation.stop):
            self.reason = "stop"
        elif len(self.tokens) >= self.generation.max_new_tokens:
            self.reason = "length"
        return self.reason is not None

    def _text(self) -> str:
        return self.tokenizer.decode(self.tokens, skip_special_tokens=True)

    def _tail(self) -> str:
        """The text of the last tokens, where a stop string can end now: checked every token, a match ending
        earlier would have stopped generation earlier; decoding only these keeps a step's cost flat as text grows."""
        return self.tokenizer.decode(self.tokens[-self._window:], skip_special_tokens=True)

    def final_text(self) -> str:
        text = self._text()
        if self.reason == "stop":
            text = text[: min(text.find(s) for s in self.generation.stop if s in text)]
        return text

    def output(self, wall_s: float) -> DecodeOutput:
        """The generation's result: the tokens, the text cut at a stop string, and why it ended."""
        return DecodeOutput(tuple(self.tokens), self.final_text(), self.reason or "length", wall_s)


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
