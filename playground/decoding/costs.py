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
import os
import statistics
import time
from abc import ABC, abstractmethod
from collections import deque
from collections.abc import Iterator
from contextlib import contextmanager
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

    @abstractmethod
    def provenance(self) -> str:
        """Where its figures come from, in words: when and how quietly they were measured."""

    @abstractmethod
    def measured(self) -> ForwardCosts:
        """The curve as measured, before any live correction: what reports quote."""


@dataclass(frozen=True, slots=True)
class OneRequest:
    """What a one-request engine's decode forward costs by width, in one-token forwards: the figures every report
    about a run quotes (the drafting note, the Theory tab, a run's ceiling), all read from one measured curve, with
    where it comes from. A `LiveCosts` is quoted by its measured curve: the live corrections price the engine's
    plan as the machine's load comes and goes, so figures read from them would differ from one minute to the next;
    what they saw is told beside the curve instead (`LiveCosts.provenance`)."""

    costs: ByWidth

    def __call__(self, width: int) -> float:
        return self.costs.measured().step_cost(1, width)

    def provenance(self) -> str:
        return self.costs.provenance()


# a curve is "taken under load" where other processes used more than BUSY_CORES of the processors meanwhile, or where
# its rounds disagree: the median round of a width over the fastest by more than BUSY_SPREAD (median over widths)
BUSY_CORES, BUSY_SPREAD = 0.25, 0.15


@dataclass(frozen=True, slots=True)
class ForwardCosts(ByWidth):
    tokens: tuple[int, ...]  # widths measured, ascending, the first 1
    seconds: tuple[float, ...]  # seconds of a forward over that many tokens (see `measure`), never decreasing
    taken: str | None = None  # when it was measured (UTC, ISO 8601); None: a curve no host measured
    others: float | None = None  # processors other processes kept busy meanwhile (None: not known on this host)
    spread: float | None = None  # how much its rounds disagreed: median over widths of median / fastest - 1

    @property
    def busy(self) -> bool:
        """Whether it was taken under load: other processes running meanwhile, or its rounds disagreeing."""
        return ((self.others is not None and self.others > BUSY_CORES)
                or (self.spread is not None and self.spread > BUSY_SPREAD))

    def measured(self) -> ForwardCosts:
        return self

    def provenance(self) -> str:
        """When and how quietly it was measured, in words."""
        if self.taken is None:
            return "not measured here (a fixed curve)"
        when = self.taken[:16].replace("T", " ") + " UTC"
        if not self.busy:
            return f"measured on this machine {when}, while it was quiet"
        why = (f"other processes kept {self.others:.1f} processors busy" if self.others is not None
               and self.others > BUSY_CORES else f"its rounds disagreed by {self.spread:.0%}")
        return f"measured on this machine {when} under load ({why}): its figures may be off"

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
    # a width's live price, relative to a one-token forward's, stays at least the curve's relative price over BOUND
    # and within [1, width]: a forward never costs less than a one-token one, nor more than its tokens run one by
    # one; below that, the one-token samples met a busy moment the wider ones did not (and a perfect proposer would
    # seem to gain more than the machine allows)
    BOUND = 2.0

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
        """Seconds of a forward over `tokens` new tokens: the curve's, corrected, its price relative to a one-token
        forward's at least the curve's over BOUND and within [1, tokens]."""
        if tokens not in self.times:
            one = self.curve.time(1) * self.correction(1)
            shape = self.curve.time(tokens) / self.curve.time(1)  # the curve's relative price
            live = shape * self.correction(tokens) / self.correction(1)
            low = max(1.0, shape / self.BOUND)
            self.times[tokens] = one * min(max(live, low), max(low, float(tokens)))
        return self.times[tokens]

    def measured(self) -> ForwardCosts:
        return self.curve

    def slowdown(self) -> float:
        """How much slower than the curve this process's one-token forwards run lately (1 before any is measured)."""
        return self.correction(1)

    def provenance(self) -> str:
        """Where the curve's figures come from, in words: its date and load, and how this process's forwards have
        run against it (they correct the engine's plan, never the figures quoted)."""
        said = self.curve.provenance()
        if self.known and self.slowdown() > 1 + DRIFT:
            said += (f"; this process's one-token forwards have run {self.slowdown():.1f}x slower than that since: "
                     "the machine is busier now, and the engine prices its steps as they run")
        return said


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
    round is the one kept (a median keeps what a busy host imposed on most rounds). The curve says when it was taken,
    how many processors other processes kept busy meanwhile and how much its rounds disagreed (`ForwardCosts.busy`)."""
    vocab = model.config.vocab_size
    meter = LoadMeter()
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
    others = meter.others()
    seconds, slowest = [], 0.0
    for width in widths:  # a wider forward never costs less: noise that says so is flattened
        slowest = max(slowest, min(times[width]))
        seconds.append(slowest)
    spread = statistics.median(statistics.median(t) / min(t) - 1 for t in times.values())
    taken = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    return ForwardCosts(widths, tuple(seconds), taken, others, spread)


class LoadMeter:
    """How many processors other processes (and a hypervisor's other guests: steal time) kept busy since it was
    made, from /proc/stat and this process's CPU time. None where that cannot be known: no /proc/stat (not Linux),
    or a /proc/stat counting more processors than this process may run on (a container on a larger host)."""

    def __init__(self) -> None:
        self.start = self._read()

    @staticmethod
    def _read() -> tuple[float, float, float] | None:
        """(busy seconds of every processor, this process's CPU seconds, wall seconds), or None."""
        try:
            with open("/proc/stat", encoding="ascii") as stat:
                lines = stat.read().splitlines()
            cpus = sum(line[:3] == "cpu" and line[3:4].isdigit() for line in lines)
            if cpus != len(os.sched_getaffinity(0)):
                return None
            # user nice system idle iowait irq softirq steal: busy is all but idle and iowait
            ticks = [int(x) for x in lines[0].split()[1:9]]
        except (OSError, ValueError, AttributeError, IndexError):
            return None
        busy = (sum(ticks) - ticks[3] - ticks[4]) / os.sysconf("SC_CLK_TCK")
        own = os.times()
        return busy, own.user + own.system, time.monotonic()

    def others(self) -> float | None:
        end = self._read()
        if self.start is None or end is None or end[2] <= self.start[2]:
            return None
        busy, own, wall = (b - a for a, b in zip(self.start, end))
        return max(0.0, (busy - own) / wall)


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
                  requests: int = 1) -> LiveCosts | ForwardCosts:
    """This machine's costs for the model's decode forwards run the way `forwards` names in an engine of up to
    `requests` requests (`models.forwards.make_forwards`): the curve read from the cache (once per process), else
    measured (a few seconds) and cached, as one `LiveCosts` per process that every engine's forwards correct; inside
    `pinned`, the curve pinned instead."""
    if _PINNED and _PINNED[-1] is not None:
        return _PINNED[-1]
    path = (cache_root or default_cache_root()) / "forward-costs" / f"{machine_key(model, forwards, requests)}.json"
    if path not in _READ:
        _READ[path] = LiveCosts(_read_or_measure(model, path, forwards, requests))
    return _READ[path]


_READ: dict[Path, LiveCosts] = {}
_PINNED: list[ForwardCosts | None] = []


@contextmanager
def pinned(curve: ForwardCosts | None) -> Iterator[None]:
    """Every engine made inside plans on `curve` where it would plan on this machine's costs (`forward_costs`): a
    curve given, so its plans are alike whatever the host does and whatever ran before (`engine.planner`), as the
    tests and reproducible experiments want; None: this machine's costs again, inside an outer pin."""
    _PINNED.append(curve)
    try:
        yield
    finally:
        _PINNED.pop()
# a cached curve is checked at these widths (a few forwards) and measured again where any is off by more than DRIFT
CHECKED, DRIFT = (1, 8), 0.25


def _quieter(a: ForwardCosts, b: ForwardCosts) -> ForwardCosts:
    return min(a, b, key=lambda c: (c.busy, c.others or 0.0, c.spread or 0.0))


def _read_or_measure(model: Transformer, path: Path, forwards: str, requests: int) -> ForwardCosts:
    """The cached curve where it still holds and was taken while the machine was quiet; one taken under load is
    measured again once a process (the quieter kept, so a busy host's curve improves as quiet moments come, at one
    measurement a process); none, or one of another version of this module, is measured (again at once where the
    first was taken under load) and cached."""
    cached = None
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
        cached = ForwardCosts(tuple(data["tokens"]), tuple(data["seconds"]), data["taken"], data["others"],
                              data["spread"])
        if cached.tokens != WIDTHS or len(cached.seconds) != len(WIDTHS) or not _holds(model, cached, forwards,
                                                                                       requests):
            cached = None
        elif not cached.busy:
            return cached
    except (OSError, ValueError, KeyError, TypeError):
        pass  # not measured yet, or by another version of this module: measure again
    costs = measure(model, forwards=forwards, requests=requests)
    if costs.busy:
        costs = _quieter(costs, cached or measure(model, forwards=forwards, requests=requests))
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_suffix(f".{time.time_ns()}.tmp")  # written whole, then moved into place
    partial.write_text(json.dumps(asdict(costs)), encoding="utf-8")
    partial.replace(path)
    return costs


def _holds(model: Transformer, cached: ForwardCosts, forwards: str, requests: int) -> bool:
    """Whether a cached curve still prices this host: a few forwards at CHECKED widths each within DRIFT of it (the
    cache may be shared by machines whose processors report the same, and run at other speeds)."""
    now = measure(model, rounds=3, forwards=forwards, requests=requests, widths=CHECKED)
    return all(abs(now.time(w) / cached.time(w) - 1) <= DRIFT for w in CHECKED)
