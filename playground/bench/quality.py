"""`python -m playground bench --suite quality`: what a way of reading the weights costs in quality, measured as the
field measures a quantisation.

Teacher-forced over held-out text that no model wrote (`held_out_text`): each way the products can read the weights
(`ModelSpec.weights`) against the model's float32 weights: the mean KL divergence from the float32 next-token
distribution, how often the two agree on the most likely next token (top-1) and the perplexity of the text; and
llama.cpp's own logits on the same GGUF file where llama-cpp-python is installed (`bash scripts/setup.sh --llama`).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from typing import Any

import torch

from ..config import GenerationParams
from ..decoding.base import forward_tokens, new_cache

WINDOW = 512  # tokens a window holds: each starts from an empty cache
CHUNK = 64  # tokens a forward feeds, so that a window costs what a long prompt does
MIN_TOKENS = 20_000


def held_out_text() -> list[str]:
    """Passages of human-written English no model wrote: the Python language reference's topics as this Python
    installation ships them (`pydoc_data`: prose and code on some eighty subjects, about 110,000 tokens), in a
    fixed order. Empty where the installation leaves them out."""
    try:
        from pydoc_data.topics import topics
    except ImportError:
        return []
    return [topics[name] for name in sorted(topics)]


def windows(tokenizer: Any, passages: Iterable[str], tokens: int) -> list[list[int]]:
    """At least `tokens` tokens of the passages, as windows of up to WINDOW tokens (one passage's start each)."""
    chosen: list[list[int]] = []
    total = 0
    for passage in passages:
        ids = tokenizer(passage)["input_ids"][:WINDOW]
        if len(ids) < 64:
            continue
        chosen.append(ids)
        total += len(ids) - 1
        if total >= tokens:
            return chosen
    raise ValueError(f"the held-out text holds {total} tokens; {tokens} were asked for")


@torch.inference_mode()
def window_logits(model: Any, ids: list[int]) -> torch.Tensor:
    """Logits (T, V) float32 of every position of `ids`, teacher-forced in forwards of CHUNK tokens."""
    cache = new_cache(model, len(ids), GenerationParams())
    parts = [forward_tokens(model, cache, ids[s : s + CHUNK], num_logits=len(ids[s : s + CHUNK]))
             for s in range(0, len(ids), CHUNK)]
    return torch.cat(parts).float()  # (T, V)


def compare(reference: torch.Tensor, logits: torch.Tensor, ids: list[int]) -> tuple[float, int, float, int]:
    """Against the reference logits (T, V) of the same window: the sum over its first T - 1 positions of the KL
    divergence KL(reference || logits), the positions whose argmax agree, the sum of -log p(next token), and T - 1."""
    ref = torch.log_softmax(reference[:-1].double(), -1)  # (T-1, V)
    own = torch.log_softmax(logits[:-1].double(), -1)
    kl = (ref.exp() * (ref - own)).sum(-1).sum().item()
    agree = int((ref.argmax(-1) == own.argmax(-1)).sum().item())
    nll = -own.gather(1, torch.tensor(ids[1:])[:, None]).sum().item()
    return kl, agree, nll, len(ids) - 1


def measure_quality(reference: Callable[[list[int]], torch.Tensor],
                    contenders: dict[str, Callable[[list[int]], torch.Tensor]], token_windows: list[list[int]],
                    progress: Callable[[str], None]) -> list[dict[str, Any]]:
    """Each contender's mean KL divergence to the reference, top-1 agreement and perplexity (and the reference's own
    perplexity) over the windows; every callable gives a window's logits (T, V)."""
    sums = {name: [0.0, 0, 0.0, 0] for name in ["float32", *contenders]}
    for i, ids in enumerate(token_windows):
        ref = reference(ids)
        for name, run in [("float32", lambda _: ref), *contenders.items()]:
            for k, value in enumerate(compare(ref, run(ids), ids)):
                sums[name][k] += value
        if (i + 1) % 10 == 0 or i + 1 == len(token_windows):
            positions = sums["float32"][3]
            progress(f"{i + 1}/{len(token_windows)} windows, {positions} positions: " + ", ".join(
                f"{name} KL {s[0] / positions:.4f}" for name, s in sums.items() if name != "float32"))
    return [{"weights": name, "positions": s[3], "kl": s[0] / s[3], "top1": s[1] / s[3],
             "perplexity": math.exp(s[2] / s[3])} for name, s in sums.items()]


def llama_logits(gguf_file: str) -> Callable[[list[int]], torch.Tensor] | None:
    """llama.cpp's logits of a window on the GGUF file (every position), or None where llama-cpp-python is absent."""
    try:
        from llama_cpp import Llama
    except ImportError:
        return None
    llm = Llama(model_path=gguf_file, n_ctx=WINDOW, n_batch=CHUNK, logits_all=True, verbose=False,
                n_threads=torch.get_num_threads())

    def run(ids: list[int]) -> torch.Tensor:
        llm.reset()
        llm.eval(ids)
        return torch.tensor(llm.scores[: len(ids)]).float()  # (T, V)

    return run


def markdown_quality(report: dict[str, Any]) -> str:
    q = report["quality"]
    lines = [f"# What each way of reading the weights costs in quality: {report['model']}, "
             f"{report['environment']['machine']}", "",
             f"Teacher-forced over {q['positions']} positions of held-out text no model wrote ({q['text']}), "
             f"windows of up to {WINDOW} tokens. Against the float32 weights (the file's blocks dequantised): the mean "
             "KL divergence of the next-token distribution, how often the most likely next token agrees, and the "
             "text's perplexity.", "",
             "| weights | KL divergence to float32 | top-1 agreement | perplexity |", "|---|---|---|---|"]
    for row in q["rows"]:
        lines.append(f"| {row['label']} | {row['kl']:.5f} | {100 * row['top1']:.2f}% | {row['perplexity']:.3f} |")
    return "\n".join(lines) + "\n"
