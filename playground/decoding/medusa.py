"""Medusa (Cai et al. 2024) in the engine: heads on the target's last hidden state propose a tree of continuations,
which the step's one forward verifies with a tree attention mask.

For each decoding request the heads read the final hidden state of the row that predicted its last token and the
embedding of that token, and give each depth's top-k; the tree takes the nodes likeliest by the heads' calibrated
probabilities (dynamic) or a named tree's paths. Acceptance walks down from the last token (draws along the tree,
or typical acceptance when asked: lossy), then emits the correction or bonus token; the accepted nodes stay in the
cache. Copies of earlier text join the tree through `Grafted` (heads predict poorly what a text repeats).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

import torch

from ..config import MAX_DYNAMIC_NODES, MAX_GAMMA, ConfigError, check_choice, check_finite, check_int
from ..kv import KVCache
from ..models import LoadedModel
from ..models.forwards import Captured, bucket
from ..models.linear import weights_read
from ..models.medusa import LoadedHeads, default_heads, load_heads
from ..sampling import Typical
from ..waits import to_device
from .guesses import Guesser, Guesses
from .planning import OwnCost, guess_depth, weights_estimate
from .proposer import Cost, Outcome, Proposal, RequestView
from .spec import Algorithm, Setting, Variant
from .tree import DYNAMIC_TREE, TREES, load_tree

MEDUSA_ACCEPTANCE = ("lossless", "typical")
CPU_DYNAMIC_NODES = 5  # the dynamic tree's nodes on a CPU (see `dynamic_nodes`)
GPU_DYNAMIC_NODES = 23  # on a GPU


def dynamic_nodes(gpu: bool) -> int:
    """The dynamic tree's most nodes when `MedusaParams.nodes` is None: the engine verifies as many of them as pay
    at this machine's measured forward costs, but choosing among more costs host time on a CPU (docs/defaults.md
    says why)."""
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
            if not 0 < check_finite(name, value) <= 1:
                raise ConfigError(f"{name} must be in (0, 1], got {value}")


class MedusaGuesser(Guesser):
    """Medusa heads in the engine: for each decoding request, the heads' top guesses for each of the next tokens,
    from the final hidden state of the row that predicted its last token (one it has run since it was last
    admitted), batched over the requests; the dynamic tree is built from them (`Guesser.tree`)."""

    label = "medusa"
    own: OwnCost  # its drafting forwards' price, measured as it runs

    def __init__(self, target: LoadedModel, params: MedusaParams | None = None,
                 heads: LoadedHeads | None = None) -> None:
        params = params or MedusaParams()
        self.target, self.params = target, params
        self.heads = heads or load_heads(params.heads, target)
        num_heads = self.heads.heads.num_heads
        depth = params.depth or num_heads
        if depth > num_heads:
            raise ConfigError(f"medusa.depth must be in [1, {num_heads}] (the heads' number), got {depth}")
        shape, self.top_k = None, 0  # a fixed tree's paths, and the most ranks it takes at a depth
        if params.tree == DYNAMIC_TREE:
            nodes = params.nodes or dynamic_nodes(target.model.device.type == "cuda")
        else:
            tree = load_tree(params.tree)
            if tree.depth > depth:
                raise ConfigError(f"tree: depth {tree.depth} needs that many heads; {depth} are used")
            if max(tree.top_k()) > self.heads.vocab_size:
                raise ConfigError(f"tree: a depth takes the top {max(tree.top_k())} tokens; the heads score only "
                                  f"{self.heads.vocab_size}")
            shape, nodes, depth = tree.paths, tree.num_nodes, tree.depth
            self.top_k = max(tree.top_k())
        super().__init__(frozenset(target.eos_token_ids), depth, nodes, shape)
        self.hidden: dict[int, torch.Tensor] = {}  # request id -> (E,) the state that predicted its last token
        # the heads' one forward a step, whatever the depth, measured as it runs
        self.own = OwnCost(None, self.estimate_cost(), per_depth=False)
        # with the target's static forwards, the heads run in static shapes too (captured with its graphs)
        self.captured = None if target.forwards == "eager" else Captured(self._top, target.graphs)


    def estimate_cost(self) -> float:
        """The heads' forward over the target's before any is measured: their layers and the output rows they
        score."""
        return weights_estimate(self.target.model, weights_read(self.heads.heads) + self.heads.output.nbytes, 1)

    def bind(self, settings: Any, cache: KVCache) -> None:
        self.hidden = {}

    def pause(self, request: RequestView) -> None:
        self.hidden.pop(request.id, None)

    def ready(self, request: RequestView) -> bool:
        return request.id in self.hidden

    @torch.inference_mode()
    def guesses(self, requests: Sequence[RequestView], rooms: list[int], longest: int,
                cost: Cost) -> dict[int, Guesses]:
        ready = [r for r in requests if r.id in self.hidden]
        if not ready:
            return {}
        model, depth = self.target.model, min(longest, self.depth)
        # the heads run once a step whatever the tree: only where the tokens their guesses are expected to add so
        # far pay for them besides the wider verification
        price = cost.price(self.own)
        if not guess_depth(self.calibration.expected_tokens(depth), rooms, cost, price):
            return {}
        start = time.perf_counter()
        k = self.top_k if self.shape is not None else min(longest, self.heads.vocab_size)
        hidden = torch.stack([self.hidden[r.id] for r in ready])  # (B, E)
        last = to_device([r.tokens[r.num_computed] for r in ready], model.device)  # (B,)
        if self.captured is None:
            values, ids = self._top(hidden, last, depth, k)
        else:  # rows padded to a power of two
            rows = bucket(len(ready))
            values, ids = self.captured((hidden, last), ((rows, hidden.shape[1]), (rows,)), depth, k)
        # log-probabilities and ids back in one transfer (float64 holds both exactly)
        logp, read = torch.stack((values[: len(ready)].double(), ids[: len(ready)].double())).tolist()  # (B, D, k) each
        tokens = [[[int(t) for t in place] for place in request] for request in read]
        self.own.record(time.perf_counter() - start, 1, cost.one_s)
        return {r.id: Guesses(lp, t) for r, lp, t in zip(ready, logp, tokens)}

    def _top(self, hidden: torch.Tensor, last: torch.Tensor, depth: int, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The first `depth` heads' k likeliest tokens for each request: log-probabilities and token ids (B, D, k),
        from the states (B, E) that predicted the requests' last tokens (B,)."""
        logits = self.heads.logits(hidden, self.target.model.embed_tokens.weight[last], depth)  # (D, B, V')
        top = logits.log_softmax(-1).topk(k, dim=-1)  # values, indices: (D, B, k)
        return top.values.transpose(0, 1), self.heads.vocab_ids[top.indices].transpose(0, 1)

    def tree(self, guesses: Guesses, room: int, nodes: int, *copy: Any) -> Proposal:
        tree = super().tree(guesses, room, nodes, *copy)
        typical = self.params.acceptance == "typical"
        return replace(tree, rule=Typical(self.params.epsilon, self.params.alpha)) if typical else tree

    def observe(self, request: RequestView, proposal: Proposal | None, outcome: Outcome) -> None:
        super().observe(request, proposal, outcome)
        if not outcome.done:  # the row that predicted the last new token: the heads read it next
            self.hidden[request.id] = outcome.hidden[outcome.walk[-1]].clone()

    def loaded(self) -> dict[str, Any]:
        return {"heads": self.heads}

    def describe(self) -> dict[str, Any]:
        return {"proposer": self.label, "heads": self.heads.folder.name, "depth": self.depth, "nodes": self.nodes,
                "tree": self.params.tree, "acceptance": self.params.acceptance}


ALGORITHM = Algorithm(
    "medusa", "Medusa (tree)", "Medusa decoding (--algo medusa)", MedusaParams, MedusaGuesser,
    (Setting("heads", "folder of heads trained by `python -m playground.train medusa` (default: the heads shipped "
                      "for the embedded model)", flag="--medusa-heads", kind=str),
     Setting("depth", "heads used, so the deepest guess, 1..the heads' number (default: every head)",
             flag="--medusa-depth"),
     Setting("tree", f"candidate tree: {DYNAMIC_TREE} (default: the nodes the heads rate likeliest, chosen at every "
                     f"step), {', '.join(TREES)}, or a JSON file of top-k paths", label="Medusa tree", kind=str,
             note="dynamic: the nodes the heads rate likeliest, chosen at every step",
             choices=(DYNAMIC_TREE, *TREES)),
     Setting("nodes", f"most nodes of the dynamic tree, 1..{MAX_DYNAMIC_NODES} (default {CPU_DYNAMIC_NODES}, "
                      f"{GPU_DYNAMIC_NODES} on a GPU); each step verifies as many as pay for the wider forward",
             flag="--tree-nodes", label=f"dynamic tree nodes (0 = auto, 1..{MAX_DYNAMIC_NODES})", auto=True),
     Setting("acceptance", "when sampling: lossless (exact, default) or typical (LOSSY, accepts more); at "
                           "temperature 0 both are greedy and exact", label="Medusa acceptance when sampling",
             kind=str, choices=(("lossless (exact)", "lossless"), ("typical (LOSSY)", "typical"))),
     Setting("epsilon", "typical acceptance epsilon, (0, 1]", flag="--typical-epsilon", kind=float),
     Setting("alpha", "typical acceptance alpha, (0, 1]", flag="--typical-alpha", kind=float)),
    sources={"medusa": ("Medusa heads", "guessed")}, colour="#cc79a7",
    example="Give three tips for staying focused while studying.", ships=default_heads, grafts=True,
    variants=(Variant("lossless", {"acceptance": "lossless"}, sampled=True, note="(exact)"),
              Variant("typical", {"acceptance": "typical"}, sampled=True, note="(LOSSY)")), short="Medusa")
