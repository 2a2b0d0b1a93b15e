"""Plain autoregressive decoding: one target forward per token. The baseline every other algorithm must match."""

from __future__ import annotations

from ..sampling import next_token
from ..trace import BonusEvent, VerifyEvent
from .base import Decoder, EventStream, commit_event, forward_tokens, new_cache


class AutoregressiveDecoder(Decoder):
    """Plain decoding on the decoder steps: nothing is proposed, verify is one forward over the last token,
    accept draws the next token from the target (a 'bonus' token in trace terms), commit appends it."""

    algo = "ar"

    def run(self, prompt_ids: list[int]) -> EventStream:
        model = self.target.model
        clock, generator, stopper = self.start()
        cache = new_cache(model, len(prompt_ids) + self.generation.max_new_tokens, self.generation)
        last, done = yield from self.prefill(cache, prompt_ids, clock, generator, stopper)
        step = 0
        while not done:
            step += 1
            verify_start = clock.now()
            logits = forward_tokens(model, cache, [last])[-1]  # verify: one forward over the last token
            verify_end = clock.now()
            verify_s = verify_end - verify_start
            yield from clock.emit(VerifyEvent(step=step, t=verify_end, num_tokens=1, wall_s=verify_s,
                                              target_forwards=1))
            token_t, p_t = next_token(logits, self.sampling, generator)  # accept: x ~ p
            last = int(token_t)
            done = stopper.push(last)
            now = clock.now()
            yield from clock.emit(
                BonusEvent(step=step, t=now, token=self.token_info(last, cache.length(0), p=float(p_t))),
                commit_event(step, verify_start, now, 0.0, verify_s, 1, cache.memory().bytes_used))
        event, output = self.finish(stopper, clock, step)
        yield from clock.emit(event)
        return output
