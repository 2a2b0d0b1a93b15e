"""The forwards of a step: token ids, positions and attention masks for every scheduled request, and the target's
logits and final hidden states at the rows that are read (with the inputs of the layers the proposer taps). No
queues, no algorithm: a proposal is a token tree (`decoding.proposer`).

The decode rows run as one batch of `plan.width` tokens per request: its last token, then its proposal's nodes at
positions by depth (its probes among them), then padding. A tree's rows see their ancestors only. Padding after a
request's rows is causal: its rows never see it, and its KV is dropped after the step. Decode rows run through the
model's decode forwards (`models/forwards.py`: eager, or static shapes captured in CUDA graphs); each prefill chunk
is an eager forward of its own.
"""

from __future__ import annotations

import torch

from ..decoding.proposer import Proposal
from ..decoding.tree import ancestor_mask
from ..kv import KVCache
from ..models import Transformer
from ..models.forwards import Forwards
from ..waits import to_device
from .scheduler import StepPlan

EMPTY = Proposal([], [], [], [])


class Runner:
    def __init__(self, model: Transformer, cache: KVCache, forwards: Forwards) -> None:
        self.model, self.cache, self.forwards = model, cache, forwards

    def run(self, plan: StepPlan) -> tuple[dict[int, torch.Tensor], dict[int, torch.Tensor]]:
        """For every request that ran: logits (1 + n, V) at its last token and after each of the n nodes of its
        proposal (its probes last), and the final hidden states (1 + n, E) of those rows; for a
        prefill chunk of n tokens, the logits (1, V) at its last token and the hidden states (n, E) of all. With
        taps (`Forwards.taps`) each row of hidden states has the tapped layers' inputs after it: ((1 + taps) E)."""
        logits: dict[int, torch.Tensor] = {}
        hidden: dict[int, torch.Tensor] = {}
        if plan.decode and plan.width == 1:
            self._plain(plan, logits, hidden)
        elif plan.decode:
            self._wide(plan, logits, hidden)
        model, device = self.model, self.model.device
        for request, n in plan.prefill:
            start = request.num_computed
            ids = to_device([request.tokens[start : start + n]], device)  # (1, n)
            positions = torch.arange(start, start + n, device=device).unsqueeze(0)  # (1, n)
            out, states = model(ids, positions, self.cache, [request.id], num_logits=1,
                                taps=self.forwards.taps)  # (1, 1, V)
            logits[request.id], hidden[request.id] = out[0], states[0]  # (1, V), (n, (1 + taps) E)
        return logits, hidden

    def _plain(self, plan: StepPlan, logits: dict[int, torch.Tensor], hidden: dict[int, torch.Tensor]) -> None:
        states = self.forwards([r.id for r in plan.decode], [[r.tokens[r.num_computed]] for r in plan.decode],
                               [[r.num_computed] for r in plan.decode])  # (B, 1, (1 + taps) E)
        out = self.model.project(states[..., : self.model.config.hidden_size])  # (B, 1, V)
        for i, r in enumerate(plan.decode):
            logits[r.id], hidden[r.id] = out[i], states[i]

    def _wide(self, plan: StepPlan, logits: dict[int, torch.Tensor], hidden: dict[int, torch.Tensor]) -> None:
        model, device, width = self.model, self.model.device, plan.width
        rows, offsets, masks = [], [], []
        masked = any(not p.is_chain() for p in plan.proposals.values())
        for r in plan.decode:
            proposal = plan.proposals.get(r.id, EMPTY)
            row = [r.tokens[r.num_computed], *proposal.tokens]
            rows.append(row)
            offsets.append(proposal.depths() + list(range(len(row), width)))
            if masked:
                mask = torch.ones(width, width, dtype=torch.bool).tril()  # (W, W)
                mask[: len(row), : len(row)] = ancestor_mask([-1, *proposal.parents])
                masks.append(mask)
        ids = [c + c[-1:] * (width - len(c)) for c in rows]  # (B, W)
        positions = [[r.num_computed + o for o in row] for r, row in zip(plan.decode, offsets)]  # (B, W)
        among_new = torch.stack(masks) if masked else None  # (B, W, W); None: causal
        states = self.forwards([r.id for r in plan.decode], ids, positions, among_new)  # (B, W, (1 + taps) E)
        read = to_device([i * width + j for i, row in enumerate(rows) for j in range(len(row))], device)  # (N,)
        kept = states.flatten(0, 1).index_select(0, read)  # (N, (1 + taps) E): the rows read only, no padding
        logits_read = model.project(kept[:, : model.config.hidden_size])  # (N, V)
        start = 0
        for r, row in zip(plan.decode, rows):
            logits[r.id] = logits_read[start : start + len(row)]
            hidden[r.id] = kept[start : start + len(row)]
            start += len(row)
