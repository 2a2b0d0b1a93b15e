"""Plain autoregressive decoding: one target forward per token. The baseline every other algorithm must match."""

from __future__ import annotations

from ..sampling import make_generator, next_token
from ..trace import BonusEvent, CommitEvent, VerifyEvent
from .base import Decoder, EngineClock, EventStream, Stopper, forward_tokens, new_cache, prefill_events


class AutoregressiveDecoder(Decoder):
    """Plain decoding on the decoder steps: nothing is proposed, verify is one forward over the last token,
    accept draws the next token from the target (a 'bonus' token in trace terms), commit appends it."""

    algo = "ar"

    def run(self, prompt_ids: list[int]) -> EventStream:
        model = self.target.model
        clock = EngineClock(model.device)
        generator = make_generator(self.sampling.seed, model.device)
        stopper = Stopper(self.target.tokenizer, self.target.eos_token_ids, self.generation)
        cache = new_cache(model, len(prompt_ids) + self.generation.max_new_tokens)
        logits = forward_tokens(model, cache, prompt_ids)[-1]  # prefill
        verify_end = clock.now()
        yield from clock.emit(*prefill_events(verify_end, cache, len(prompt_ids)))
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
            logits = forward_tokens(model, cache, [token])[-1]  # verify: one forward over the last token
            verify_end = clock.now()
            verify_s = verify_end - verify_start
            yield from clock.emit(VerifyEvent(step=step, t=verify_end, num_tokens=1, wall_s=verify_s,
                                              target_forwards=1))
        event, output = self.finish(stopper, clock, step)
        yield from clock.emit(event)
        return output
