"""What a forward costs on this machine by how many new tokens it runs: measured once per model, device, dtype,
kernel and thread count, cached beside the converted weights, corrected by what the engines' forwards take as they
run (`LiveCosts`), and read by the engine's width planning (so by every proposer through it) instead of constants
fitted on one kind of CPU.

A batch of B sequences of W tokens each runs the same matrix products as one sequence of B x W tokens (the rows are
what the weights are read for); attention differs a little. So one curve, the time of a forward over T tokens after
a prompt of CONTEXT, prices every decode forward: a step of width W over a batch of B costs time(B W) / time(B)
one-token steps of that batch.
"""

from __future__ import annotations

import bisect
import hashlib
import json
import statistics
import time
from abc import ABC, abstractmethod
from collections import deque
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from ..config import GenerationParams
from ..metrics import FLAT_TOKEN_COST
from ..models import Transformer
from ..models.forwards import make_forwards, one_width
from ..paths import default_cache_root
from .base import forward_tokens, new_cache

# the forward widths measured (new tokens), and the context they follow; between them time is interpolated
WIDTHS = (1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 14, 16, 20, 24, 32, 48, 64)
CONTEXT = 256
ROUNDS = 5


class ByWidth(ABC):
    """What a forward costs by how many new tokens it runs (`time`), and so a decode step by its width."""

    __slots__ = ()

    @abstractmethod
    def time(self, tokens: int) -> float:
        """Seconds of a forward over `tokens` new tokens."""

    def step_cost(self, batch: int, width: int) -> float:
        """A decode forward over `batch` sequences of `width` tokens, relative to the same batch's one-token one."""
        return 1.0 if width == 1 else self.time(batch * width) / self.time(batch)


@dataclass(frozen=True, slots=True)
class ForwardCosts(ByWidth):
    tokens: tuple[int, ...]  # widths measured, ascending, the first 1
    seconds: tuple[float, ...]  # seconds of a forward over that many tokens (see `measure`), never decreasing

    def time(self, tokens: int) -> float:
        """Seconds of a forward over `tokens` new tokens: interpolated between widths measured, extrapolated past
        the widest at the slope of the last two."""
        xs, ys = self.tokens, self.seconds
        i = next((k for k in range(1, len(xs)) if xs[k] >= tokens), len(xs) - 1)
        slope = (ys[i] - ys[i - 1]) / (xs[i] - xs[i - 1])
        return ys[i - 1] + slope * (tokens - xs[i - 1])


class LiveCosts(ByWidth):
    """A measured curve (`ForwardCosts`) corrected by the decode forwards this process's engines run on it: per
    forward width in tokens, the median of its last WINDOW forwards' seconds over the curve's, once MEASURED are in;
    a width not run lately takes the correction of the nearest widths that were (interpolated between two). A curve
    is taken in a quiet tight loop, cached, and may have been taken on another machine of the same kind (a shared
    cache, a VM moved to a slower or faster host); a run's forwards meet what the host does meanwhile, the cache
    effects of the proposer's own work, tree masks. So the plan prices forwards as they run here and now, and a width
    that costs more than the curve said stops being chosen after a few steps. A width's samples are dropped once
    STALE forwards of other widths have run since its last (a price measured while the host was busy does not
    silence drafting for good)."""

    WINDOW, MEASURED, STALE = 16, 3, 512

    def __init__(self, curve: ForwardCosts) -> None:
        self.curve = curve
        self.samples: dict[int, deque[float]] = {}  # width in tokens -> its last forwards' seconds over the curve's
        self.last: dict[int, int] = {}  # width -> the forward count at its last sample
        self.forwards = 0
        self.corrections: dict[int, float] = {}  # width -> its samples' median, once MEASURED are in
        self.known: list[tuple[int, float]] = []  # the corrections, by width ascending
        self.times: dict[int, float] = {}  # memo of `time`, cleared by each sample

    def record(self, tokens: int, seconds: float) -> None:
        """A decode forward over `tokens` new tokens took `seconds` (as the step measured it: forward and logits)."""
        self.forwards += 1
        samples = self.samples.get(tokens)
        if samples is None:
            samples = self.samples[tokens] = deque(maxlen=self.WINDOW)
        samples.append(seconds / self.curve.time(tokens))
        self.last[tokens] = self.forwards
        if len(samples) >= self.MEASURED:
            self.corrections[tokens] = statistics.median(samples)
            self.known = sorted(self.corrections.items())
        if self.forwards - min(self.last.values()) > self.STALE:
            for width in [w for w, at in self.last.items() if self.forwards - at > self.STALE]:
                del self.samples[width], self.last[width]
                self.corrections.pop(width, None)
            self.known = sorted(self.corrections.items())
        self.times.clear()

    @property
    def tokens(self) -> tuple[int, ...]:
        """The widths the curve measured."""
        return self.curve.tokens

    def correction(self, tokens: int) -> float:
        """What a forward over `tokens` takes over what the curve says (1 before any width is measured)."""
        known = self.known
        if not known:
            return 1.0
        i = bisect.bisect_left(known, (tokens, -1.0))
        if i == len(known):
            return known[-1][1]
        if known[i][0] == tokens or i == 0:
            return known[i][1]
        (x0, y0), (x1, y1) = known[i - 1], known[i]
        return y0 + (y1 - y0) * (tokens - x0) / (x1 - x0)

    def time(self, tokens: int) -> float:
        """Seconds of a forward over `tokens` new tokens: the curve's, corrected."""
        if tokens not in self.times:
            self.times[tokens] = self.curve.time(tokens) * self.correction(tokens)
        return self.times[tokens]


def flat(token_cost: float = FLAT_TOKEN_COST) -> ForwardCosts:
    """A curve no host measured, where each token of a forward beyond the first adds `token_cost` of a one-token
    forward (as on a GPU, where a forward over a few tokens costs about one): planning that judges a proposer rather
    than this machine (`experiments/gpu_ceiling.py`, the EAGLE trainer's held-out evaluation)."""
    return ForwardCosts(WIDTHS, tuple(1.0 + token_cost * (w - 1) for w in WIDTHS))


@torch.inference_mode()
def measure(model: Transformer, rounds: int = ROUNDS, forwards: str = "eager", requests: int = 1,
            widths: tuple[int, ...] = WIDTHS) -> ForwardCosts:
    """The fastest of `rounds` forwards over each of `widths` new tokens after a prompt of CONTEXT, the widths
    interleaved round by round, run as a step of an engine of up to `requests` requests runs them (the decode
    forwards `forwards` names, then the logits of every row): another process on the host only ever slows a
    forward, and the curve is cached (later processes check it with a few forwards, `_holds`), so the least disturbed
    round is the one kept (a median keeps what a busy host imposed on most rounds)."""
    vocab = model.config.vocab_size
    cache = new_cache(model, CONTEXT + max(widths), GenerationParams())
    forward_tokens(model, cache, [i % vocab for i in range(CONTEXT)])
    run = make_forwards(model, cache, forwards, requests)
    times: dict[int, list[float]] = {width: [] for width in widths}
    for _ in range(rounds):
        for width in widths:
            start = time.perf_counter()
            model.project(run([0], [[(7 * i) % vocab for i in range(width)]], [list(range(CONTEXT, CONTEXT + width))]))
            if model.device.type == "cuda":
                torch.cuda.synchronize()
            times[width].append(time.perf_counter() - start)
            cache.truncate(0, CONTEXT)
    seconds, slowest = [], 0.0
    for width in widths:  # a wider forward never costs less: noise that says so is flattened
        slowest = max(slowest, min(times[width]))
        seconds.append(slowest)
    return ForwardCosts(widths, tuple(seconds))


def machine_key(model: Transformer, forwards: str = "eager", requests: int = 1) -> str:
    """What a forward's cost depends on besides the widths: the model's shape, dtype, device, kernel, the formats
    its products read (float32, 16-bit, GGUF blocks), threads and how its decode forwards run."""
    shape = json.dumps(asdict(model.config), sort_keys=True, default=str)
    products = model.packed_products()
    formats = sorted({panels.format for _, panels in products})
    kernel = products[0][1].kernel.path.name if products else ""  # the build, which names its source's hash
    parts = [shape, str(model.dtype), str(model.device), str(model.rows_per_pass), kernel, str(formats),
             str(torch.get_num_threads()), torch.__version__]
    if forwards != "eager":
        parts += [forwards, f"one width {one_width(model, requests)}"]
    return hashlib.sha256("|".join(parts).encode()).hexdigest()[:16]


def forward_costs(model: Transformer, cache_root: Path | None = None, forwards: str = "eager",
                  requests: int = 1) -> LiveCosts:
    """This machine's costs for the model's decode forwards run the way `forwards` names in an engine of up to
    `requests` requests (`models.forwards.make_forwards`): the curve read from the cache (once per process), else
    measured (a few seconds) and cached, as one `LiveCosts` per process that every engine's forwards correct."""
    path = (cache_root or default_cache_root()) / "forward-costs" / f"{machine_key(model, forwards, requests)}.json"
    if path not in _READ:
        _READ[path] = LiveCosts(_read_or_measure(model, path, forwards, requests))
    return _READ[path]


_READ: dict[Path, LiveCosts] = {}
# a cached curve is checked at these widths (a few forwards) and measured again where any is off by more than DRIFT
CHECKED, DRIFT = (1, 8), 0.25


def _read_or_measure(model: Transformer, path: Path, forwards: str, requests: int) -> ForwardCosts:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
        costs = ForwardCosts(tuple(data["tokens"]), tuple(data["seconds"]))
        if costs.tokens == WIDTHS and len(costs.seconds) == len(WIDTHS) and _holds(model, costs, forwards, requests):
            return costs
    except (OSError, ValueError, KeyError, TypeError):
        pass  # not measured yet, or by another version of this module: measure again
    costs = measure(model, forwards=forwards, requests=requests)
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_suffix(f".{time.time_ns()}.tmp")  # written whole, then moved into place
    partial.write_text(json.dumps({"tokens": costs.tokens, "seconds": costs.seconds}), encoding="utf-8")
    partial.replace(path)
    return costs


def _holds(model: Transformer, cached: ForwardCosts, forwards: str, requests: int) -> bool:
    """Whether a cached curve still prices this host: a few forwards at CHECKED widths each within DRIFT of it (the
    cache may be shared by machines whose processors report the same, and run at other speeds)."""
    now = measure(model, rounds=3, forwards=forwards, requests=requests, widths=CHECKED)
    return all(abs(now.time(w) / cached.time(w) - 1) <= DRIFT for w in CHECKED)
