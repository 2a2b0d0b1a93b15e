"""EAGLE (Li et al. 2024) with EAGLE-2's dynamic tree in the engine: a one-layer head drafts on the target's own
features.

Per decoding request the head keeps its keys and values over the positions whose target features it has read, and
the features it has not read yet (the prompt's from the prefill, then each step's kept rows). A step first catches
the head up on those (one forward), which predicts the feature at the last token and so the first drafted tokens;
then it grows a tree: at each depth the `top_k` likeliest nodes of that depth (by the head's cumulative
probability, calibrated by how often its guesses at that depth were kept) are expanded in one head forward, each
reading its ancestors' keys beside the committed ones and giving `top_k` children. The likeliest nodes of all
depths form the proposal (a parent is always likelier than its child, so they form a tree). The tree grows on the
device and comes back to the host once, chosen. Nothing drafted enters the head's own keys: what the target keeps
comes back as real features the next step reads.
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
from ..waits import to_device
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
        self.eos = torch.tensor(sorted(set(target.eos_token_ids)), device=target.model.device)  # (n,): never expanded
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
        depths = [min(room, depth) for _, room in ready]
        grown = [self.grow(r, d) for (r, _), d in zip(ready, depths)]
        trees = dict(zip([r.id for r, _ in ready], self._proposals(grown, depths)))
        self.own.record(time.perf_counter() - start, depth, cost.one_s)
        return trees

    def _ready(self, request: RequestView) -> bool:
        state = self.states.get(request.id)
        return state is not None and len(state.features) > 0 and \
            state.start + len(state.features) == request.num_computed

    @torch.inference_mode()
    def grow(self, request: RequestView, depth: int) -> torch.Tensor:
        """Catch the head up on the request's unread features, then grow its tree `depth` deep on the device, each
        depth's `top_k` likeliest nodes expanded: its likeliest nodes, best first, as rows of node index, token,
        parent index, worth and head log-probability (5, n) float64, left on the device."""
        state, k = self.states[request.id], self.top_k
        device = self.target.model.device
        count, committed = len(state.features), state.k.shape[1]
        next_tokens = request.tokens[state.start + 1 : state.start + count + 1]  # x_{t+1} for each feature f_t
        visible = to_device(torch.ones(count, committed + count, dtype=torch.bool).tril(committed), device)
        out, new_k, new_v, logp, guesses = self._forward(
            to_device(next_tokens, device), state.features, list(range(state.start, state.start + count)),
            state.k, state.v, visible, [count - 1])
        state.k, state.v = torch.cat((state.k, new_k), 1), torch.cat((state.v, new_v), 1)
        state.start, state.features = state.start + count, state.features[:0]
        committed += count
        scale = [math.log(self.calibration.scale(d)) for d in range(depth)]
        # Every node in order of depth (N,): depth 1's top_k guesses after the last token's predicted feature, then
        # top_k children of each node expanded. A node's worth is its calibrated log-chance of being reached.
        tokens, logps, parents = guesses[0], logp[0], torch.full((k,), -1, device=device)  # (k,) each
        worths = (logps.double() + scale[0]).clamp(max=0.0)  # float64, as Python's floats sum
        features = out[-1:].expand(k, -1)  # (k, E): the feature each node of the newest depth was guessed from
        first = 0  # the newest depth's first node
        ancestry = torch.zeros(0, 0, dtype=torch.bool, device=device)  # (X, X): each expanded node's expanded line
        tree_k, tree_v = state.k[:, :0], state.v[:, :0]
        for d in range(1, depth):
            # The newest depth's likeliest nodes that are not an end of sequence; where fewer are, one that is
            # expands too, its children worth nothing.
            score = worths[first:].masked_fill(torch.isin(tokens[first:], self.eos), -math.inf)
            best, chosen = (ranked[:k] for ranked in score.sort(descending=True, stable=True))  # (k,): within it
            expanded = ancestry.shape[0]
            line = torch.zeros(k, expanded + k, dtype=torch.bool, device=device)  # (k, X + k)
            if d > 1:  # a chosen node's parent is the (chosen // k)-th of the k nodes expanded last
                line[:, :expanded] = ancestry[expanded - k + torch.div(chosen, k, rounding_mode="floor")]
            line[:, expanded:] = torch.eye(k, dtype=torch.bool, device=device)
            ancestry = torch.cat((torch.cat((ancestry, ancestry.new_zeros(expanded, k)), 1), line))
            # each chosen node sees the committed keys, its expanded ancestors and itself
            visible = torch.cat((line.new_ones(k, committed), line), 1)  # (k, committed + X + k)
            out, new_k, new_v, logp, guesses = self._forward(
                tokens[first:][chosen], features[chosen], [request.num_computed + d - 1] * k,
                torch.cat((state.k, tree_k), 1), torch.cat((state.v, tree_v), 1), visible, list(range(k)))
            tree_k, tree_v = torch.cat((tree_k, new_k), 1), torch.cat((tree_v, new_v), 1)
            parents = torch.cat((parents, (first + chosen).repeat_interleave(k)))
            first = len(tokens)
            tokens, logps = torch.cat((tokens, guesses.flatten())), torch.cat((logps, logp.flatten()))
            worths = torch.cat((worths, (best.unsqueeze(1) + (logp.double() + scale[d]).clamp(max=0.0)).flatten()))
            features = out.repeat_interleave(k, dim=0)  # (k * k, E)
        # the likeliest nodes (n,), best first: a child is never likelier than its parent, the nodes are in order of
        # depth and the sort is stable, so parents come first
        order = worths.sort(descending=True, stable=True).indices[: self.nodes]  # (n,)
        return torch.stack((order.double(), tokens[order].double(), parents[order].double(), worths[order],
                            logps[order].double()))  # (5, n)

    def _proposals(self, grown: list[torch.Tensor], depths: list[int]) -> list[Proposal]:
        """The trees `grow` left on the device (5, n_i), `depths` deep, read back in one transfer, as proposals."""
        read = torch.cat(grown, dim=1).tolist()  # (5, sum of n_i)
        proposals, at = [], 0
        for nodes, depth in zip((tree.shape[1] for tree in grown), depths):
            row: dict[int, int] = {}
            kept: list[tuple[int, int, float, float]] = []  # token, parent row, chance of reaching, head probability
            for node, token, parent, worth, logp in zip(*(values[at : at + nodes] for values in read)):
                if worth > -math.inf:  # not below an end of sequence
                    row[int(node)] = len(kept) + 1
                    kept.append((int(token), 0 if parent < 0 else row[int(parent)], math.exp(worth), math.exp(logp)))
            proposals.append(Proposal([t for t, _, _, _ in kept], [r for _, r, _, _ in kept],
                                      [self.label] * len(kept), [c for _, _, c, _ in kept], [p for _, _, _, p in kept],
                                      forwards=depth))
            at += nodes
        return proposals

    def _forward(self, tokens: torch.Tensor, features: torch.Tensor, positions: list[int], past_k: torch.Tensor,
                 past_v: torch.Tensor, visible: torch.Tensor,
                 scored: list[int]) -> tuple[torch.Tensor, ...]:
        """The head over T new positions, tokens (T,) and visible (T, L + T) on the device: predicted features
        (T, E), their keys and values (Hkv, T, D), and the top_k guesses after the features of the rows `scored`
        (S), as log-probabilities and token ids (S, top_k), all left on the device."""
        t, s = len(tokens), len(scored)
        at, rows = to_device(positions + scored, self.target.model.device).split([t, s])
        if self.captured is None:
            out, k, v, logp, guesses = self._head(tokens, features, at, past_k, past_v, visible, rows)
        else:  # padded: T and S to powers of two, the keys before to a power of two from MIN_KEYS
            padded, (heads, past, dim) = bucket(t), past_k.shape
            keys = bucket(past, MIN_KEYS)
            seen = torch.zeros(padded, keys + padded, dtype=torch.bool, device=visible.device)  # (t, keys + t)
            seen[:, keys:] = torch.eye(padded, dtype=torch.bool, device=visible.device)  # padding rows see themselves
            seen[:t, :past] = visible[:, :past]
            seen[:t, keys : keys + t] = visible[:, past:]
            shapes = ((padded,), (padded, features.shape[1]), (padded,), (heads, keys, dim), (heads, keys, dim),
                      seen.shape, (bucket(s),))
            out, k, v, logp, guesses = self.captured((tokens, features, at, past_k, past_v, seen, rows), shapes)
            out, k, v = out[:t], k[:, :t], v[:, :t]
            logp, guesses = logp[:s], guesses[:s]
        return out, k, v, logp, guesses

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

    def describe(self) -> dict[str, Any]:
        return {"proposer": self.label, "head": self.eagle.folder.name, "depth": self.depth, "top_k": self.top_k,
                "nodes": self.nodes}
