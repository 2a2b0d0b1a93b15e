"""Model sources (embedded, GGUF file, local folder), quantization, and clear errors for bad specs."""

from __future__ import annotations

import bitsandbytes as bnb
import pytest
import torch

from playground.config import ConfigError, GenerationParams, ModelSpec, SamplingParams
from playground.engine import generate
from playground.models import ModelLoadError, load_model
from playground.models.loader import cache_root, embedded_gguf
from playground.paths import CACHE_ENV


def greedy_ids(model, prompt: str = "Name three planets.", tokens: int = 12) -> tuple[int, ...]:
    return generate(model, prompt, None, SamplingParams(), GenerationParams(max_new_tokens=tokens))[0].token_ids


def test_local_folder_loads_the_same_model(target) -> None:
    """The converted folder holds the file's weights as float32: the embedded model read as float32 too."""
    local = load_model(ModelSpec(source=str(target.folder), device="cpu"))
    assert local.name == target.folder.name and local.weights == "float32"
    assert greedy_ids(local) == greedy_ids(load_model(ModelSpec(device="cpu", weights="float32")))


def test_gguf_file_is_converted_once_into_the_cache(tmp_path, target) -> None:
    spec = ModelSpec(source=str(embedded_gguf()), device="cpu", cache_dir=str(tmp_path))
    loaded = load_model(spec)
    assert loaded.folder.parent == tmp_path and (loaded.folder / "model.safetensors").is_file()
    assert greedy_ids(loaded) == greedy_ids(target)
    again = load_model(spec)  # the second load reads the cached folder
    assert again.folder == loaded.folder


def test_cache_location_precedence(monkeypatch, tmp_path) -> None:
    monkeypatch.setenv(CACHE_ENV, str(tmp_path / "env"))
    assert cache_root(ModelSpec()) == tmp_path / "env"
    assert cache_root(ModelSpec(cache_dir=str(tmp_path / "arg"))) == tmp_path / "arg"


@pytest.mark.parametrize("quant, layer_type", [("int8", bnb.nn.Linear8bitLt), ("nf4", bnb.nn.Linear4bit)])
def test_bitsandbytes_quantization_generates(target, quant, layer_type) -> None:
    quantized = load_model(ModelSpec(source=str(target.folder), device="cpu", quant=quant))
    block = quantized.model.layers[0]
    assert isinstance(block.self_attn.qkv_proj, layer_type) and isinstance(block.mlp.down_proj, layer_type)
    assert block.kernel is None  # the native layer halves need packed float32 products: PyTorch's ops run it
    ids = greedy_ids(quantized, "What is the capital of France?", 8)
    assert "Paris" in quantized.tokenizer.decode(list(ids))


def test_bfloat16_runs(target) -> None:
    half = load_model(ModelSpec(source=str(target.folder), device="cpu", dtype="bfloat16"))
    assert half.model.dtype == torch.bfloat16
    assert all(block.kernel is None for block in half.model.layers)
    assert half.model.rows_per_pass is None  # PyTorch's kernels: no pass of rows to fill
    assert len(greedy_ids(half, tokens=4)) >= 1


@pytest.mark.parametrize("kwargs, error, message", [
    ({"source": " "}, ConfigError, "model must be"),
    ({"device": "tpu"}, ConfigError, "device must be one of auto, cpu, cuda"),
    ({"dtype": "float8"}, ConfigError, "dtype must be one of float32, bfloat16, float16"),
    ({"quant": "int3"}, ConfigError, "quant must be one of int8, nf4"),
])
def test_bad_specs(kwargs, error, message) -> None:
    with pytest.raises(error, match=message):
        ModelSpec(**kwargs)


def test_missing_cuda_is_a_clear_error(monkeypatch, target) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ModelLoadError, match="device: 'cuda'"):
        load_model(ModelSpec(source=str(target.folder), device="cuda"))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_greedy_matches_cpu(target) -> None:
    gpu = load_model(ModelSpec(source=str(target.folder), device="cuda"))
    assert greedy_ids(gpu, tokens=32) == greedy_ids(target, tokens=32)


def test_sharded_checkpoint_reads_only_the_indexed_shards(tmp_path) -> None:
    from transformers import AutoConfig, AutoModelForCausalLM

    from playground.models.loader import load_weights

    config = AutoConfig.for_model("llama", vocab_size=128, hidden_size=32, intermediate_size=64,
                                  num_hidden_layers=2, num_attention_heads=2, tie_word_embeddings=False)
    model = AutoModelForCausalLM.from_config(config)
    model.save_pretrained(tmp_path, max_shard_size="20KB")
    assert (tmp_path / "model.safetensors.index.json").is_file()
    (tmp_path / "consolidated.safetensors").write_bytes(b"another format's copy, never read")
    tensors = load_weights(tmp_path)
    assert set(tensors) == set(model.state_dict())
    assert all(torch.equal(tensors[k], v) for k, v in model.state_dict().items())
