"""One prompt through the engine: batch-1 generation is the serving step with one request, its trace recorded."""

from __future__ import annotations

from collections.abc import Generator
from contextlib import nullcontext
from dataclasses import replace
from typing import Any

from ..config import EngineParams, GenerationParams, SamplingParams
from ..decoding.base import DecodeOutput, encode_prompt
from ..decoding.costs import ForwardCosts, LiveCosts
from ..decoding.proposer import Proposer
from ..kv import blocks_for
from ..models import LoadedModel
from ..trace import Event, Trace
from .engine import Engine

# Tokens a step may verify past the prompt and the answer: room for the widest proposal a proposer makes.
SPARE_TOKENS = 128


def stream_generate(target: LoadedModel, prompt: str | list[int], proposer: Proposer | None = None,
                    sampling: SamplingParams | None = None, generation: GenerationParams | None = None,
                    algo: str | None = None, costs: ForwardCosts | LiveCosts | None = None
                    ) -> Generator[Event, None, tuple[DecodeOutput, Trace]]:
    """Generate from a prompt (text, wrapped in the chat template unless generation.raw, or token ids) with
    `proposer` (None: plain decoding) on a cache of its own (the kind `generation.kv` names), yielding each trace
    event after the engine step that made it (the engine's clock is stopped meanwhile); returns the output and the
    whole trace, recorded under the name `algo` (None: "ar" for plain decoding, else the proposer's label).
    `costs`: what forwards cost by width (None: this machine's, as measured)."""
    sampling, generation = sampling or SamplingParams(), generation or GenerationParams()
    prompt_ids = encode_prompt(target, prompt, generation) if isinstance(prompt, str) else list(prompt)
    tokens = len(prompt_ids) + generation.max_new_tokens + SPARE_TOKENS
    params = EngineParams(num_blocks=blocks_for(tokens, generation.block_size), block_size=generation.block_size,
                          max_batch_tokens=len(prompt_ids) + SPARE_TOKENS, max_running=1, kv=generation.kv,
                          plan=generation.plan)
    engine = Engine(target, params, record_blocks=False, proposer=proposer, trace=True, costs=costs)
    request = engine.requests[engine.add_request(prompt_ids, sampling, generation)]
    text = prompt if isinstance(prompt, str) else target.tokenizer.decode(prompt_ids)
    name = algo or ("ar" if proposer is None else proposer.label)
    trace = Trace(algo=name, model=target.name, prompt=text, prompt_ids=prompt_ids,
                  params=header(sampling, generation, proposer, target.model.formats_read()))
    output = None
    events = request.trace
    assert events is not None  # the engine records traces
    try:
        while engine.has_unfinished():
            for out in engine.step():
                if out.error is not None:
                    raise RuntimeError(f"generation failed: {out.error}")
                output = out.output or output
            new = events[len(trace.events):]
            trace.events += new
            yield from new
    finally:
        engine.close()
    rests = engine.rests()  # how often drafting rested, committing fewer tokens a second than plain steps
    if rests is not None:
        trace.params["rests"], trace.params["rested_steps"] = rests
    if output is None:
        raise RuntimeError("generation ended without an output")
    return output, trace


def generate(target: LoadedModel, prompt: str | list[int], proposer: Proposer | None = None,
             sampling: SamplingParams | None = None, generation: GenerationParams | None = None,
             algo: str | None = None, costs: ForwardCosts | LiveCosts | None = None) -> tuple[DecodeOutput, Trace]:
    """`stream_generate` to the end."""
    stream = stream_generate(target, prompt, proposer, sampling, generation, algo, costs)
    while True:
        try:
            next(stream)
        except StopIteration as stop:
            return stop.value


def warm_up(target: LoadedModel, prompt: str | list[int], proposer: Proposer | None, sampling: SamplingParams,
            generation: GenerationParams, algo: str | None = None) -> None:
    """A short generation (`generation`'s length) that pays the first calls' costs (buffers allocated, weights read
    for the first time) of the target and of the proposer's own forwards: as set, so that the proposer drafts
    whatever a plan would say, and leaving its measured price as it was (`Proposer.warming_up`); as set, it judges
    nothing of whether drafting pays (`planner`). An engine that plans as set returns the proposer's acceptance to
    its prior (`Proposer.forget`): warm a proposer up before it learns."""
    generation = replace(generation, plan="as-set")
    with proposer.warming_up() if proposer is not None else nullcontext():
        generate(target, prompt, proposer, sampling, generation, algo)


def header(sampling: SamplingParams, generation: GenerationParams, proposer: Proposer | None,
           weights: str) -> dict[str, Any]:
    """The settings a trace records: what the target's products read, sampling, length, cache, and the proposer's
    own."""
    return {"weights": weights, "temperature": sampling.temperature, "top_k": sampling.top_k, "top_p": sampling.top_p,
            "seed": sampling.seed, "max_new_tokens": generation.max_new_tokens, "raw": generation.raw,
            "kv": generation.kv, "block_size": generation.block_size, "plan": generation.plan,
            **(proposer.describe() if proposer else {})}
