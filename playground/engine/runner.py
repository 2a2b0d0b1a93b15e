"""The forwards of a step: token ids, positions and attention masks for every scheduled request, and the target's
logits and final hidden states at the rows that are read (with the inputs of the layers the proposer taps). No
queues, no algorithm: a proposal is a token tree and maybe side rows (`decoding.proposer`).

The decode rows run as one batch of `plan.width` tokens per request: its last token, its proposal's nodes at
positions by depth, its side rows, then padding. A tree's rows see their ancestors only; side rows see the last
token and each other as their mask says, and nothing of the proposal (nor it them). Padding after a request's rows
is causal: its rows never see it, and its KV is dropped after the step. Decode rows run through the model's
decode forwards (`models/forwards.py`: eager, or static shapes captured in CUDA graphs); each prefill chunk is an
eager forward of its own.
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
        """For every request that ran: logits (1 + n + s, V) at its last token, after each of the n nodes of its
        proposal and at the s side rows read, and the final hidden states (1 + n + s, E) of those rows; for a
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
        rows, offsets, masks, scored = [], [], [], []
        masked = any(not p.is_chain() or p.side is not None for p in plan.proposals.values())
        for r in plan.decode:
            proposal = plan.proposals.get(r.id, EMPTY)
            chain = [r.tokens[r.num_computed], *proposal.tokens]
            side = proposal.side
            row = chain + (side.tokens if side else [])
            rows.append(row)
            offsets.append(proposal.depths() + (side.offsets if side else []) + list(range(len(row), width)))
            if masked:
                mask = torch.ones(width, width, dtype=torch.bool).tril()  # (W, W)
                mask[: len(chain), : len(chain)] = ancestor_mask([-1, *proposal.parents])
                if side:
                    mask[len(chain) : len(row)] = False
                    mask[len(chain) : len(row), 0] = True
                    mask[len(chain) : len(row), len(chain) : len(row)] = side.mask
                masks.append(mask)
            # the rows read: the last token's, the proposal's and the side rows' last `read`
            scored.append(list(range(len(chain))) + (list(range(len(row) - side.read, len(row))) if side else []))
        ids = [c + c[-1:] * (width - len(c)) for c in rows]  # (B, W)
        positions = [[r.num_computed + o for o in row] for r, row in zip(plan.decode, offsets)]  # (B, W)
        among_new = torch.stack(masks) if masked else None  # (B, W, W); None: causal
        states = self.forwards([r.id for r in plan.decode], ids, positions, among_new)  # (B, W, (1 + taps) E)
        read = to_device([i * width + j for i, rows_read in enumerate(scored) for j in rows_read], device)  # (N,)
        kept = states.flatten(0, 1).index_select(0, read)  # (N, (1 + taps) E): the rows read only
        logits_read = model.project(kept[:, : model.config.hidden_size])  # (N, V)
        start = 0
        for r, rows_read in zip(plan.decode, scored):
            logits[r.id] = logits_read[start : start + len(rows_read)]
            hidden[r.id] = kept[start : start + len(rows_read)]
            start += len(rows_read)
