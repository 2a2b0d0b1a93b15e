"""Medusa decoding (Cai et al. 2024): heads on the target's last hidden state propose a tree of continuations,
one target forward with a tree attention mask verifies every node at once.

Each step: the heads read the final hidden state of the position that predicted `last` (the last committed
token, not yet in the cache) and the embedding of `last`, and give each depth's top-k; the tree's paths pick
tokens from them. One forward runs [last, node 1, ..., node n] at positions P + depth, each node seeing the
prefix, its ancestors and itself.
Acceptance walks down from `last` (greedy: the child equal to the target's argmax; lossless: children verified
in turn as one-hot proposals; typical: the root-to-leaf path whose longest prefix passes the typical test),
then emits the correction or bonus token. Commit: `last` and the accepted nodes move into consecutive cache
slots; the rest of the tree is dropped. The prompt's forward gives the first hidden state.

With `copy_ngram` a step also grafts prompt lookup's copy of earlier text onto the tree: the copied tokens
follow the tree's nodes as far as those hold the same tokens, and the rest hang below as a chain, cut to the rows
one pass of the native CPU kernel has left beside the tree (`copy_in_pass`); they are one-hot proposals, verified
like every node, so greedy stays exact and sampling lossless. Heads predict poorly what a
text repeats from its prompt; a copy reaches further there than any head.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

import torch

from ..config import (DYNAMIC_TREE, ConfigError, EngineMedusaParams, GenerationParams, MedusaParams, SamplingParams,
                      dynamic_nodes)
from ..models import LoadedModel
from ..models.medusa import LoadedHeads, load_heads
from ..sampling import (TreeVerdict, probabilities, shown_probabilities, verify_tree_greedy, verify_tree_lossless,
                        verify_tree_typical)
from ..trace import AcceptEvent, BonusEvent, CorrectEvent, DraftEvent, Event, RejectEvent, TreeEvent, VerifyEvent
from .base import Decoder, EventStream, commit_event, forward_tree, new_cache
from .copies import Lookup, find_continuation
from .guesses import Guesser, Guesses
from .proposer import Cost, Outcome, Proposal, RequestView
from .tree import TreeBuffers, best_first, follow, graft_chain, load_tree, paths_tree


def shown_cells(tree: TreeBuffers, ids: list[int], verdict: TreeVerdict) -> list[tuple[int, int]]:
    """(logits row, token) of the probabilities a step's trace shows: each node's token after its parent, then the
    emitted token after the last accepted node (node i's successor is scored on row i)."""
    last = verdict.path[-1] if verdict.path else 0
    return [(tree.parents[node], ids[node]) for node in range(1, len(ids))] + [(last, verdict.token)]


@dataclass(frozen=True, slots=True)
class Graft:
    """A copy grafted onto a step's tree: `found` is prompt lookup's match, of which the first `matched` tokens
    are already tree nodes (ending at node `attach`) and the rest are new nodes in a chain below it."""

    found: Lookup
    attach: int
    matched: int

    @property
    def tokens(self) -> list[int]:
        return self.found.tokens[self.matched :]


class MedusaDecoder(Decoder):
    algo = "medusa"

    def __init__(self, target: LoadedModel, sampling: SamplingParams, generation: GenerationParams,
                 params: MedusaParams | None = None, heads: LoadedHeads | None = None) -> None:
        super().__init__(target, sampling, generation)
        self.spec = params or MedusaParams()
        if self.spec.acceptance == "greedy" and not sampling.greedy:
            raise ConfigError("acceptance greedy needs temperature 0; sample with lossless (exact) or typical (lossy)")
        self.heads = heads or load_heads(self.spec.heads, target)
        rows = target.model.rows_per_pass
        self.eos_ids = frozenset(target.eos_token_ids)  # a copy stops after one
        if self.spec.tree == DYNAMIC_TREE:
            self.tree: TreeBuffers | None = None
            self.nodes = self.spec.tree_nodes or dynamic_nodes(rows, target.model.device.type == "cuda")
            self.depth = self.heads.heads.num_heads
            self.copy_room = None  # the copy is among the dynamic tree's nodes
            return
        self.tree = load_tree(self.spec.tree)
        if self.tree.depth > self.heads.heads.num_heads:
            raise ConfigError(f"tree: depth {self.tree.depth} needs that many heads; the heads have "
                              f"{self.heads.heads.num_heads}")
        if max(self.tree.top_k()) > self.heads.vocab_size:
            raise ConfigError(f"tree: a depth takes the top {max(self.tree.top_k())} tokens; the heads score only "
                              f"{self.heads.vocab_size}")
        self.nodes = self.tree.num_nodes + (self.spec.copy_tokens if self.spec.copy_ngram else 0)
        self.depth = self.tree.depth
        spare = rows - 1 - self.tree.num_nodes if rows is not None else -1  # rows a pass has left beside the tree
        # the most new nodes a copy may add (None: its copy_tokens), so that the forward stays one pass
        self.copy_room = spare if self.spec.copy_in_pass and spare >= 0 else None

    def params(self) -> dict[str, Any]:
        return {**super().params(), "heads": str(self.heads.folder), "tree": self.spec.tree,
                "tree_nodes": self.nodes if self.tree is None else self.tree.num_nodes,
                "acceptance": self.spec.acceptance,
                "epsilon": self.spec.epsilon, "alpha": self.spec.alpha, "copy_ngram": self.spec.copy_ngram,
                "copy_tokens": self.spec.copy_tokens, "copy_in_pass": self.spec.copy_in_pass,
                "copy_room": self.copy_room}

    @torch.inference_mode()
    def propose(self, hidden: torch.Tensor, last: int, sequence: list[int],
                left: int) -> tuple[TreeBuffers, list[int], list[float], Graft | None]:
        """The step's tree, its tokens (ids[0] = `last`, then nodes 1..n) and proposal probabilities (nodes 1..n),
        and the copy grafted on, from the hidden state (E,) that predicted `last` and the text so far (`sequence`,
        ending with `last`); `left`: tokens still to generate, past which no copy is proposed. A head's
        probabilities are its softmax over the heads' vocabulary (all of it, or the reduced one); a copied token's
        is 1 (a one-hot proposal)."""
        model, heads = self.target.model, self.heads
        logits = heads.logits(hidden, model.embed_tokens.weight[last])[: self.depth]  # (D, V') over vocab_ids
        # one top-k for every depth (a depth past its own k never reads the extra ranks), normalised on its values
        k = min(self.nodes, heads.vocab_size) if self.tree is None else max(self.tree.top_k())
        top = logits.topk(k, dim=-1)  # values, indices: (D, k)
        logp = (top.values - logits.logsumexp(-1, keepdim=True)).tolist()  # (D, k)
        token_ids = heads.vocab_ids[top.indices].tolist()  # (D, k)
        found = self.lookup(sequence, left)
        if self.tree is None:
            paths, chain = best_first(logp, token_ids, found.tokens if found else [], self.nodes)
            tree = paths_tree(tuple(sorted(paths, key=lambda p: (len(p), p))))
        else:
            tree, chain = self.tree, self.copy_room
        ranks = [(len(path) - 1, path[-1]) for path in tree.paths]  # (depth index, rank) of nodes 1..n
        ids = [last, *(token_ids[d][rank] for d, rank in ranks)]
        probs = [math.exp(logp[d][rank]) for d, rank in ranks]
        if not found:
            return tree, ids, probs, None
        attach, matched = follow(tree, ids, found.tokens)
        if chain is not None:  # tokens on the tree's own nodes cost no row
            found = replace(found, tokens=found.tokens[: matched + chain])
        graft = Graft(found, attach, matched)
        if graft.tokens:
            tree = graft_chain(tree, attach, len(graft.tokens))
            ids += graft.tokens
            probs += [1.0] * len(graft.tokens)
        return tree, ids, probs, graft

    def lookup(self, sequence: list[int], left: int) -> Lookup | None:
        """The copy this step proposes, if any: prompt lookup's match for the text so far. Every match is
        proposed: on the benchmark suite (CPU, `small` tree) grafting only copies whose n-gram length had lately
        been accepted well committed fewer tokens per forward and ran slower."""
        if not self.spec.copy_ngram:
            return None
        return find_continuation(sequence, self.spec.copy_ngram, min(self.spec.copy_tokens, left), self.eos_ids)

    @torch.inference_mode()
    def forward(self, cache: Any, tree: TreeBuffers | None, ids: list[int],
                base: int) -> tuple[torch.Tensor, torch.Tensor]:
        """One target forward: over [last, nodes] with the tree's mask, or causally over a prompt (tree None).
        Logits (T, V) and final hidden states (T, E) of every token; the prompt needs only the last logits."""
        model = self.target.model
        tokens = torch.tensor([ids], device=model.device)  # (1, T)
        if tree is None:
            positions = torch.arange(base, base + len(ids), device=model.device).unsqueeze(0)  # (1, T)
            logits, hidden = model(tokens, positions, cache, (0,), num_logits=1)
            return logits[0], hidden[0]
        return forward_tree(model, cache, ids, tree.depths[: len(ids)], tree.mask[: len(ids), : len(ids)])

    def verify(self, logits: torch.Tensor, tree: TreeBuffers, ids: list[int],
               generator: torch.Generator) -> tuple[TreeVerdict, list[float]]:
        """The acceptance rule for this decoder's settings, and the probabilities the trace shows: the target's of
        each node's token after its parent (nodes 1..n), then of the emitted token after the last accepted node."""
        p = None if self.sampling.greedy else probabilities(logits, self.sampling)  # (n+1, V) when sampling
        if p is None:
            verdict = verify_tree_greedy(logits, tree.children, ids)
        elif self.spec.acceptance == "typical":
            verdict = verify_tree_typical(p, tree.retrieve, ids, self.spec.epsilon, self.spec.alpha, generator,
                                          tree.children)
        else:
            verdict = verify_tree_lossless(p, tree.children, ids, generator)
        return verdict, shown_probabilities(logits, p, shown_cells(tree, ids, verdict))

    def run(self, prompt_ids: list[int]) -> EventStream:
        clock, generator, stopper = self.start()
        target = self.target.model
        capacity = len(prompt_ids) + self.generation.max_new_tokens + self.nodes + 1
        cache = new_cache(target, capacity, self.generation)
        logits, hidden_all = self.forward(cache, None, prompt_ids, 0)  # causal: (T, V), (T, E)
        last, done = yield from self.first_token(logits[-1], cache, len(prompt_ids), clock, generator, stopper)
        hidden = hidden_all[-1]  # (E,) final hidden state of the position that predicted `last`
        sequence = list(prompt_ids) + [last]  # prompt + generated: what a copy is looked up in
        step = 0
        while not done:
            step += 1
            step_start = clock.now()
            base = cache.length(0)  # position of `last`
            # accepted nodes past max_new_tokens are cut by the stopper; a copy is never proposed past them
            tree, ids, head_probs, graft = self.propose(hidden, last, sequence,
                                                        self.generation.max_new_tokens - len(stopper.tokens))
            draft_end = clock.now()
            logits, hidden_all = self.forward(cache, tree, ids, base)  # (n+1, V), (n+1, E)
            verify_end = clock.now()
            yield from clock.emit(VerifyEvent(step=step, t=verify_end, num_tokens=len(ids),
                                              wall_s=verify_end - draft_end, target_forwards=1))
            verdict, target_probs = self.verify(logits, tree, ids, generator)
            events, kept_nodes, done = self.outcome(step, clock.now(), base, tree, ids, head_probs, target_probs,
                                                    verdict, draft_end - step_start, stopper, graft)
            cache.keep(0, base, [0, *kept_nodes])  # node i of the forward sits in slot base + i
            sequence += [ids[n] for n in verdict.path] + [verdict.token]
            hidden = hidden_all[kept_nodes[-1] if kept_nodes else 0]
            last = verdict.token
            yield from clock.emit(*events, commit_event(step, step_start, clock.now(), draft_end - step_start,
                                                        verify_end - draft_end, len(kept_nodes) + 1,
                                                        cache.memory().bytes_used))
        event, output = self.finish(stopper, clock, step)
        yield from clock.emit(event)
        return output

    def outcome(self, step: int, t: float, base: int, tree: TreeBuffers, ids: list[int], head_probs: list[float],
                target_probs: list[float], verdict: TreeVerdict, draft_s: float, stopper: Any,
                graft: Graft | None) -> tuple[list[Event], list[int], bool]:
        """The step's events (judged nodes as a draft, the tree, decisions), the nodes kept, and whether a stop
        rule fired. Accepted tokens past a stop are not kept. target_probs: as `verify` gives them."""
        def info(node: int) -> Any:
            return self.token_info(ids[node], base + tree.depths[node], p=target_probs[node - 1],
                                   q=head_probs[node - 1])

        copy: dict[str, Any] = {}
        if graft and graft.tokens:
            start = graft.found.start + graft.matched
            copy = {"copy_parent": graft.attach, "copy_source": [start, start + len(graft.tokens)],
                    "copy_ngram": graft.found.ngram}
        events: list[Event] = [
            DraftEvent(step=step, t=t, tokens=[info(n) for n, _, _ in verdict.judged], wall_s=draft_s,
                       draft_forwards=0),
            TreeEvent(step=step, t=t, paths=[list(path) for path in tree.paths], tokens=ids[1:], probs=head_probs,
                      target_probs=target_probs[:-1], accepted=list(verdict.path), **copy)]
        kept: list[int] = []
        for node, accepted, u in verdict.judged:
            if accepted:
                events.append(AcceptEvent(step=step, t=t, token=info(node), u=u))
                kept.append(node)
                if stopper.push(ids[node]):
                    return events, kept, True
            else:
                events.append(RejectEvent(step=step, t=t, token=info(node), u=u))
        last = verdict.path[-1] if verdict.path else 0
        final = self.token_info(verdict.token, base + tree.depths[last] + 1, p=target_probs[-1])
        events.append((CorrectEvent if verdict.corrected else BonusEvent)(step=step, t=t, token=final))
        return events, kept, stopper.push(verdict.token)



class MedusaGuesser(Guesser):
    """Medusa heads in the engine: for each decoding request, the heads' top guesses for each of the next tokens,
    from the final hidden state of the row that predicted its last token (one it has run since it was last
    admitted), batched over the requests; the dynamic tree is built from them (`Guesser.tree`)."""

    label = "medusa"

    def __init__(self, target: LoadedModel, params: EngineMedusaParams, heads: LoadedHeads | None = None) -> None:
        self.target, self.params = target, params
        self.heads = heads or load_heads(params.heads, target)
        num_heads = self.heads.heads.num_heads
        depth = params.depth or num_heads
        if depth > num_heads:
            raise ConfigError(f"medusa.depth must be in [1, {num_heads}] (the heads' number), got {depth}")
        shape, self.top_k = None, 0  # a fixed tree's paths, and the most ranks it takes at a depth
        if params.tree == DYNAMIC_TREE:
            nodes = params.nodes or dynamic_nodes(target.model.rows_per_pass, target.model.device.type == "cuda")
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

    def bind(self, settings: Any) -> None:
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
        k = self.top_k if self.shape is not None else min(longest, self.heads.vocab_size)
        hidden = torch.stack([self.hidden[r.id] for r in ready])  # (B, E)
        last = torch.tensor([r.tokens[r.num_computed] for r in ready], device=model.device)  # (B,)
        logits = self.heads.logits(hidden, model.embed_tokens.weight[last], depth)  # (D, B, V')
        top = logits.log_softmax(-1).topk(k, dim=-1)  # values, indices: (D, B, k)
        logp = top.values.transpose(0, 1).tolist()  # (B, D, k)
        tokens = self.heads.vocab_ids[top.indices].transpose(0, 1).tolist()  # (B, D, k)
        return {r.id: Guesses(lp, t) for r, lp, t in zip(ready, logp, tokens)}

    def tree(self, guesses: Guesses, room: int, nodes: int, *copy: Any) -> Proposal:
        tree = super().tree(guesses, room, nodes, *copy)
        typical = self.params.acceptance == "typical"
        return replace(tree, typical=(self.params.epsilon, self.params.alpha)) if typical else tree

    def observe(self, request: RequestView, proposal: Proposal | None, outcome: Outcome) -> None:
        super().observe(request, proposal, outcome)
        if not outcome.done:  # the row that predicted the last new token: the heads read it next
            self.hidden[request.id] = outcome.hidden[outcome.walk[-1]].clone()

    def describe(self) -> dict[str, Any]:
        return {"proposer": self.label, "heads": str(self.heads.folder), "depth": self.depth, "nodes": self.nodes,
                "tree": self.params.tree, "acceptance": self.params.acceptance}
