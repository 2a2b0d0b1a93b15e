"""Plain autoregressive decoding: one target forward per token. The baseline every other algorithm must match."""

from __future__ import annotations

import torch

from ..kv import ContiguousKVCache
from ..sampling import make_generator, next_token
from ..trace import BonusEvent, CommitEvent, KVAllocEvent, PrefillEvent, VerifyEvent
from .base import Decoder, EngineClock, EventStream, Stopper


class AutoregressiveDecoder(Decoder):
    """Plain decoding on the decoder steps: nothing is proposed, verify is one forward over the last token,
    accept draws the next token from the target (a 'bonus' token in trace terms), commit appends it."""

    algo = "ar"

    def new_cache(self, capacity: int) -> ContiguousKVCache:
        model = self.target.model
        cfg = model.config
        return ContiguousKVCache(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, capacity,
                                 dtype=model.dtype, device=model.device)

    @torch.inference_mode()
    def verify(self, cache: ContiguousKVCache, token_ids: list[int]) -> torch.Tensor:
        """One target forward over new tokens; returns the next-token logits (V,)."""
        model = self.target.model
        start = cache.length(0)
        ids = torch.tensor([token_ids], device=model.device)  # (1, T)
        positions = torch.arange(start, start + len(token_ids), device=model.device).unsqueeze(0)  # (1, T)
        logits, _ = model(ids, positions, cache, (0,), num_logits=1)  # (1, 1, V)
        return logits[0, -1]

    def run(self, prompt_ids: list[int]) -> EventStream:
        # Inference mode wraps each forward, not the loop: a generator suspended at `yield` must not leave the
        # consumer's code running in it.
        model = self.target.model
        clock = EngineClock(model.device)
        generator = make_generator(self.sampling.seed, model.device)
        stopper = Stopper(self.target.tokenizer, self.target.eos_token_ids, self.generation)
        cache = self.new_cache(len(prompt_ids) + self.generation.max_new_tokens)
        logits = self.verify(cache, prompt_ids)
        verify_end = clock.now()
        memory = cache.memory()
        yield from clock.emit(
            PrefillEvent(step=0, t=verify_end, num_tokens=len(prompt_ids), wall_s=verify_end),
            KVAllocEvent(step=0, t=verify_end, seq=0, num_tokens=len(prompt_ids),
                         bytes_used=memory.bytes_used, bytes_reserved=memory.bytes_reserved))
        step, verify_s = 0, verify_end
        while True:
            token_t, p_t = next_token(logits, self.sampling, generator)  # accept: x ~ p
            token, p = int(token_t), float(p_t)
            done = stopper.push(token)
            now = clock.now()
            kv_bytes = cache.memory().bytes_used
            yield from clock.emit(
                BonusEvent(step=step, t=now, token=self.token_info(token, cache.length(0), p=p)),
                CommitEvent(step=step, t=now, num_tokens=1, draft_s=0.0, verify_s=verify_s,
                            overhead_s=now - verify_end, kv_bytes=kv_bytes))
            if done:
                break
            step += 1
            verify_start = clock.now()
            logits = self.verify(cache, [token])
            verify_end = clock.now()
            verify_s = verify_end - verify_start
            yield from clock.emit(VerifyEvent(step=step, t=verify_end, num_tokens=1, wall_s=verify_s,
                                              target_forwards=1))
        event, output = self.finish(stopper, clock, step)
        yield from clock.emit(event)
        return output
