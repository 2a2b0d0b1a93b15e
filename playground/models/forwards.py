"""A model's decode forwards over one cache: the forwards of a step, each a few tokens per request after what the
cache holds, returning the final hidden states (B, T, E). Prefill chunks are not these (`Runner` runs them as they
come).

Three ways, one contract (`ModelSpec.forwards`; the loader resolves "auto"):
- eager: every forward as long as its rows and its keys, built on the host (the CPU's way: the native kernel is
  fastest on exact shapes);
- static: every forward padded to a bucket of (rows, tokens per row, keys) - powers of two - whose inputs are the
  same device tensors from call to call: token ids, positions, the rows' start slots, the tokens' visibility among
  each other and the cache's slot indices, copied in one transfer; the attention mask is built from them on the
  device. Padding tokens and rows write a scratch slot that no row reads. Runs anywhere, for tests and debugging;
- graphs: static, each bucket captured once in a CUDA graph (`torch.cuda.CUDAGraph`) on first use and replayed
  after: one launch a forward instead of some hundreds. CUDA graphs directly rather than
  `torch.compile(mode="reduce-overhead")`: the same kernels as the eager path (no compile step of minutes per
  bucket on a Space's GPU slot, no recompiles as the key bucket grows), the capture is milliseconds.
A bucket's graphs share one memory pool; the hidden states are copied out before the next forward can reuse it.
"""

from __future__ import annotations

import torch

from ..kv import AttentionLayout, ContiguousKVCache, KVCache, PagedKVCache, blocks_for
from ..kv.base import visibility
from .transformer import Transformer

MIN_KEYS = 64  # the smallest key bucket: shorter contexts share one graph
ONE_WIDTH = 16  # the one width of every decode forward where the kernels' bits depend on shapes (`make_forwards`)


def bucket(n: int, floor: int = 1) -> int:
    """The power of two >= n (and >= floor)."""
    return max(floor, 1 << (n - 1).bit_length())


class Forwards:
    """Eager decode forwards: every forward built for its own shape."""

    mode = "eager"
    max_width: int | None = None  # the widest forward that keeps a token's bits (None: any)

    def __init__(self, model: Transformer, cache: KVCache) -> None:
        self.model, self.cache = model, cache

    @torch.inference_mode()
    def __call__(self, seq_ids: list[int], ids: list[list[int]], positions: list[list[int]],
                 among_new: torch.Tensor | None = None) -> torch.Tensor:
        """Run T tokens per row after what the cache holds of each sequence: ids and positions (B, T) as lists,
        among_new (B, T, T) bool: which new tokens each one sees (None: causal). Returns hidden states (B, T, E)."""
        device = self.model.device
        mask = None if among_new is None else among_new.to(device)
        _, hidden = self.model(torch.tensor(ids, device=device), torch.tensor(positions, device=device), self.cache,
                               seq_ids, attn_mask=mask, num_logits=0)
        return hidden  # (B, T, E)


class StaticForwards(Forwards):
    """Decode forwards in buckets of static shape, each captured in a CUDA graph where `graphs` (see the module).

    width: where set, every forward of at most that many tokens per row runs at exactly that width and at the
    cache's whole length of keys, so that a token's logits have the same bits in whichever forward computes them
    (PyTorch's kernels pick their reduction order by shape; see `make_forwards`). `max_width` tells the engine's
    planning not to go wider."""

    mode = "static"

    def __init__(self, model: Transformer, cache: KVCache, graphs: bool = False, width: int | None = None) -> None:
        super().__init__(model, cache)
        if not isinstance(cache, (PagedKVCache, ContiguousKVCache)):
            raise TypeError(f"static shapes need a paged or contiguous cache, got {type(cache).__name__}")
        if graphs and model.device.type != "cuda":
            raise ValueError(f"forwards: CUDA graphs need a CUDA device, the model is on {model.device}")
        self.graphs, self.max_width = graphs, width
        self.mode = "graphs" if graphs else "static"
        self.buckets: dict[tuple[int, int, int], Bucket] = {}
        self.pool = torch.cuda.graph_pool_handle() if graphs else None
        self.captures = 0  # buckets captured so far

    @torch.inference_mode()
    def __call__(self, seq_ids: list[int], ids: list[list[int]], positions: list[list[int]],
                 among_new: torch.Tensor | None = None) -> torch.Tensor:
        rows, width = len(ids), len(ids[0])
        starts = self.cache.reserve(tuple(seq_ids), width)  # the host's bookkeeping: blocks, copies, lengths
        paged = isinstance(self.cache, PagedKVCache)
        if self.max_width is not None and width <= self.max_width:  # one shape whatever the width and the length
            capacity = self.cache.allocator.num_blocks * self.cache.block_size if paged else self.cache.max_len
            key = (bucket(rows) if paged else 1, self.max_width, capacity)
        else:
            key = (bucket(rows) if paged else 1, bucket(width), self._keys(max(starts) + width))
        if key not in self.buckets:
            self.buckets[key] = Bucket(self, *key)
        return self.buckets[key].run(seq_ids, starts, ids, positions, among_new)

    def _keys(self, key_len: int) -> int:
        keys = bucket(key_len, MIN_KEYS)
        return min(keys, self.cache.max_len) if isinstance(self.cache, ContiguousKVCache) else keys


class Bucket:
    """One static shape: (rows B, tokens per row W, keys per row L), its inputs on the device and, with graphs, its
    graph. The inputs travel in one transfer: int64 ids (B*W), positions (B*W), starts (B), widths (B: a row's
    tokens, 0 for padding rows) and block tables (B * blocks of L, paged), then one byte per (row, token, token):
    which new tokens each sees."""

    def __init__(self, owner: StaticForwards, rows: int, width: int, keys: int) -> None:
        self.owner, self.rows, self.width, self.keys = owner, rows, width, keys
        cache = owner.cache
        blocks = blocks_for(keys, cache.block_size) if isinstance(cache, PagedKVCache) else 0
        self.sizes = [rows * width, rows * width, rows, rows, rows * blocks]  # the int64 inputs
        ints, seen = sum(self.sizes), rows * width * width
        device = owner.model.device
        pinned = device.type == "cuda"
        self.host = torch.zeros(8 * ints + seen, dtype=torch.uint8, pin_memory=pinned)
        self.inputs = self.host if device.type == "cpu" else torch.zeros_like(self.host, device=device)
        self.copied = torch.cuda.Event() if pinned else None  # the last transfer from `host`, before it is rewritten
        self.graph: torch.cuda.CUDAGraph | None = None
        self.hidden: torch.Tensor | None = None  # (B, W, E), the graph's output

    def run(self, seq_ids: list[int], starts: tuple[int, ...], ids: list[list[int]], positions: list[list[int]],
            among_new: torch.Tensor | None) -> torch.Tensor:
        rows, width = len(ids), len(ids[0])
        self._fill(seq_ids, starts, ids, positions, among_new)
        if not self.owner.graphs:
            hidden = self._forward()
        else:
            if self.graph is None:
                self._capture()
            self.graph.replay()
            hidden = self.hidden
        return hidden[:rows, :width].clone()  # (B, T, E), out of the memory the next forward may reuse

    def _fill(self, seq_ids: list[int], starts: tuple[int, ...], ids: list[list[int]], positions: list[list[int]],
              among_new: torch.Tensor | None) -> None:
        rows, width, b, w = len(ids), len(ids[0]), self.rows, self.width
        pad, empty = [0] * (w - width), [0] * ((b - rows) * w)
        tables = self.owner.cache.static_tables(tuple(seq_ids), self.keys)
        ints = ([t for row in ids for t in row + pad] + empty + [p for row in positions for p in row + pad] + empty
                + list(starts) + [0] * (b - rows) + [width] * rows + [0] * (b - rows)
                + [block for table in tables for block in table] + [0] * (self.sizes[4] // b * (b - rows)))
        seen = torch.eye(w, dtype=torch.bool).repeat(b, 1, 1)  # (B, W, W): padding tokens see themselves only
        seen[:rows, :width, :width] = (torch.ones(width, width, dtype=torch.bool).tril() if among_new is None
                                       else among_new)
        if self.copied is not None:
            self.copied.synchronize()  # the previous transfer has left `host`
        split = 8 * sum(self.sizes)
        self.host[:split].view(torch.int64).copy_(torch.tensor(ints, dtype=torch.int64))
        self.host[split:].copy_(seen.view(-1).view(torch.uint8))
        if self.inputs is not self.host:
            self.inputs.copy_(self.host, non_blocking=True)
            self.copied.record()

    def _forward(self) -> torch.Tensor:
        """The padded forward from `inputs` alone: tensor ops whose shapes are the bucket's."""
        b, w, keys = self.rows, self.width, self.keys
        split = 8 * sum(self.sizes)
        ids, positions, starts, widths, tables = self.inputs[:split].view(torch.int64).split(self.sizes)
        seen = self.inputs[split:].view(torch.bool).view(b, w, w)  # (B, W, W)
        cache = self.owner.cache
        write, read = cache.static_slots(tables.view(b, -1), starts, widths, w, keys)  # (B*W,), (B, L)
        mask = visibility(starts, seen, keys)  # (B, 1, W, L)
        layout = AttentionLayout(tuple(range(b)), (0,) * b, w, keys, mask, write_slots=write, read_slots=read)
        _, hidden = self.owner.model(ids.view(b, w), positions.view(b, w), cache, (), num_logits=0, layout=layout)
        return hidden  # (B, W, E)

    def _capture(self) -> None:
        """Warm up on a side stream (the allocator and the kernels' workspaces settle), then capture the forward;
        the capture runs nothing, so the caller replays it."""
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            self._forward()
        torch.cuda.current_stream().wait_stream(stream)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph, pool=self.owner.pool):
            self.hidden = self._forward()
        self.owner.captures += 1


def make_forwards(model: Transformer, cache: KVCache, mode: str) -> Forwards:
    """The decode forwards `mode` names (a model's resolved `LoadedModel.forwards`). Static shapes run at one width
    (ONE_WIDTH) where PyTorch's kernels compute the products (a GPU, 16-bit dtypes, no native kernel): those pick
    their blocking and reduction order by the number of rows, so a token verified among 8 would otherwise get other
    bits than the same token decoded alone, and in bfloat16 a greedy choice often flips. The native CPU kernel gives
    a row the same bits in any forward, so there the buckets fit each forward."""
    if mode == "eager":
        return Forwards(model, cache)
    if mode in ("static", "graphs"):
        return StaticForwards(model, cache, graphs=mode == "graphs",
                              width=ONE_WIDTH if model.rows_per_pass is None else None)
    raise ValueError(f"forwards must be one of eager, static, graphs, got {mode!r}")
