"""A model's decode forwards over one cache: the forwards of a step, each a few tokens per request after what the
cache holds, returning the final hidden states (B, T, E) and, where `taps` names layers, their inputs after them
(B, T, (1 + len(taps)) E; see `Transformer.forward`). Prefill chunks are not these (`Runner` runs them as they come).

Four ways, one contract (`ModelSpec.forwards`; the loader resolves "auto"):
- eager: every forward as long as its rows and its keys, built on the host (the CPU's way: the native kernel is
  fastest on exact shapes);
- static: every forward padded to a bucket of (rows, tokens per row, keys) - powers of two - whose inputs are the
  same device tensors from call to call: token ids, positions, the rows' start slots, the tokens' visibility among
  each other and the cache's slot indices, copied in one transfer; the attention mask is built from them on the
  device. Padding tokens and rows write a scratch slot that no row reads. Runs anywhere, for tests and debugging;
- graphs: static, each bucket captured once in a CUDA graph (`torch.cuda.CUDAGraph`) on first use and replayed
  after: one launch a forward instead of some hundreds. CUDA graphs directly rather than
  `torch.compile(mode="reduce-overhead")`: the same kernels as the eager path (no compile step of minutes per
  bucket on a Space's GPU slot, no recompiles as the key bucket grows), the capture is milliseconds;
- compiled: static, each layer's work around attention compiled (`models.compiled`: fewer, fused kernels), and on
  a CUDA GPU captured in graphs as `graphs` captures.
A bucket's graphs share one memory pool; the hidden states are copied out before the next forward can reuse it.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Sequence
from typing import Any, TypeVar, cast

import torch

from ..kv import AttentionLayout, ContiguousKVCache, KVCache, PagedKVCache, blocks_for
from ..kv.base import visibility
from ..waits import to_device
from .compiled import layer as compiled_layer
from .transformer import Transformer

T = TypeVar("T")
Ids = list[list[int]] | torch.Tensor  # a forward's token ids (B, T): lists, or an int64 tensor on the model's device
MIN_KEYS = 64  # the smallest key bucket (shorter contexts share one graph); key counts are multiples of it
ONE_WIDTH = 32  # the one width of every decode forward where the kernels' bits depend on shapes (`make_forwards`)
STAGING = 4  # pinned staging buffers per bucket on a GPU: how many forwards the host may fill ahead of the device


def bucket(n: int, floor: int = 1) -> int:
    """The power of two >= n (and >= floor)."""
    return max(floor, 1 << (n - 1).bit_length())


class Forwards:
    """Eager decode forwards: every forward built for its own shape."""

    mode = "eager"
    max_width: int | None = None  # the widest forward that keeps a token's bits (None: any)

    def __init__(self, model: Transformer, cache: KVCache, taps: tuple[int, ...] = ()) -> None:
        self.model, self.cache, self.taps = model, cache, taps

    @torch.inference_mode()
    def __call__(self, seq_ids: list[int], ids: Ids, positions: list[list[int]],
                 among_new: torch.Tensor | None = None) -> torch.Tensor:
        """Run T tokens per row after what the cache holds of each sequence: ids (B, T) as lists or as a tensor on
        the model's device (a draft's chain feeds its guesses without reading them back), positions (B, T) as lists,
        among_new (B, T, T) bool: which new tokens each one sees (None: causal). Returns hidden states (B, T, E),
        with the tapped layers' inputs after them: (B, T, (1 + len(taps)) E)."""
        device = self.model.device
        mask = None if among_new is None else to_device(among_new, device)
        tokens = ids if isinstance(ids, torch.Tensor) else to_device(ids, device)
        _, hidden = self.model(tokens, to_device(positions, device), self.cache, seq_ids, attn_mask=mask,
                               num_logits=0, taps=self.taps)
        return hidden  # (B, T, (1 + len(taps)) E)

    def release(self) -> None:
        """Done with the cache: what these forwards built may serve the next cache of its shape."""


class Shapes:
    """What static forwards keep from one cache to the next of the same shape (each engine makes its own cache):
    the caches' storage, which the graphs write and read, and the buckets with their inputs and graphs. Shelved on
    the model when its forwards are released, taken by the next forwards of the same key (`make_forwards`), so an
    engine's first steps replay graphs an earlier engine captured."""

    def __init__(self, cache: KVCache, graphs: bool, width: int | None, compiled: bool = False,
                 taps: tuple[int, ...] = ()) -> None:
        self.graphs, self.max_width, self.compiled, self.taps = graphs, width, compiled, taps
        self.k, self.v = cache.k, cache.v
        self.buckets: dict[tuple[int, int, int], Bucket] = {}
        self.pool = torch.cuda.graph_pool_handle() if graphs else None
        self.captures = 0  # buckets captured so far

    @staticmethod
    def key(cache: KVCache, graphs: bool, width: int | None, compiled: bool, taps: tuple[int, ...]) -> tuple:
        return (type(cache).__name__, tuple(cache.k.shape), cache.k.dtype, str(cache.k.device), graphs, width, compiled,
                taps)


class StaticForwards(Forwards):
    """Decode forwards in buckets of static shape, each captured in a CUDA graph where `graphs` (see the module).

    width: where set, every forward of at most that many tokens per row runs at exactly that width and over the
    cache's whole length of keys rounded up to MIN_KEYS (the same for either cache kind and any block size dividing
    it, as `engine.generate` sizes them), so that a token's logits have the same bits in whichever forward computes
    them (PyTorch's kernels pick their reduction order by shape; see `one_width`). `max_width` tells the
    engine's planning not to go wider. compiled: each layer's work around attention compiled (`models.compiled`).
    shapes: an earlier cache's (`Shapes`), whose storage this cache takes."""

    mode = "static"

    def __init__(self, model: Transformer, cache: KVCache, graphs: bool = False, width: int | None = None,
                 shapes: Shapes | None = None, compiled: bool = False, taps: tuple[int, ...] = ()) -> None:
        super().__init__(model, cache, taps)
        if not isinstance(cache, (PagedKVCache, ContiguousKVCache)):
            raise TypeError(f"static shapes need a paged or contiguous cache, got {type(cache).__name__}")
        if graphs and model.device.type != "cuda":
            raise ValueError(f"forwards: CUDA graphs need a CUDA device, the model is on {model.device}")
        self.shapes = shapes or Shapes(cache, graphs, width, compiled, taps)
        cache.share_storage(self.shapes.k, self.shapes.v)
        self.max_width = width
        self.mode = "compiled" if compiled else "graphs" if graphs else "static"
        # where `release` puts the shapes back and the shapes while these forwards hold them (`make_forwards`)
        self._shelf: list[Shapes] = []
        self._lease: list[Shapes] = []

    @property
    def buckets(self) -> dict[tuple[int, int, int], Bucket]:
        return self.shapes.buckets

    @torch.inference_mode()
    def __call__(self, seq_ids: list[int], ids: Ids, positions: list[list[int]],
                 among_new: torch.Tensor | None = None) -> torch.Tensor:
        rows, width = len(ids), len(ids[0])
        self.model.check_window(max(self.cache.length(s) for s in seq_ids) + width)
        starts = self.cache.reserve(tuple(seq_ids), width)  # the host's bookkeeping: blocks, copies, lengths
        paged = isinstance(self.cache, PagedKVCache)
        if self.max_width is not None and width <= self.max_width:  # one shape whatever the width and the length
            key = (bucket(rows) if paged else 1, self.max_width, -(-self.cache.capacity // MIN_KEYS) * MIN_KEYS)
        else:
            key = (bucket(rows) if paged else 1, bucket(width), bucket(max(starts) + width, MIN_KEYS))
        if key not in self.buckets:
            self.buckets[key] = Bucket(self.shapes, self.model, self.cache, *key)
        return self.buckets[key].run(self.cache, seq_ids, starts, ids, positions, among_new)

    def release(self) -> None:
        _shelve(self._shelf, self._lease)


class Bucket:
    """One static shape: (rows B, tokens per row W, keys per row L), its inputs on the device and, with graphs, its
    graph. The inputs travel in one transfer: int64 ids (B*W), positions (B*W), starts (B), widths (B: a row's
    tokens, 0 for padding rows) and block tables (B * blocks of L, paged), then one byte per (row, token, token):
    which new tokens each sees. Holds no cache: the graph reads and writes the storage of `shapes`."""

    def __init__(self, shapes: Shapes, model: Transformer, cache: KVCache, rows: int, width: int, keys: int) -> None:
        self.shapes, self.model, self.rows, self.width, self.keys = shapes, model, rows, width, keys
        blocks = blocks_for(keys, cache.block_size) if isinstance(cache, PagedKVCache) else 0
        self.sizes = [rows * width, rows * width, rows, rows, rows * blocks]  # the int64 inputs
        ints, seen = sum(self.sizes), rows * width * width
        device = model.device
        pinned = device.type == "cuda"
        # on a GPU a ring of pinned staging buffers, so that the host fills the next while a transfer from the last
        # waits in the device's queue; each with the event of its last transfer, before it is rewritten
        self.host = [torch.zeros(8 * ints + seen, dtype=torch.uint8, pin_memory=pinned)
                     for _ in range(STAGING if pinned else 1)]
        self.inputs = self.host[0] if device.type == "cpu" else torch.zeros_like(self.host[0], device=device)
        self.copied = [torch.cuda.Event() for _ in self.host] if pinned else None
        self.turn = 0  # the staging buffer the next forward fills
        # the CUDA graph and its output (B, W, (1 + taps) E), once captured
        self.captured: tuple[torch.cuda.CUDAGraph, torch.Tensor] | None = None
        self.causal: dict[tuple[int, int], torch.Tensor] = {}  # (rows, width) -> their causal `_seen`

    def run(self, cache: KVCache, seq_ids: list[int], starts: tuple[int, ...], ids: Ids,
            positions: list[list[int]], among_new: torch.Tensor | None) -> torch.Tensor:
        rows, width = len(ids), len(ids[0])
        self._fill(cache, seq_ids, starts, ids, positions, among_new)
        if not self.shapes.graphs:
            hidden = self._forward(cache)
        else:
            if self.captured is None:  # only once captured whole: a failed capture is tried again
                self.captured = capture(lambda: self._forward(cache), self.shapes.pool)
                self.shapes.captures += 1
            graph, hidden = self.captured
            graph.replay()
        return hidden[:rows, :width].clone()  # (B, T, (1 + taps) E), out of the memory the next forward may reuse

    def _fill(self, cache: KVCache, seq_ids: list[int], starts: tuple[int, ...], ids: Ids,
              positions: list[list[int]], among_new: torch.Tensor | None) -> None:
        rows, width, b, w = len(ids), len(ids[0]), self.rows, self.width
        pad, empty = [0] * (w - width), [0] * ((b - rows) * w)
        tables = cache.static_tables(tuple(seq_ids), self.keys)
        listed = [[0] * width] * rows if isinstance(ids, torch.Tensor) else ids  # a tensor's go in after the transfer
        ints = ([t for row in listed for t in row + pad] + empty + [p for row in positions for p in row + pad] + empty
                + list(starts) + [0] * (b - rows) + [width] * rows + [0] * (b - rows)
                + [block for table in tables for block in table] + [0] * (self.sizes[4] // b * (b - rows)))
        seen = self._causal(rows, width) if among_new is None else self._seen(rows, width, among_new)  # (B, W, W)
        host = self.host[self.turn]
        if self.copied is not None:
            self.copied[self.turn].synchronize()  # its last transfer, STAGING forwards ago, has left it
        split = 8 * sum(self.sizes)
        host[:split].view(torch.int64).copy_(torch.tensor(ints, dtype=torch.int64))
        host[split:].copy_(seen.view(-1).view(torch.uint8))
        if self.inputs is not host:
            assert self.copied is not None  # inputs on the device have their transfers' events
            self.inputs.copy_(host, non_blocking=True)
            self.copied[self.turn].record()
            self.turn = (self.turn + 1) % len(self.host)
        if isinstance(ids, torch.Tensor):  # (rows, width) on the device, copied there in the stream's order
            self.inputs[: 8 * b * w].view(torch.int64).view(b, w)[:rows, :width].copy_(ids)

    def _seen(self, rows: int, width: int, among_new: torch.Tensor) -> torch.Tensor:
        """(B, W, W): which new tokens each new token sees, `among_new` (rows, width, width) for the rows run;
        padding tokens see themselves only."""
        seen = torch.eye(self.width, dtype=torch.bool).repeat(self.rows, 1, 1)
        seen[:rows, :width, :width] = among_new
        return seen

    def _causal(self, rows: int, width: int) -> torch.Tensor:
        """`_seen` for causal rows, made once per (rows, width)."""
        if (rows, width) not in self.causal:
            self.causal[(rows, width)] = self._seen(rows, width, torch.ones(width, width, dtype=torch.bool).tril())
        return self.causal[(rows, width)]

    def _forward(self, cache: KVCache) -> torch.Tensor:
        """The padded forward from `inputs` alone: tensor ops whose shapes are the bucket's."""
        b, w, keys = self.rows, self.width, self.keys
        split = 8 * sum(self.sizes)
        ids, positions, starts, widths, tables = self.inputs[:split].view(torch.int64).split(self.sizes)
        seen = self.inputs[split:].view(torch.bool).view(b, w, w)  # (B, W, W)
        write, read = cache.static_slots(tables.view(b, -1), starts, widths, w, keys)  # (B*W,), (B, L)
        mask = visibility(starts, seen, keys)  # (B, 1, W, L)
        layout = AttentionLayout(tuple(range(b)), (0,) * b, w, keys, mask, write_slots=write, read_slots=read)
        _, hidden = self.model(ids.view(b, w), positions.view(b, w), cache, (), num_logits=0, layout=layout,
                               layer=compiled_layer if self.shapes.compiled else None, taps=self.shapes.taps)
        return hidden  # (B, W, (1 + taps) E)


class Captured:
    """A function of device tensors run from inputs that stay the same from call to call, one set per shape: the
    caller pads its inputs to a few shapes (powers of two), each call copies them into the leading corner of that
    shape's set and runs the function on the set or, with graphs, replays the CUDA graph captured on the first call
    of that shape. What lies past an input in its set is left from earlier calls (finite: zeros at first), so the
    function must keep it from the rows the caller reads (masked keys, padding rows). For the proposers' own small
    forwards (Medusa and EAGLE heads), whose launches a graph saves as the target's."""

    def __init__(self, fn: Callable[..., tuple[torch.Tensor, ...]], graphs: bool) -> None:
        self.fn, self.graphs = fn, graphs
        self.pool = torch.cuda.graph_pool_handle() if graphs else None
        # (shapes, static arguments) -> (inputs, graph, outputs)
        self.sets: dict[tuple, tuple[list[torch.Tensor], torch.cuda.CUDAGraph | None, tuple]] = {}

    @torch.inference_mode()
    def __call__(self, inputs: Sequence[torch.Tensor], shapes: Sequence[tuple[int, ...]],
                 *static: object) -> tuple[torch.Tensor, ...]:
        """fn(*padded inputs, *static): its outputs, each as big as its padded inputs make it (the caller slices)."""
        key = (tuple(map(tuple, shapes)), static)
        if key not in self.sets:
            self.sets[key] = ([t.new_zeros(shape) for t, shape in zip(inputs, shapes)], None, ())
        padded, graph, outputs = self.sets[key]
        for into, given in zip(padded, inputs):
            into[tuple(slice(0, n) for n in given.shape)].copy_(given)
        if not self.graphs:
            return tuple(self.fn(*padded, *static))
        if graph is None:
            graph, outputs = capture(lambda: tuple(self.fn(*padded, *static)), self.pool)
            self.sets[key] = (padded, graph, outputs)
        graph.replay()
        return tuple(out.clone() for out in outputs)  # out of the memory the next replay rewrites


def capture(run: Callable[[], T], pool: tuple | None) -> tuple[torch.cuda.CUDAGraph, T]:
    """`run` captured in a CUDA graph, with what it returns (the graph's outputs): warmed up first on a side stream
    (the allocator and the kernels' workspaces settle); the capture runs nothing, so the caller replays it."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        run()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=cast(Any, pool)):
        outputs = run()
    return graph, outputs


def make_forwards(model: Transformer, cache: KVCache, mode: str, requests: int = 1,
                  taps: tuple[int, ...] = ()) -> Forwards:
    """The decode forwards `mode` names (a model's resolved `LoadedModel.forwards`) for an engine running up to
    `requests` requests together, returning the inputs of the layers `taps` names too; static ones take the shapes
    an earlier cache of the same shape left on the model's shelf (`Transformer.static_shelf`) where there are some,
    and put them back when released (or collected). One request at a time, static shapes run at one width
    (`one_width`)."""
    if mode == "eager":
        return Forwards(model, cache, taps)
    if mode not in ("static", "graphs", "compiled"):
        raise ValueError(f"forwards must be one of eager, static, graphs, compiled, got {mode!r}")
    graphs = captures(mode, model.device)
    width, fused = ONE_WIDTH if one_width(model, requests) else None, mode == "compiled"
    shelf = model.static_shelf.setdefault(Shapes.key(cache, graphs, width, fused, taps), [])
    forwards = StaticForwards(model, cache, graphs, width, shelf.pop() if shelf else None, fused, taps)
    forwards._shelf, forwards._lease = shelf, [forwards.shapes]
    weakref.finalize(forwards, _shelve, shelf, forwards._lease)  # collected without a release
    return forwards


def captures(mode: str, device: torch.device) -> bool:
    """Whether static forwards of this mode (and the proposers' heads beside them) are captured in CUDA graphs:
    `graphs`, and `compiled` on a CUDA GPU."""
    return mode == "graphs" or (mode == "compiled" and device.type == "cuda")


def one_width(model: Transformer, requests: int) -> bool:
    """Whether static forwards run at one width (ONE_WIDTH) and over the cache's whole length: where PyTorch's
    kernels compute the products (a GPU, 16-bit dtypes, no native kernel), which pick their blocking and reduction
    order by shape, so that a token verified among 8 would otherwise get other bits than the same token decoded
    alone (in bfloat16 a greedy choice often flips), and for one request at a time: in a batch the rows and the
    prefill chunks change the shapes anyway, and the whole length would cost every row attention over the pool. The
    native CPU kernel gives a row the same bits in any forward, so there the buckets fit each forward."""
    return model.rows_per_pass is None and requests == 1


def _shelve(shelf: list[Shapes], lease: list[Shapes]) -> None:
    """The leased shapes back on the shelf, once (by `release` or when the forwards are collected)."""
    if lease:
        shelf.append(lease.pop())
