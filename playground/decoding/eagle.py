"""EAGLE (Li et al. 2024) with EAGLE-2's dynamic tree in the engine: a one-layer head drafts on the target's own
features.

Per decoding request the head keeps its keys and values over the positions whose target features it has read, and
the features it has not read yet (the prompt's from the prefill, then each step's kept rows). A step first catches
the heads up on those (one padded forward for the requests a step behind, one each for a prompt's), which predicts
the feature at each last token and so the first drafted tokens; then it grows every request's tree together: at
each depth the `top_k` likeliest nodes of that depth in each tree (by the head's cumulative probability, calibrated
by how often its guesses at that depth were kept) are expanded in one head forward over the batch, each reading its
ancestors' keys beside its request's committed ones and giving `top_k` children. The likeliest nodes of all depths
form a request's proposal (a parent is always likelier than its child, so they form a tree). On a GPU the trees
grow on the device and come back to the host once, chosen; on a CPU (eager forwards) in Python lists. Nothing
drafted enters the head's own keys: what the target keeps comes back as real features the next step reads.
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from ..config import MAX_DYNAMIC_NODES, MAX_GAMMA, ConfigError, check_finite, check_int
from ..kv import KVCache
from ..models import LoadedModel
from ..models.eagle import LoadedEagle, default_head, load_head
from ..models.forwards import MIN_KEYS, Captured, bucket
from ..models.linear import weights_read
from ..waits import to_device
from .guesses import GuessCalibration
from .planning import OwnCost, guess_depth, weights_estimate
from .proposer import Cost, Drafted, Outcome, Proposal, Proposer, RequestView
from .spec import Algorithm, Setting, Variant

KEYS_ROOM = 256  # places a request's head keys start with, doubled as it needs more
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
        if self.draft_cost is not None and not 0.0 <= check_finite("draft_cost", self.draft_cost) <= 1.0:
            raise ConfigError(f"draft_cost must be in [0, 1] or None, got {self.draft_cost:g}")

# The head reads up to this many unread features per request in one padded batched forward (the kept rows of the
# steps since it last drafted); more (a prompt's) alone.
CATCH_UP = 32


@dataclass
class _HeadState:
    """A request's head: storage for keys and values (Hkv, L', D) whose first L places hold those over the positions
    before `start` (the places after are scratch: a step's tree writes its keys there), and the target's features
    at positions start .. start + count - 1 that it has not read yet, in the chunks (n, E) they came in (joined
    once, when the head reads them, not on every step)."""

    k: torch.Tensor
    v: torch.Tensor
    length: int  # L
    start: int
    chunks: list[torch.Tensor]
    count: int

    @property
    def end(self) -> int:
        """The position after the last feature it has."""
        return self.start + self.count

    def reserve(self, room: int) -> None:
        """At least `room` places after the first L, the storage doubled as often as that takes."""
        size = self.k.shape[1]
        if size < self.length + room:
            while size < self.length + room:
                size *= 2
            grown = [t.new_zeros(t.shape[0], size, t.shape[2]) for t in (self.k, self.v)]
            for old, new in zip((self.k, self.v), grown):
                new[:, : self.length] = old[:, : self.length]
            self.k, self.v = grown

    def keep(self, k: torch.Tensor, v: torch.Tensor) -> None:
        """Keys and values (Hkv, n, D) over the n positions after the first L, stored there."""
        n = k.shape[1]
        self.reserve(n)
        self.k[:, self.length : self.length + n], self.v[:, self.length : self.length + n] = k, v
        self.length += n

    def add(self, features: torch.Tensor) -> None:
        self.chunks, self.count = [*self.chunks, features], self.count + len(features)

    def unread(self) -> torch.Tensor:
        """The features not read yet (count, E)."""
        return self.chunks[0] if len(self.chunks) == 1 else torch.cat(self.chunks)


class EagleProposer(Proposer):
    """An EAGLE head's dynamic tree for every decoding request whose features it has."""

    label = "eagle"
    own: OwnCost  # its drafting forwards' price, measured as it runs

    def __init__(self, target: LoadedModel, params: EagleParams | None = None, head: LoadedEagle | None = None) -> None:
        params = params or EagleParams()
        self.target, self.params = target, params
        self.eagle = head or load_head(params.head, target)
        self.taps = self.eagle.head.taps  # the target layers the head reads, if any (beside the final states)
        gpu = target.model.device.type == "cuda"
        self.depth, self.top_k = params.depth, params.top_k
        self.nodes = params.nodes or (EAGLE_GPU_NODES if gpu else EAGLE_CPU_NODES)
        # a head forward's cost, measured as it runs; each further depth's forward runs top_k rows a request
        self.own = OwnCost(params.draft_cost, self.estimate_cost(), rows=self.top_k)
        self.eos = torch.tensor(sorted(set(target.eos_token_ids)), device=target.model.device)  # (n,): never expanded
        self.eos_ids = frozenset(target.eos_token_ids)
        self.calibration = GuessCalibration(self.depth)
        self.states: dict[int, _HeadState] = {}
        self.long_read_s = 0.0  # seconds the last catch-up spent on requests with more than CATCH_UP features
        # with the target's static forwards, the head runs in static shapes too (captured with its graphs)
        self.captured = None if target.forwards == "eager" else Captured(self._head, target.graphs)
        # with eager forwards on a CPU, where a tensor op costs more than the few numbers a tree's bookkeeping moves,
        # the trees grow in Python lists; static forwards (a GPU's, or a CPU standing in for one) keep them on the
        # device, reading them back once a step
        self.on_host = target.model.device.type == "cpu" and self.captured is None
        # on a CPU each forward has run when its call returns, so a step's further depths are timed apart from the
        # rest: from when the last `grow` had caught up (its first depth drafted) to when its last depth was grown
        self.timed_apart = target.model.device.type == "cpu"
        self.caught_up = self.grown = 0.0  # `time.perf_counter`


    def estimate_cost(self) -> float:
        """A head forward's cost over the target's before any is measured: its layer and the output rows it
        scores (the mix of tapped layers runs once a step, on the kept rows, not once a depth)."""
        head = self.eagle.head
        mix = weights_read(head.mix) if head.mix is not None else 0
        return weights_estimate(self.target.model, weights_read(head) - mix + self.eagle.output.nbytes, 1)

    def bind(self, settings: Any, cache: KVCache) -> None:
        self.states = {}

    def forget(self) -> None:
        self.calibration = GuessCalibration(self.depth)

    def pause(self, request: RequestView) -> None:
        self.states.pop(request.id, None)

    def prefilled(self, request: RequestView, hidden: torch.Tensor) -> None:
        """A prefill chunk's hidden states (n, (1 + taps) E), which end at `request.num_computed`."""
        start = request.num_computed - len(hidden)
        features = self.eagle.head.read(hidden)  # (n, E)
        state = self.states.get(request.id)
        if state is None or state.end != start:
            k, v = self.eagle.empty_keys(KEYS_ROOM)
            self.states[request.id] = _HeadState(k, v, 0, start, [features.clone()], len(features))
        else:
            state.add(features.clone())

    def observe(self, request: RequestView, proposal: Proposal | None, outcome: Outcome) -> None:
        if proposal is not None:
            self.calibration.record(proposal, outcome.path, self.label)
        state = self.states.get(request.id)
        last = request.num_computed - 1  # the position of the step's row 0 (the engine counted it already)
        if outcome.done or state is None or state.end != last:
            return  # finished, or a prefill whose features `prefilled` had
        state.add(self.eagle.head.read(outcome.hidden[outcome.walk]))  # (R, E) the kept rows' features

    def propose(self, requests: Sequence[RequestView], rooms: list[int], cost: Cost) -> dict[int, Proposal]:
        ready = [(r, room) for r, room in zip(requests, rooms) if room > 0 and self._ready(r)]
        if not ready:
            return {}
        # Each drafted depth costs a head forward besides the wider verification: as deep as the guesses' kept
        # share so far says pays for both.
        price = cost.price(self.own)
        depth = guess_depth(self.calibration.expected_tokens(self.depth), [room for _, room in ready], cost, price)
        if not depth:
            return {}
        start = time.perf_counter()
        depths = [min(room, depth) for _, room in ready]
        trees = dict(zip([r.id for r, _ in ready], self.grow([r for r, _ in ready], depths)))
        # a long catch-up is a prompt's or a rest's, paid once: not a drafting step's price
        further = self.grown - self.caught_up if self.timed_apart else None
        self.own.record(time.perf_counter() - start - self.long_read_s, depth, cost.one_s, further)
        return trees

    def _ready(self, request: RequestView) -> bool:
        state = self.states.get(request.id)
        return state is not None and state.count > 0 and state.end == request.num_computed

    @torch.inference_mode()
    def grow(self, requests: Sequence[RequestView], depths: list[int]) -> list[Proposal]:
        """Catch the head up on each request's unread features, then grow every request's tree, `depths[i]` deep,
        each depth's `top_k` likeliest nodes of every tree expanded in one head forward: each tree's likeliest
        nodes, parents first. The bookkeeping between the forwards runs in Python lists (`_grow_on_host`) or as
        tensors left on the device (`_grow_on_device`), as `on_host` says; both choose the same nodes."""
        root, logps, tokens = self._catch_up(requests)  # (B, E), (B, k), (B, k)
        self.caught_up = time.perf_counter()  # the first depth drafted
        if self.on_host:
            return self._grow_on_host(requests, depths, root, logps, tokens)
        return self._proposals(self._grow_on_device(requests, depths, root, logps, tokens), depths)

    def _grow_on_host(self, requests: Sequence[RequestView], depths: list[int], root: torch.Tensor,
                      logps: torch.Tensor, tokens: torch.Tensor) -> list[Proposal]:
        """`_grow_on_device`'s trees with their nodes in Python lists: per depth, one head forward and two reads
        of its top_k guesses; the nodes' worths are the same float64 sums, ranked by the same stable sort."""
        k, b, depth = self.top_k, len(requests), max(depths)
        # (B, Hkv, C + room, D), (B, C): the committed keys, then room for the tree's, which each depth's forward
        # writes in place
        past_k, past_v, known = _padded_keys([self.states[r.id] for r in requests], (depth - 1) * k)
        committed = known.shape[1]
        scale = [math.log(self.calibration.scale(d)) for d in range(depth)]
        # per tree, every node in order of depth: token, parent index (-1: the root), head log-probability, worth
        # (its calibrated log-chance of being reached), depth
        trees = [[(token, -1, logp, min(logp + scale[0], 0.0), 1) for token, logp in zip(row_tokens, row_logps)]
                 for row_tokens, row_logps in zip(tokens.tolist(), logps.tolist())]
        lines: list[list[list[int]]] = [[] for _ in range(b)]  # per tree, each expanded node's expanded ancestry
        features = root.unsqueeze(1).expand(b, k, -1)  # (B, k, E): the feature each newest node was guessed from
        first = 0  # the newest depth's first node
        rows = torch.arange(b).unsqueeze(1)  # (B, 1)
        for d in range(1, depth):
            chosen, best, visible = [], [], []
            for nodes, line in zip(trees, lines):
                # the newest depth's likeliest nodes that are not an end of sequence; where fewer are, one that is
                # expands too, its children worth nothing
                score = [-math.inf if token in self.eos_ids else worth for token, _, _, worth, _ in nodes[first:]]
                ranked = sorted(range(len(score)), key=lambda i: -score[i])[:k]
                expanded = len(line)
                for slot, i in enumerate(ranked):  # a chosen node's parent is the (i // k)-th expanded last
                    line.append((line[expanded - k + i // k] if d > 1 else []) + [expanded + slot])
                chosen.append(ranked)
                best.append([score[i] for i in ranked])
                visible.append([[x in ancestry for x in range(expanded + k)] for ancestry in line[expanded:]])
            # each chosen node sees its request's committed keys, its expanded ancestors and itself
            seen = torch.cat((known.unsqueeze(1).expand(b, k, committed), torch.tensor(visible)), 2)
            at = [[r.num_computed + d - 1] * k for r in requests]
            guessed_from = features if d == 1 else features[rows, torch.tensor(chosen) // k]  # (B, k, E)
            out, _, _, logp, guesses = self._forward(
                torch.tensor([[nodes[first + i][0] for i in ranked] for nodes, ranked in zip(trees, chosen)]),
                guessed_from, at, past_k, past_v, seen, [list(range(k))] * b)
            added = len(trees[0])
            for nodes, ranked, worths, row_logps, row_guesses in zip(trees, chosen, best, logp.tolist(),
                                                                      guesses.tolist()):
                for i, worth, child_logps, child_tokens in zip(ranked, worths, row_logps, row_guesses):
                    nodes.extend((token, first + i, lp, worth + min(lp + scale[d], 0.0), d + 1)
                                 for token, lp in zip(child_tokens, child_logps))
            first, features = added, out
        self.grown = time.perf_counter()
        proposals = []
        for nodes, tree_depth in zip(trees, depths):
            worth = [w if at_depth <= tree_depth else -math.inf for _, _, _, w, at_depth in nodes]
            ranked = sorted(range(len(nodes)), key=lambda i: -worth[i])[: self.nodes]
            proposals.append(self._proposal([(i, nodes[i][0], nodes[i][1], worth[i], nodes[i][2]) for i in ranked],
                                            tree_depth))
        return proposals

    def _grow_on_device(self, requests: Sequence[RequestView], depths: list[int], root: torch.Tensor,
                        logps: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        """Every request's tree grown at once on the device: each tree's likeliest nodes, best first, as rows of
        node index, token, parent index, worth and head log-probability (B, 5, n) float64, left on the device (a
        node's worth is -inf below an end of sequence or past its tree's depth)."""
        k, device = self.top_k, self.target.model.device
        b, depth = len(requests), max(depths)
        # (B, Hkv, C + room, D), (B, C), as `_grow_on_host`'s
        past_k, past_v, known = _padded_keys([self.states[r.id] for r in requests], (depth - 1) * k)
        committed, known = known.shape[1], to_device(known, device)
        scale = [math.log(self.calibration.scale(d)) for d in range(depth)]
        # Every node of a tree in order of depth (N,): depth 1's top_k guesses after the last token's predicted
        # feature, then top_k children of each node expanded. A node's worth is its calibrated log-chance of being
        # reached.
        parents = torch.full((b, k), -1, device=device)  # (B, N) each, N = k at depth 1
        worths = (logps.double() + scale[0]).clamp(max=0.0)  # float64, as Python's floats sum
        features = root.unsqueeze(1).expand(b, k, -1)  # (B, k, E): the feature each newest node was guessed from
        first = 0  # the newest depth's first node
        ancestry = torch.zeros(b, 0, 0, dtype=torch.bool, device=device)  # (B, X, X): each expanded node's line
        rows = torch.arange(b, device=device).unsqueeze(1)  # (B, 1)
        for d in range(1, depth):
            # Each tree's newest depth's likeliest nodes that are not an end of sequence; where fewer are, one that
            # is expands too, its children worth nothing.
            score = worths[:, first:].masked_fill(torch.isin(tokens[:, first:], self.eos), -math.inf)
            best, chosen = (ranked[:, :k] for ranked in score.sort(dim=1, descending=True, stable=True))  # (B, k)
            expanded = ancestry.shape[1]
            line = torch.zeros(b, k, expanded + k, dtype=torch.bool, device=device)  # (B, k, X + k)
            if d > 1:  # a chosen node's parent is the (chosen // k)-th of the k nodes expanded last
                line[:, :, :expanded] = ancestry[rows, expanded - k + torch.div(chosen, k, rounding_mode="floor")]
            line[:, :, expanded:] = torch.eye(k, dtype=torch.bool, device=device)
            ancestry = torch.cat((F.pad(ancestry, (0, k)), line), 1)  # (B, X + k, X + k)
            # each chosen node sees its request's committed keys, its expanded ancestors and itself
            visible = torch.cat((known.unsqueeze(1).expand(b, k, committed), line), 2)  # (B, k, C + X + k)
            at = [[r.num_computed + d - 1] * k for r in requests]
            out, _, _, logp, guesses = self._forward(
                tokens[:, first:].gather(1, chosen), features[rows, chosen], at, past_k, past_v, visible,
                [list(range(k))] * b)
            parents = torch.cat((parents, (first + chosen).repeat_interleave(k, dim=1)), 1)
            first = tokens.shape[1]
            tokens, logps = torch.cat((tokens, guesses.flatten(1)), 1), torch.cat((logps, logp.flatten(1)), 1)
            worths = torch.cat((worths, (best.unsqueeze(2) + (logp.double() + scale[d]).clamp(max=0.0)).flatten(1)), 1)
            features = out.repeat_interleave(k, dim=1)  # (B, k * k, E)
        self.grown = time.perf_counter()
        # a node deeper than its request's tree goes is worth nothing (depth 1 holds k nodes, each later one k * k)
        node_depth = torch.tensor([1] * k + [d for d in range(2, depth + 1) for _ in range(k * k)])  # (N,)
        deep = to_device(node_depth.unsqueeze(0) > torch.tensor(depths).unsqueeze(1), device)  # (B, N)
        worths = worths.masked_fill(deep, -math.inf)
        # each tree's likeliest nodes (B, n), best first: a child is never likelier than its parent, the nodes are
        # in order of depth and the sort is stable, so parents come first
        order = worths.sort(dim=1, descending=True, stable=True).indices[:, : self.nodes]  # (B, n)
        return torch.stack((order.double(), tokens.gather(1, order).double(), parents.gather(1, order).double(),
                            worths.gather(1, order), logps.gather(1, order).double()), 1)  # (B, 5, n)

    def _catch_up(self, requests: Sequence[RequestView]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The head reads each request's unread features (and stores their keys): one padded forward for the
        requests with at most CATCH_UP of them, one forward each for the others (a prompt's). The feature it
        predicts after each request's last token (B, E), and its top_k guesses there as log-probabilities and token
        ids (B, k), on the device."""
        states = [self.states[r.id] for r in requests]
        short = [i for i, s in enumerate(states) if s.count <= CATCH_UP]
        groups = ([short] if short else []) + [[i] for i, s in enumerate(states) if s.count > CATCH_UP]
        root: list[torch.Tensor] = [torch.empty(0)] * len(states)
        logps, guessed = list(root), list(root)
        self.long_read_s = 0.0
        for group in groups:
            read = time.perf_counter()
            counts = [states[i].count for i in group]
            width = max(counts)
            # x_{t+1} for each feature f_t, padded with the request's last token
            ids = [requests[i].tokens[states[i].start + 1 : states[i].start + n + 1] for i, n in zip(group, counts)]
            ids = [row + row[-1:] * (width - len(row)) for row in ids]  # (G, T)
            at = [[states[i].start + j for j in range(width)] for i in group]  # (G, T)
            features = torch.stack([F.pad(states[i].unread(), (0, 0, 0, width - n)) for i, n in zip(group, counts)])
            past_k, past_v, known = _padded_keys([states[i] for i in group], width)  # (G, Hkv, C + T, D), (G, C)
            # each row sees its request's committed keys and the rows up to itself (padding rows: theirs too)
            visible = torch.cat((known.unsqueeze(1).expand(-1, width, -1),
                                 torch.ones(width, width, dtype=torch.bool).tril().expand(len(group), -1, -1)), 2)
            out, new_k, new_v, logp, guesses = self._forward(
                to_device(ids, features.device), features, at, past_k, past_v,
                to_device(visible, features.device), [[n - 1] for n in counts])  # visible: (G, T, C + T)
            for g, (i, n) in enumerate(zip(group, counts)):
                state = states[i]
                if len(group) > 1:
                    state.keep(new_k[g, :, :n], new_v[g, :, :n])
                else:  # one request's forward wrote them into its own storage (`_padded_keys`)
                    state.length += n
                state.start, state.chunks, state.count = state.start + n, [], 0
                root[i], logps[i], guessed[i] = out[g, n - 1], logp[g, 0], guesses[g, 0]
            if width > CATCH_UP:
                self.long_read_s += time.perf_counter() - read
        return torch.stack(root), torch.stack(logps), torch.stack(guessed)

    def _proposals(self, grown: torch.Tensor, depths: list[int]) -> list[Proposal]:
        """The trees `_grow_on_device` left on the device (B, 5, n), read back in one transfer, as proposals."""
        return [self._proposal([(int(node), int(token), int(parent), worth, logp)
                                for node, token, parent, worth, logp in zip(*tree)], depth)
                for tree, depth in zip(grown.tolist(), depths)]

    def _proposal(self, ranked: list[tuple[int, int, int, float, float]], depth: int) -> Proposal:
        """A tree's likeliest nodes, best first, each (node index, token, parent index or -1, worth, head
        log-probability), as a proposal: those worth something (not below an end of sequence nor past the tree's
        depth), each parent's row before its children's."""
        row: dict[int, int] = {}
        kept: list[tuple[int, int, float, float]] = []  # token, parent row, chance of reaching, head probability
        for node, token, parent, worth, logp in ranked:
            if worth > -math.inf:
                row[node] = len(kept) + 1
                kept.append((token, 0 if parent < 0 else row[parent], math.exp(worth), math.exp(logp)))
        return Proposal([t for t, _, _, _ in kept], [r for _, r, _, _ in kept], [self.label] * len(kept),
                        [c for _, _, c, _ in kept], [p for _, _, _, p in kept], note=Drafted(depth))

    def _forward(self, tokens: torch.Tensor, features: torch.Tensor, positions: list[list[int]],
                 past_k: torch.Tensor, past_v: torch.Tensor, visible: torch.Tensor,
                 scored: list[list[int]]) -> tuple[torch.Tensor, ...]:
        """The head over T new positions of B requests, tokens (B, T), features (B, T, E), storage past_k, past_v
        (B, Hkv, L', D) whose first L places hold the keys and values before, and visible (B, T, L + T), on the
        device (where L' >= L + T the new keys and values are stored at [L, L + T) too): predicted features
        (B, T, E), their keys and values (B, Hkv, T, D), and the top_k guesses after the features of the rows
        `scored` (B, S), as log-probabilities and token ids (B, S, top_k), all left on the device."""
        (b, t), s = tokens.shape, len(scored[0])
        at, rows = to_device([p + r for p, r in zip(positions, scored)], features.device).split([t, s], 1)
        if self.captured is None:
            return self._head(tokens, features, at, past_k, past_v, visible, rows)
        # padded: B, T and S to powers of two, the keys before to a power of two from MIN_KEYS
        (heads, _, dim), past = past_k.shape[1:], visible.shape[2] - t
        many, padded, keys = bucket(b), bucket(t), bucket(past, MIN_KEYS)
        seen = torch.zeros(many, padded, keys + padded, dtype=torch.bool, device=visible.device)
        seen[:, :, keys:] = torch.eye(padded, dtype=torch.bool, device=visible.device)  # padding rows see themselves
        seen[:b, :t, :past] = visible[..., :past]
        seen[:b, :t, keys : keys + t] = visible[..., past:]
        shapes = ((many, padded), (many, padded, features.shape[2]), (many, padded), (many, heads, keys, dim),
                  (many, heads, keys, dim), seen.shape, (many, bucket(s)))
        out, k, v, logp, guesses = self.captured(
            (tokens, features, at, past_k[:, :, :past], past_v[:, :, :past], seen, rows), shapes)
        k, v = k[:b, :, :t], v[:b, :, :t]
        if past_k.shape[2] >= past + t:  # stored where the head would have written them
            past_k[:, :, past : past + t], past_v[:, :, past : past + t] = k, v
        return out[:b, :t], k, v, logp[:b, :s], guesses[:b, :s]

    def _head(self, ids: torch.Tensor, features: torch.Tensor, positions: torch.Tensor, past_k: torch.Tensor,
              past_v: torch.Tensor, visible: torch.Tensor,
              scored: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """Device tensors in and out: ids (B, T), features (B, T, E), positions (B, T), past_k, past_v (B, Hkv, L',
        D) as `_forward`'s, visible (B, T, L + T), scored (B, S) -> features (B, T, E), keys and values
        (B, Hkv, T, D), top_k log-probabilities and token ids (B, S, top_k) after the scored rows' features."""
        model = self.target.model
        cos, sin = model.rope(positions, model.dtype)
        out, k, v = self.eagle.head(model.embed_tokens.weight[ids], features, cos, sin, past_k, past_v, visible)
        picked = out.gather(1, scored.unsqueeze(2).expand(-1, -1, out.shape[2]))  # (B, S, E)
        top = self.eagle.output.logits(picked).log_softmax(-1).topk(self.top_k, dim=-1)  # (B, S, top_k)
        return out, k, v, top.values, self.eagle.vocab_ids[top.indices]

    def loaded(self) -> dict[str, Any]:
        return {"head": self.eagle}

    def describe(self) -> dict[str, Any]:
        return {"proposer": self.label, "head": self.eagle.folder.name, "depth": self.depth, "top_k": self.top_k,
                "nodes": self.nodes}


def _padded_keys(states: Sequence[_HeadState], room: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The requests' head keys and values, (B, Hkv, C + room, D) each with C the most any request holds, and which
    of the C places each request holds (B, C) bool, on the host. One request's are a view of its own storage (the
    room reserved there), so a forward writing its keys at [C, C + T) writes them there; several requests' are a
    copy padded with zeros."""
    if len(states) == 1:
        state = states[0]
        state.reserve(room)
        end = state.length + room
        return state.k[None, :, :end], state.v[None, :, :end], torch.ones(1, state.length, dtype=torch.bool)
    lengths = [state.length for state in states]
    committed = max(lengths)
    k, v = (torch.stack([F.pad(getattr(state, kv)[:, :n], (0, 0, 0, committed + room - n))
                         for state, n in zip(states, lengths)]) for kv in ("k", "v"))
    return k, v, torch.arange(committed) < torch.tensor(lengths).unsqueeze(1)


ALGORITHM = Algorithm(
    "eagle", "EAGLE (tree)", "EAGLE decoding (--algo eagle)", EagleParams, EagleProposer,
    (Setting("head", "folder of a head trained by `python -m playground.train eagle` (default: the head shipped for "
                     "the embedded model)", flag="--eagle-head", kind=str),
     Setting("depth", f"deepest drafted token, 1..{MAX_GAMMA}; under the measured plan a step may draft less deep",
             flag="--eagle-depth"),
     Setting("top_k", "nodes expanded per depth and children per node, 1..16", flag="--eagle-top-k"),
     Setting("nodes", f"most nodes of the tree, 1..{MAX_DYNAMIC_NODES} (default {EAGLE_CPU_NODES}, "
                      f"{EAGLE_GPU_NODES} on a GPU); each step verifies as many as pay for the wider forward",
             flag="--eagle-nodes", label=f"EAGLE tree nodes (0 = auto, 1..{MAX_DYNAMIC_NODES})", auto=True)),
    sources={"eagle": ("EAGLE head", "drafted")}, colour="#d55e00",
    example="Describe how a bicycle works in a short paragraph.", ships=default_head, grafts=True,
    variants=(Variant("sampled", {}, sampled=True, note="(exact)"),), short="EAGLE")
