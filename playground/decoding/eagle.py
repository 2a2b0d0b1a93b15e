"""EAGLE (Li et al. 2024) with EAGLE-2's dynamic tree in the engine: a one-layer head drafts on the target's own
features.

Per decoding request the head keeps its keys and values over the positions whose target features it has read, and
the features it has not read yet (the prompt's from the prefill, then each step's kept rows). A step first catches
the head up on those (one forward), which predicts the feature at the last token and so the first drafted tokens;
then it grows a tree: at each depth the `top_k` likeliest nodes of that depth (by the head's cumulative
probability, calibrated by how often its guesses at that depth were kept) are expanded in one head forward, each
reading its ancestors' keys beside the committed ones and giving `top_k` children. The likeliest nodes of all
depths form the proposal (a parent is always likelier than its child, so they form a tree). Nothing drafted enters
the head's own keys: what the target keeps comes back as real features the next step reads.
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from ..config import EAGLE_CPU_NODES, EAGLE_GPU_NODES, EagleParams
from ..models import LoadedModel
from ..models.eagle import LoadedEagle, load_head
from ..models.forwards import MIN_KEYS, Captured, bucket
from .guesses import GuessCalibration
from .planning import OwnCost, guess_depth, weights_estimate
from .proposer import Cost, Outcome, Proposal, Proposer, RequestView


@dataclass
class _HeadState:
    """A request's head: keys and values (Hkv, L, D) over the positions before `start`, and the target's features
    (P, E) at positions start .. start + P - 1 that it has not read yet."""

    k: torch.Tensor
    v: torch.Tensor
    start: int
    features: torch.Tensor


@dataclass
class _Node:
    token: int
    parent: int  # index of the parent node, -1: the last token
    depth: int  # 1 = right after the last token
    logp: float  # the head's log-probability of the token given its parent
    worth: float  # calibrated log-chance of reaching the node
    feature: torch.Tensor  # (E,) the predicted feature its distribution came from (the parent's head output)


class EagleProposer(Proposer):
    """An EAGLE head's dynamic tree for every decoding request whose features it has."""

    label = "eagle"

    def __init__(self, target: LoadedModel, params: EagleParams | None = None, head: LoadedEagle | None = None) -> None:
        params = params or EagleParams()
        self.target, self.params = target, params
        self.eagle = head or load_head(params.head, target)
        gpu = target.model.device.type == "cuda"
        self.depth, self.top_k = params.depth, params.top_k
        self.nodes = params.nodes or (EAGLE_GPU_NODES if gpu else EAGLE_CPU_NODES)
        self.own = OwnCost(params.draft_cost, self.estimate_cost())  # a head forward's cost, measured as it runs
        self.eos_ids = frozenset(target.eos_token_ids)
        self.calibration = GuessCalibration(self.depth)
        self.states: dict[int, _HeadState] = {}
        # with the target's static forwards, the head runs in static shapes too (captured with its graphs)
        self.captured = None if target.forwards == "eager" else Captured(self._head, target.graphs)

    def own_cost(self) -> float:
        return self.own.value()

    def estimate_cost(self) -> float:
        """A head forward's cost over the target's before any is measured: its layer and the output rows it
        scores."""
        head = sum(p.numel() for p in self.eagle.head.parameters()) + self.eagle.output.weight.numel()
        return weights_estimate(self.target.model, head, 1)

    def bind(self, settings: Any) -> None:
        self.calibration = GuessCalibration(self.depth)
        self.states = {}

    def pause(self, request: RequestView) -> None:
        self.states.pop(request.id, None)

    def prefilled(self, request: RequestView, hidden: torch.Tensor) -> None:
        """A prefill chunk's final hidden states (n, E), which end at `request.num_computed`."""
        start = request.num_computed - len(hidden)
        state = self.states.get(request.id)
        if state is None or state.start + len(state.features) != start:
            k, v = self.eagle.empty_keys()
            self.states[request.id] = _HeadState(k, v, start, hidden.clone())
        else:
            state.features = torch.cat((state.features, hidden))

    def observe(self, request: RequestView, proposal: Proposal | None, outcome: Outcome) -> None:
        if proposal is not None:
            self.calibration.record(proposal, outcome.path, self.label)
        state = self.states.get(request.id)
        last = request.num_computed - 1  # the position of the step's row 0 (the engine counted it already)
        if outcome.done or state is None or state.start + len(state.features) != last:
            return  # finished, or a prefill whose features `prefilled` had
        state.features = torch.cat((state.features, outcome.hidden[outcome.walk]))  # the kept rows' features

    def propose(self, requests: Sequence[RequestView], rooms: list[int], cost: Cost) -> dict[int, Proposal]:
        ready = [(r, room) for r, room in zip(requests, rooms) if room > 0 and self._ready(r)]
        if not ready:
            return {}
        # Each drafted depth costs a head forward besides the wider verification: as deep as the guesses' kept
        # share so far says pays for both.
        price = self.own()
        depth = guess_depth(self.calibration.expected_tokens(self.depth), [room for _, room in ready], cost,
                            lambda places: places * price)
        if not depth:
            return {}
        start = time.perf_counter()
        trees = {r.id: self.tree(r, min(room, depth)) for r, room in ready}
        self.own.record(time.perf_counter() - start, depth, cost.one_s)
        return trees

    def _ready(self, request: RequestView) -> bool:
        state = self.states.get(request.id)
        return state is not None and len(state.features) > 0 and \
            state.start + len(state.features) == request.num_computed

    @torch.inference_mode()
    def tree(self, request: RequestView, depth: int) -> Proposal:
        """Catch the head up on the request's unread features, then grow its tree `depth` deep."""
        state = self.states[request.id]
        count = len(state.features)
        positions = list(range(state.start, state.start + count))
        next_tokens = request.tokens[state.start + 1 : state.start + count + 1]  # x_{t+1} for each feature f_t
        visible = torch.ones(count, state.k.shape[1] + count, dtype=torch.bool).tril(state.k.shape[1])
        out, k, v, top = self._forward(next_tokens, state.features, positions, state.k, state.v, visible, [count - 1])
        state.k, state.v = torch.cat((state.k, k), 1), torch.cat((state.v, v), 1)
        state.start, state.features = state.start + count, state.features[:0]
        nodes = self._children(out[-1:], top, [-1], [0.0], [1])  # the feature at the last token: depth 1's guesses
        expanded: list[int] = []  # nodes run through the head, in order; their keys are tree_k, tree_v's rows
        tree_k, tree_v = state.k[:, :0], state.v[:, :0]
        forwards = 1
        for d in range(1, depth):
            layer = [i for i, n in enumerate(nodes) if n.depth == d and n.token not in self.eos_ids]
            chosen = sorted(layer, key=lambda i: -nodes[i].worth)[: self.top_k]
            if not chosen:
                break
            # each chosen node sees the committed keys, its expanded ancestors and itself
            visible = torch.zeros(len(chosen), state.k.shape[1] + len(expanded) + len(chosen), dtype=torch.bool)
            visible[:, : state.k.shape[1]] = True
            for row, i in enumerate(chosen):
                ancestor = nodes[i].parent
                while ancestor >= 0:
                    visible[row, state.k.shape[1] + expanded.index(ancestor)] = True
                    ancestor = nodes[ancestor].parent
                visible[row, state.k.shape[1] + len(expanded) + row] = True
            out, k, v, top = self._forward([nodes[i].token for i in chosen],
                                           torch.stack([nodes[i].feature for i in chosen]),
                                           [request.num_computed + d - 1] * len(chosen),
                                           torch.cat((state.k, tree_k), 1), torch.cat((state.v, tree_v), 1), visible,
                                           list(range(len(chosen))))
            tree_k, tree_v = torch.cat((tree_k, k), 1), torch.cat((tree_v, v), 1)
            expanded += chosen
            forwards += 1
            nodes += self._children(out, top, chosen, [nodes[i].worth for i in chosen], [d + 1] * len(chosen))
        # The likeliest nodes, best first; a child is never likelier than its parent, and the sort is stable by
        # depth, so parents come first.
        order = sorted(range(len(nodes)), key=lambda i: (-nodes[i].worth, nodes[i].depth))[: self.nodes]
        row = {i: r + 1 for r, i in enumerate(order)}
        kept = [nodes[i] for i in order]
        return Proposal([n.token for n in kept], [0 if n.parent < 0 else row[n.parent] for n in kept],
                        [self.label] * len(kept), [math.exp(n.worth) for n in kept],
                        [math.exp(n.logp) for n in kept], forwards=forwards)

    def _forward(self, tokens: list[int], features: torch.Tensor, positions: list[int], past_k: torch.Tensor,
                 past_v: torch.Tensor, visible: torch.Tensor,
                 scored: list[int]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, tuple[list, list]]:
        """The head over T new positions: predicted features (T, E), their keys and values (Hkv, T, D), and the
        top_k guesses after the features of the rows `scored` (S), as log-probabilities and token ids (S, top_k)."""
        device = self.target.model.device
        if self.captured is None:
            ids, at, rows = (torch.tensor(values, device=device) for values in (tokens, positions, scored))
            out, k, v, logp, guesses = self._head(ids, features, at, past_k, past_v, visible.to(device), rows)
        else:  # padded: T and S to powers of two, the keys before to a power of two from MIN_KEYS
            t, s, (heads, past, dim) = bucket(len(tokens)), bucket(len(scored)), past_k.shape
            keys = bucket(past, MIN_KEYS)
            seen = torch.zeros(t, keys + t, dtype=torch.bool)  # (t, keys + t)
            seen[:, keys:] = torch.eye(t, dtype=torch.bool)  # padding rows see themselves
            seen[: len(tokens), :past] = visible[:, :past]
            seen[: len(tokens), keys : keys + len(tokens)] = visible[:, past:]
            # the integer inputs and the mask in one transfer
            host = torch.cat((torch.tensor(tokens + positions + scored), seen.view(-1).long()))
            ids, at, rows, flat = host.to(device).split([len(tokens), len(tokens), len(scored), seen.numel()])
            shapes = ((t,), (t, features.shape[1]), (t,), (heads, keys, dim), (heads, keys, dim), seen.shape, (s,))
            out, k, v, logp, guesses = self.captured(
                (ids, features, at, past_k, past_v, flat.view(seen.shape).bool(), rows), shapes)
            out, k, v = out[: len(tokens)], k[:, : len(tokens)], v[:, : len(tokens)]
            logp, guesses = logp[: len(scored)], guesses[: len(scored)]
        return out, k, v, (logp.tolist(), guesses.tolist())

    def _head(self, ids: torch.Tensor, features: torch.Tensor, positions: torch.Tensor, past_k: torch.Tensor,
              past_v: torch.Tensor, visible: torch.Tensor,
              scored: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """Device tensors in and out: ids (T,), features (T, E), positions (T,), past_k, past_v (Hkv, L, D), visible
        (T, L + T), scored (S,) -> features (T, E), keys and values (Hkv, T, D), top_k log-probabilities and token
        ids (S, top_k) after the scored rows' features."""
        model = self.target.model
        cos, sin = model.rope(positions.unsqueeze(0), model.dtype)
        out, k, v = self.eagle.head(model.embed_tokens.weight[ids].unsqueeze(0), features.unsqueeze(0), cos, sin,
                                    past_k.unsqueeze(0), past_v.unsqueeze(0), visible.unsqueeze(0))
        top = self.eagle.output.logits(out[0][scored]).log_softmax(-1).topk(self.top_k, dim=-1)  # (S, top_k)
        return out[0], k[0], v[0], top.values, self.eagle.vocab_ids[top.indices]

    def _children(self, features: torch.Tensor, top: tuple[list, list], parents: list[int], worths: list[float],
                  depths: list[int]) -> list[_Node]:
        """Nodes below `parents` for the top_k guesses `top` (log-probabilities, token ids) after each of the
        (T, E) predicted features."""
        scale = [math.log(self.calibration.scale(d - 1)) for d in depths]
        children = []
        for row, (parent, worth, depth) in enumerate(zip(parents, worths, depths)):
            for lp, token in zip(top[0][row], top[1][row]):
                children.append(_Node(token, parent, depth, lp, worth + min(0.0, lp + scale[row]), features[row]))
        return children

    def describe(self) -> dict[str, Any]:
        return {"proposer": self.label, "head": self.eagle.folder.name, "depth": self.depth, "top_k": self.top_k,
                "nodes": self.nodes}
