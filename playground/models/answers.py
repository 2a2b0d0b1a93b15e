"""A target's own greedy answers to the training prompts, as token ids: the corpus whose most frequent n-grams
seed lookahead decoding's pool (`python -m playground.train ngrams` writes it). Stored as safetensors (never
pickled), with the vocabulary size it was written for."""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, safe_open, save_file

from .loader import ModelLoadError

ANSWERS = "answers.safetensors"
# The answers shipped for the embedded target.
EMBEDDED_ANSWERS = Path(__file__).resolve().parents[2] / "assets" / "lookahead-smollm2-135m" / ANSWERS


def default_answers(target_source: str) -> str | None:
    """The shipped answers for a target spec, if the project has them."""
    if target_source == "embedded" and EMBEDDED_ANSWERS.is_file():
        return str(EMBEDDED_ANSWERS)
    return None


def save_answers(path: Path, answers: list[list[int]], vocab_size: int, model: str) -> None:
    lengths = torch.tensor([len(a) for a in answers], dtype=torch.int32)
    tokens = torch.tensor([t for a in answers for t in a], dtype=torch.int32)
    save_file({"tokens": tokens, "lengths": lengths}, str(path),
              metadata={"vocab_size": str(vocab_size), "model": model})


def read_answers(source: str) -> tuple[list[list[int]], int]:
    """The answers in a file written by `save_answers`, and the vocabulary size they were written for."""
    path = Path(source).expanduser()
    if not path.is_file():
        raise ModelLoadError(f"corpus: {source!r} is not a file; write one with `python -m playground.train "
                             "ngrams --model SPEC --out FOLDER`")
    try:
        with safe_open(str(path), "pt") as handle:
            vocab = int((handle.metadata() or {})["vocab_size"])
        tensors = load_file(str(path))
        tokens, lengths = tensors["tokens"], tensors["lengths"]
    except (SafetensorError, OSError, KeyError, ValueError) as exc:
        raise ModelLoadError(f"corpus: {path} is not an answers file ({exc})") from exc
    in_vocab = tokens.numel() == 0 or (int(tokens.min()) >= 0 and int(tokens.max()) < vocab)
    if (tokens.dim() != 1 or lengths.dim() != 1 or bool((lengths < 0).any())
            or int(lengths.sum()) != tokens.numel() or not in_vocab):
        raise ModelLoadError(f"corpus: {path} holds inconsistent tokens and lengths")
    flat = tokens.tolist()
    answers, start = [], 0
    for length in lengths.tolist():
        answers.append(flat[start : start + length])
        start += length
    return answers, vocab


def load_answers(source: str, vocab: int) -> list[list[int]]:
    """The answers in a file written by `save_answers`, checked against the target's vocabulary size."""
    answers, written_for = read_answers(source)
    if written_for != vocab:
        raise ModelLoadError(f"corpus: {source} was written for a vocabulary of {written_for} tokens, the target "
                             f"has {vocab}")
    return answers
