"""Generation's common behaviour: stop rules, chat template, seeds, prompt limits, the engine clock."""

from __future__ import annotations

import pytest
import torch
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from playground.config import ConfigError, GenerationParams, SamplingParams
from playground.decoding import Stopper, encode_prompt
from playground.engine import generate, stream_generate


def test_chat_template_and_raw(target) -> None:
    chat = encode_prompt(target, "Hi", GenerationParams())
    raw = encode_prompt(target, "Hi", GenerationParams(raw=True))
    text = target.tokenizer.decode(chat)
    assert text.endswith("<|im_start|>assistant\n") and "<|im_start|>user\nHi<|im_end|>" in text
    assert raw == target.tokenizer("Hi").input_ids


def test_prompt_limits(target) -> None:
    with pytest.raises(ConfigError, match="prompt must be a non-empty string"):
        encode_prompt(target, "   ", GenerationParams())
    with pytest.raises(ConfigError, match="<= 8192"):
        encode_prompt(target, "word " * 9000, GenerationParams(raw=True))


def test_stopper_rules(target) -> None:
    tok = target.tokenizer
    ids = tok("one two three four five", add_special_tokens=False).input_ids
    stop = Stopper(tok, target.eos_token_ids, GenerationParams(max_new_tokens=50, stop=("three",)))
    pushed = 0
    while not stop.push(ids[pushed]):
        pushed += 1
    assert stop.reason == "stop" and pushed < len(ids) - 1
    with pytest.raises(RuntimeError):
        stop.push(ids[-1])
    assert stop.final_text() == "one two "
    length = Stopper(tok, target.eos_token_ids, GenerationParams(max_new_tokens=2))
    assert [length.push(i) for i in ids[:2]] == [False, True] and length.reason == "length"
    eos = Stopper(tok, target.eos_token_ids, GenerationParams())
    assert eos.push(target.eos_token_ids[0]) and eos.reason == "eos"


TEXT = "Crème brûlée 🍮 costs 5 €, say 'très bon' — 東京 or Zürich?\n\nYes: one  two   three 🚀🚀 done."


@settings(max_examples=60, deadline=None)
@given(start=st.integers(0, len(TEXT) - 1), length=st.integers(1, 12))
def test_a_stop_string_is_found_at_the_token_the_whole_text_finds_it(target, start, length) -> None:
    """The stopper decodes only the last tokens; it stops where decoding the whole text would have, with emoji,
    accents, CJK and runs of spaces (tokens that are a character's bytes alone, pieces whose leading space depends
    on what comes before)."""
    tok = target.tokenizer
    ids = tok(TEXT, add_special_tokens=False).input_ids
    stop_string = tok.decode(ids)[start:start + length]
    assume(stop_string.strip())
    expected = next(k for k in range(len(ids)) if stop_string in tok.decode(ids[:k + 1], skip_special_tokens=True))
    stopper = Stopper(tok, (), GenerationParams(max_new_tokens=len(ids) + 1, stop=(stop_string,)))
    assert next(k for k, i in enumerate(ids) if stopper.push(i)) == expected


def test_generation_stops_on_stop_string(target) -> None:
    prompt = "What is the capital of France?"
    plain = generate(target, prompt, None, SamplingParams(), GenerationParams(max_new_tokens=60))[0].text
    stop = plain.split()[3]  # a word the model writes a few words in, whichever answer these weights give
    output, trace = generate(target, prompt, None, SamplingParams(), GenerationParams(max_new_tokens=60, stop=(stop,)))
    assert output.finish_reason == "stop" and stop not in output.text and plain.startswith(output.text)
    assert stop in target.tokenizer.decode(list(output.token_ids))
    assert trace.finish().text == output.text


def test_seeded_sampling_is_reproducible(target) -> None:
    def run(seed: int) -> tuple[int, ...]:
        return generate(target, "Tell me a story about a fox.", None, SamplingParams(temperature=1.0, seed=seed),
                        GenerationParams(max_new_tokens=16))[0].token_ids

    assert run(11) == run(11)
    assert run(11) != run(12)


def test_time_spent_by_the_consumer_is_not_engine_time(target) -> None:
    import time

    stream = stream_generate(target, "Hi", None, SamplingParams(), GenerationParams(max_new_tokens=4))
    start = time.perf_counter()
    events = []
    try:
        while True:
            events.append(next(stream))
            assert not torch.is_inference_mode_enabled()  # the engine's modes stay inside the engine
            time.sleep(0.05)  # a slow renderer
    except StopIteration as stop:
        output, _ = stop.value
    elapsed = time.perf_counter() - start
    assert elapsed - output.wall_s >= 0.05 * (len(events) - 1)


@pytest.mark.parametrize("kv", ["contiguous", "paged"])
def test_the_prefill_records_the_kv_bytes_used_and_reserved(target, kv) -> None:
    """A contiguous row is reserved whole at the start (room for the prompt, every new token and the widest
    verification); the paged cache reserves the blocks the prompt fills."""
    _, trace = generate(target, "Hi", None, SamplingParams(), GenerationParams(max_new_tokens=8, kv=kv, block_size=4))
    alloc = next(e for e in trace.events if e.KIND == "kv-alloc")
    per_token = alloc.bytes_used // alloc.num_tokens
    assert alloc.bytes_used == alloc.num_tokens * per_token
    if kv == "contiguous":
        assert alloc.bytes_reserved > (alloc.num_tokens + 8) * per_token
    else:
        assert alloc.bytes_reserved == -(-alloc.num_tokens // 4) * 4 * per_token
