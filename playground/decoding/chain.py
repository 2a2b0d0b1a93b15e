"""Verifying and accepting proposed chains, shared by every algorithm that proposes them (draft model, prompt
lookup, lookahead): several candidate chains verified in one forward as a tree, the acceptance rule from
`sampling`, and the accept / reject / correct / bonus events it implies."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..kv import KVCache
from ..models import Transformer
from ..sampling import (ChainVerdict, argmax_rows, greedy_matches, probabilities, sample, shown_probabilities,
                        verify_greedy, verify_lossless)
from ..trace import AcceptEvent, BonusEvent, CorrectEvent, Event, RejectEvent
from .base import Decoder, Stopper, forward_tokens, forward_tree
from .tree import tree_from_parents


@dataclass(frozen=True, slots=True)
class ChainOutcome:
    events: list[Event]  # accept*, then reject + correct or bonus (unless a stop rule ended it early)
    accepted: int  # proposals the rule accepted (some may lie past a stop and not be kept)
    judged: int  # proposals the rule judged: the accepted ones and the first refused one, if any
    token: int  # the correction or bonus token: the next token no cache has seen yet
    done: bool  # a stop rule fired
    kept: int  # tokens committed this step


def one_hot(tokens: list[int], vocab: int, device: torch.device) -> torch.Tensor:
    """q (K, V) for proposals that were not sampled (n-grams, guesses): all mass on the proposed token."""
    index = torch.tensor(tokens, dtype=torch.long, device=device).unsqueeze(1)  # (K, 1)
    return torch.zeros(len(tokens), vocab, device=device).scatter_(1, index, 1.0)


def longest_match(argmax: list[int], rows: list[list[int]], candidates: list[list[int]]) -> int:
    """Index of the candidate chain the target's argmaxes keep longest, the earliest on ties (greedy).
    argmax: the target's argmax of each logits row of the forward, once for every candidate; rows[i]: the rows
    at the root and after each token of candidates[i]."""
    matches = [greedy_matches([argmax[r] for r in row], list(candidate)) for row, candidate in zip(rows, candidates)]
    return matches.index(max(matches))


def merge_proposals(proposals: list[list[int]]) -> tuple[list[int], list[int], list[list[int]]]:
    """Proposals as one tree below the root (node 0, the last committed token), a shared prefix verified once:
    the tokens of nodes 1..n, the parents of nodes 0..n (the root's -1) and each proposal's nodes in order."""
    tokens: list[int] = []
    parents = [-1]
    node_of: dict[tuple[int, int], int] = {}  # (parent, token) -> node
    paths: list[list[int]] = []
    for proposal in proposals:
        node, path = 0, []
        for token in proposal:
            if (node, token) not in node_of:
                tokens.append(token)
                parents.append(node)
                node_of[node, token] = len(parents) - 1
            node = node_of[node, token]
            path.append(node)
        paths.append(path)
    return tokens, parents, paths


@dataclass(frozen=True, slots=True)
class Verified:
    logits: torch.Tensor  # (K+1, V): the chosen candidate's rows, at the root and after each of its K tokens
    chosen: int  # index of the chosen candidate
    paths: list[list[int]]  # each candidate's nodes in order; node i of the forward sits in slot cache length + i
    width: int  # tokens the forward took: the root and every distinct node


def verify_candidates(model: Transformer, cache: KVCache, last: int, candidates: list[list[int]]) -> Verified:
    """One target forward over the last committed token and the candidate chains after it. One candidate (or
    none) is verified as a chain; several, merged into one tree (`merge_proposals`), are judged greedily: the one
    the target's argmaxes keep longest wins, the earliest on ties (`longest_match`)."""
    nodes, parents, paths = merge_proposals(candidates)
    if len(candidates) > 1:
        tree = tree_from_parents(parents)
        tree_logits, _ = forward_tree(model, cache, [last] + nodes, tree.depths, tree.mask)  # (n+1, V)
        rows = [[0, *path] for path in paths]  # each candidate's chain of logits rows
        chosen = longest_match(argmax_rows(tree_logits), rows, candidates)
        return Verified(tree_logits[rows[chosen]], chosen, paths, len(nodes) + 1)
    logits = forward_tokens(model, cache, [last] + nodes, num_logits=len(nodes) + 1)  # (K+1, V)
    return Verified(logits, 0, paths, len(nodes) + 1)


def accept_chain(decoder: Decoder, step: int, t: float, base: int, target_logits: torch.Tensor,
                 proposals: list[int], q: torch.Tensor | None, q_shown: list[float] | None,
                 generator: torch.Generator, stopper: Stopper) -> ChainOutcome:
    """Judge `proposals` against the target and push the kept tokens into `stopper`.

    target_logits (K+1, V): row i scores proposal i, row K the bonus position. q (K, V): the distributions the
    proposals were drawn from; needed only when sampling (one-hot for guesses). base: the position of the
    token before the first proposal. Greedy: accept while equal to the argmax. Sampling: the lossless rule.
    """
    sampling = decoder.sampling
    if sampling.greedy:
        verdict = verify_greedy(target_logits, proposals)
        p = None
    else:
        p = probabilities(target_logits, sampling)  # (K+1, V)
        if not proposals:  # nothing to judge: a plain decoding step
            verdict = ChainVerdict(0, int(sample(p[0], generator)), False, ())
        elif q is None:
            raise ValueError("q is required to verify sampled proposals")
        else:
            verdict = verify_lossless(p, q, proposals, generator)
    n = verdict.num_accepted
    # the probabilities shown: each judged proposal's (the accepted ones and the refused one), then the token's
    cells = [*enumerate(proposals[: n + 1]), (n, verdict.token)]
    # under greedy normalised on the rows judged alone: up to the correction or bonus, often 1-2 of K+1 rows
    shown = shown_probabilities(target_logits, p, cells)
    p_shown, p_token = shown[:-1], shown[-1]
    q_list: list[float | None] = list(q_shown) if q_shown is not None else [None] * len(proposals)
    uniforms = list(verdict.uniforms) + [None] * len(proposals)
    events: list[Event] = []
    kept, done = 0, False
    for i in range(verdict.num_accepted):
        info = decoder.token_info(proposals[i], base + 1 + i, p=p_shown[i], q=q_list[i])
        events.append(AcceptEvent(step=step, t=t, token=info, u=uniforms[i]))
        kept += 1
        done = stopper.push(proposals[i])
        if done:
            break
    if not done:
        if verdict.corrected:
            rejected = decoder.token_info(proposals[n], base + 1 + n, p=p_shown[n], q=q_list[n])
            events.append(RejectEvent(step=step, t=t, token=rejected, u=uniforms[n]))
        info = decoder.token_info(verdict.token, base + 1 + n, p=p_token)
        events.append((CorrectEvent if verdict.corrected else BonusEvent)(step=step, t=t, token=info))
        kept += 1
        done = stopper.push(verdict.token)
    return ChainOutcome(events, verdict.num_accepted, verdict.num_accepted + int(verdict.corrected), verdict.token,
                        done, kept)
