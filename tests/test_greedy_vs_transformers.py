"""Greedy plain decoding equals transformers `generate(do_sample=False)` token for token, on the GGUF blocks against
float32 activations (their products differ from float32's in the last bits only; the 8-bit activations of the
default move the logits further, and their quality is measured in test_gguf instead)."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from playground.config import GenerationParams, ModelSpec, SamplingParams
from playground.decoding import encode_prompt
from playground.engine import generate
from playground.models import load_model

from .prompts import PROMPTS

NEW_TOKENS = 128


@pytest.fixture(scope="module")
def reference(target):
    return AutoModelForCausalLM.from_pretrained(target.folder, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def ours(target):
    return load_model(ModelSpec(device="cpu", weights="gguf"))


@pytest.mark.parametrize("prompt", PROMPTS[:10])
def test_greedy_matches_transformers_generate(target, ours, reference, prompt: str) -> None:
    generation = GenerationParams(max_new_tokens=NEW_TOKENS)
    output, _ = generate(ours, prompt, None, SamplingParams(), generation)
    ids = torch.tensor([encode_prompt(target, prompt, generation)])
    with torch.inference_mode():
        expected = reference.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW_TOKENS,
                                      do_sample=False, eos_token_id=list(target.eos_token_ids),
                                      pad_token_id=target.eos_token_ids[0])
    assert list(output.token_ids) == expected[0, ids.shape[1]:].tolist()
    assert output.finish_reason in ("eos", "length")
