"""The bench's peers: transformers `generate` on the same weights (and its assisted generation), llama.cpp
(`llama-cpp-python`, an optional extra: `bash scripts/setup.sh --llama`) on the same GGUF file, and any
OpenAI-compatible endpoint (`playground.remote`), timed over HTTP."""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ..config import GenerationParams
from ..remote import RemoteRun, median_ratio, median_round


@dataclass(frozen=True, slots=True)
class Run:
    tokens: int
    wall_s: float
    token_ids: tuple[int, ...]

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.wall_s


def run_hf(hf_model: Any, prompt_ids: list[int], target: Any, generation: GenerationParams, **extra: Any) -> Run:
    """transformers `generate` on the same weights, greedy; `extra` adds e.g. an assistant model."""
    ids = torch.tensor([prompt_ids], device=hf_model.device)
    with torch.inference_mode():
        if hf_model.device.type == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        out = hf_model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=generation.max_new_tokens,
                                do_sample=False, eos_token_id=list(target.eos_token_ids),
                                pad_token_id=target.eos_token_ids[0], **extra)
        if hf_model.device.type == "cuda":
            torch.cuda.synchronize()
        wall = time.perf_counter() - start
    new = tuple(out[0, len(prompt_ids):].tolist())
    return Run(len(new), wall, new)


def run_stats(run: Run) -> dict[str, float]:
    return {"tokens": run.tokens, "wall_s": run.wall_s, "tokens_per_s": run.tokens_per_s}


def endpoint_stats(runs: list[RemoteRun], plain: list[Run]) -> dict[str, Any]:
    """A remote lane on one prompt: its median round (by tok/s, with its time to the first text and how its
    tokens were counted) and the median over rounds of its tok/s over plain decoding's in the same round."""
    middle = median_round(runs)
    return {"tokens": middle.tokens, "wall_s": middle.wall_s, "tokens_per_s": middle.tokens_per_s,
            "first_token_s": middle.first_token_s, "counted": middle.counted,
            "ratio_vs_ar": median_ratio(runs, [p.tokens_per_s for p in plain])}


class PeerRuns:
    """One prompt's transformers peer runs by their generate() arguments: rows whose peers are called alike (a
    variant with prompt copies, which transformers lacks, and its copy-free row) share one run instead of timing
    the same call twice."""

    def __init__(self) -> None:
        self.runs: dict[tuple[tuple[str, Any], ...], Any] = {}

    def get(self, kwargs: dict[str, Any], run: Any) -> Any:
        # the assistant model is one object for every row: its identity is its key
        key = tuple(sorted((k, id(v) if k == "assistant_model" else v) for k, v in kwargs.items()))
        if key not in self.runs:
            self.runs[key] = run()
        return self.runs[key]


def llama_cpp_peer(gguf_file: Path | None, context: int) -> Any | None:
    """llama.cpp on `gguf_file` with this process's thread count, or None where the file is not GGUF or
    llama-cpp-python is not installed."""
    if gguf_file is None:
        return None
    try:
        from llama_cpp import Llama
    except ImportError:
        return None
    threads = torch.get_num_threads()
    return Llama(str(gguf_file), n_ctx=context, n_threads=threads, n_threads_batch=threads, verbose=False)


def run_llama(llm: Any, prompt_ids: list[int], target: Any, generation: GenerationParams) -> Run:
    """llama.cpp's greedy decoding of the same prompt ids, to an end-of-sequence id or max_new_tokens (its own
    arithmetic: Q8 activations against the blocks, so its tokens may differ from ours)."""
    llm.reset()
    new: list[int] = []
    start = time.perf_counter()
    for token in llm.generate(prompt_ids, top_k=1, temp=0.0, repeat_penalty=1.0, reset=True):
        new.append(int(token))
        if token in target.eos_token_ids or len(new) >= generation.max_new_tokens:
            break
    return Run(len(new), time.perf_counter() - start, tuple(new))
