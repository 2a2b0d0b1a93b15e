"""The native model reproduces transformers' own forward: embedded model and tiny random configs per family."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from transformers import AutoConfig, AutoModelForCausalLM

from playground.config import GenerationParams
from playground.decoding.base import forward_tokens
from playground.decoding.base import new_cache as decoding_cache
from playground.kv import ContiguousKVCache
from playground.models import Transformer, UnsupportedModelError, compiled, native
from playground.models.forwards import make_forwards
from playground.models.linear import linear, pack
from playground.models.loader import build_model
from playground.models.vocab import output_rows

TOL = 1e-4
# The embedded model's packed (native or oneDNN) matrix products sum in another order than transformers' MKL
# ones: 30 layers of float32 rounding leave differences of ~4e-6 of the logit scale (1.4e-4 on logits up to 34).
EMBEDDED_REL_TOL = 1e-5

TINY = dict(vocab_size=320, hidden_size=64, intermediate_size=112, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=256, rms_norm_eps=1e-6)
FAMILIES = {
    "llama-tied": dict(model_type="llama", tie_word_embeddings=True),
    "llama3-rope-scaling": dict(model_type="llama", tie_word_embeddings=False, rope_parameters={
        "rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
        "high_freq_factor": 4.0, "original_max_position_embeddings": 64}),
    "llama-linear-rope": dict(model_type="llama", rope_parameters={"rope_type": "linear", "rope_theta": 10000.0,
                                                                   "factor": 2.0}),
    "mistral": dict(model_type="mistral", sliding_window=None, head_dim=16),
    "qwen2-qkv-bias": dict(model_type="qwen2", tie_word_embeddings=False),
    "qwen3-qk-norm": dict(model_type="qwen3", head_dim=32, tie_word_embeddings=True),
}


ROUTES = ["split-bmm", "onednn-packed", "native-panels"]


def use_route(route: str, monkeypatch: pytest.MonkeyPatch) -> bool:
    """Set up a route of `linear` and say whether to pack: oneDNN's prepacked weights are what `pack` gives
    without the native kernel; the native kernel's panels need it built (a C compiler with OpenMP)."""
    if route == "onednn-packed":
        monkeypatch.setattr(native, "kernel", lambda: None)
    elif route == "native-panels" and native.kernel() is None:
        pytest.skip(f"native kernel {native.status()}")
    return route != "split-bmm"


def tiny_pair(name: str) -> tuple[torch.nn.Module, Transformer]:
    kwargs = dict(TINY, **FAMILIES[name])
    model_type = kwargs.pop("model_type")
    config = AutoConfig.for_model(model_type, **kwargs)
    torch.manual_seed(0)
    reference = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    with torch.no_grad():  # random non-trivial norms and biases, so a missed weight would show
        for pname, param in reference.named_parameters():
            if "norm" in pname or pname.endswith("bias"):
                param.add_(torch.randn_like(param) * 0.1)
    state = {k: v.clone() for k, v in reference.state_dict().items()}
    model = build_model(config, state, torch.float32, torch.device("cpu"))
    return reference, model


def new_cache(model: Transformer, capacity: int = 128, rows: int = 1) -> ContiguousKVCache:
    cfg = model.config
    return ContiguousKVCache(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, capacity, max_seqs=rows)


def prefill_then_decode(model: Transformer, ids: torch.Tensor, split: int) -> torch.Tensor:
    """Logits (1, T, V) from a prefill of `split` tokens followed by one-token decode steps."""
    cache = new_cache(model)
    outs = [model(ids[:, :split], torch.arange(split)[None], cache, (0,))[0]]
    for i in range(split, ids.shape[1]):
        outs.append(model(ids[:, i : i + 1], torch.tensor([[i]]), cache, (0,))[0])
    return torch.cat(outs, dim=1)


@pytest.mark.parametrize("route", ROUTES)
@pytest.mark.parametrize("family", sorted(FAMILIES))
@torch.inference_mode()
def test_tiny_families_match_transformers(family: str, route: str, monkeypatch: pytest.MonkeyPatch) -> None:
    packed = use_route(route, monkeypatch)
    reference, model = tiny_pair(family)
    if packed:
        model.pack_linears()
        kind = native.Panels if route == "native-panels" else torch.Tensor
        assert isinstance(model.packed_output, kind) and isinstance(model.layers[0].mlp.down_proj.packed, kind)
    torch.manual_seed(1)
    ids = torch.randint(0, TINY["vocab_size"], (2, 40))
    expected = reference(ids).logits
    logits, hidden = model(ids, torch.arange(40).expand(2, 40), new_cache(model, rows=2), (0, 1))
    assert hidden.shape == (2, 40, TINY["hidden_size"])
    assert (logits - expected).abs().max().item() <= TOL
    incremental = prefill_then_decode(model, ids[:1], split=7)
    assert (incremental - expected[:1]).abs().max().item() <= TOL


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_the_compiled_layers_compute_what_each_familys_layers_do(family: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """`models.compiled`'s two functions, run here uncompiled (tests/test_forwards.py compiles them), in every layer
    of a verifying forward: q/k norms, qkv biases, head sizes, tied or not."""
    calls = []
    monkeypatch.setattr(compiled, "compiled", lambda: calls.append(1) or (compiled.attention_in, compiled.mlp_block))
    _, model = tiny_pair(family)
    torch.manual_seed(1)
    ids = torch.randint(0, TINY["vocab_size"], (1, 12))
    hidden = []
    for mode in ("static", "compiled"):
        cache = new_cache(model)
        forward_tokens(model, cache, ids[0, :9].tolist())
        hidden.append(make_forwards(model, cache, mode)([0], ids[:, 9:].tolist(), [[9, 10, 11]]))  # (1, 3, E)
    assert len(calls) == TINY["num_hidden_layers"]
    torch.testing.assert_close(hidden[1], hidden[0], rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("rows", [1, 2, 5, 16, 40])
@pytest.mark.parametrize("route", ROUTES)
@pytest.mark.parametrize("out_features", [96, 95], ids=["splittable", "odd"])
@torch.inference_mode()
def test_linear_matches_f_linear(rows: int, route: str, out_features: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every route of `linear` (split bmm for few rows, F.linear for many, oneDNN's packed weight from 3 rows, or
    from 2 when an odd output size cannot be split between the threads, the native kernel's panels, padded when
    the output size is not a multiple of their width) computes x W^T + b, also for inputs whose rows are not
    contiguous (a transposed view, as attention outputs are)."""
    packed = use_route(route, monkeypatch)
    torch.manual_seed(0)
    weight, bias = torch.randn(out_features, 48), torch.randn(out_features)
    x = torch.randn(48, rows).t()  # (rows, 48), non-contiguous
    got = linear(x.view(1, rows, 48) if rows > 1 else x, weight, bias, pack(weight) if packed else None)
    assert got.shape == ((1, rows, out_features) if rows > 1 else (1, out_features))
    assert (got.reshape(rows, out_features) - F.linear(x, weight, bias)).abs().max().item() <= TOL


@torch.inference_mode()
def test_embedded_model_matches_transformers(target) -> None:
    """On the GGUF blocks against float32 activations (the default's 8-bit activations move the logits further: their
    quality is measured in test_gguf)."""
    from playground.config import ModelSpec
    from playground.models import load_model

    ours_model = load_model(ModelSpec(device="cpu", weights="gguf"))
    assert ours_model.model.packed_output is not None  # the loader packs CPU weights: test that route
    reference = AutoModelForCausalLM.from_pretrained(target.folder, dtype=torch.float32).eval()
    ids = target.tokenizer("Speculative decoding drafts tokens cheaply and verifies them in one pass.",
                           return_tensors="pt").input_ids
    t = ids.shape[1]
    expected = reference(ids).logits
    tol = EMBEDDED_REL_TOL * expected.abs().max().item()
    logits, _ = ours_model.model(ids, torch.arange(t)[None], new_cache(ours_model.model), (0,))
    assert (logits - expected).abs().max().item() <= tol
    # Decode steps against transformers' own cached decode steps, one position at a time.
    cache = new_cache(ours_model.model)
    ours = [ours_model.model(ids[:, :5], torch.arange(5)[None], cache, (0,), num_logits=1)[0]]
    out = reference(ids[:, :5], use_cache=True)
    theirs, past = [out.logits[:, -1:]], out.past_key_values
    for i in range(5, t):
        ours.append(ours_model.model(ids[:, i : i + 1], torch.tensor([[i]]), cache, (0,))[0])
        out = reference(ids[:, i : i + 1], past_key_values=past, use_cache=True)
        theirs.append(out.logits)
        past = out.past_key_values
    assert (torch.cat(ours, 1) - torch.cat(theirs, 1)).abs().max().item() <= tol


@torch.inference_mode()
def test_output_rows_score_their_ids_and_nothing_else(target) -> None:
    """A proposer with a reduced vocabulary: num_logits=0 skips the projection and the rows score the hidden
    states as the whole projection does on their ids, -inf elsewhere (never sampled, never an argmax)."""
    model, vocab = target.model, target.model.config.vocab_size
    ids = target.tokenizer("Rows of the output projection.", return_tensors="pt").input_ids
    positions = torch.arange(ids.shape[1])[None]
    logits, hidden = model(ids, positions, new_cache(model), (0,), num_logits=2)  # (1, 2, V), (1, T, E)
    empty, same = model(ids, positions, new_cache(model), (0,), num_logits=0)
    assert empty.shape == (1, 0, vocab) and torch.equal(same, hidden)
    kept = torch.tensor([0, 17, 400, vocab - 1])
    for rows in (output_rows(model, kept), output_rows(model, torch.arange(vocab))):
        scored = rows.full_logits(hidden[0, -2:], vocab)  # (2, V)
        torch.testing.assert_close(scored[:, rows.ids], logits[0][:, rows.ids], atol=1e-4, rtol=1e-4)
        assert int(torch.isinf(scored).sum()) == 2 * (vocab - len(rows))
    assert output_rows(model, torch.arange(vocab)).weight is model.output_weight  # no copy for the whole


@torch.inference_mode()
def test_tree_mask_equals_separate_chains() -> None:
    """Two branches verified in one forward with a tree mask give each branch's own chain logits."""
    _, model = tiny_pair("llama-tied")
    prefix = torch.tensor([[5, 17, 42, 7]])
    branch_a, branch_b = [11, 12], [21, 22]
    chain_logits = []
    for branch in (branch_a, branch_b):
        ids = torch.cat([prefix, torch.tensor([branch])], dim=1)
        chain_logits.append(model(ids, torch.arange(6)[None], new_cache(model), (0,))[0][0, 4:])
    cache = new_cache(model)
    model(prefix, torch.arange(4)[None], cache, (0,))
    # Nodes: a1, a2 (child of a1), b1, b2 (child of b1); each sees the prefix, its ancestors and itself.
    mask = torch.tensor([[1, 0, 0, 0], [1, 1, 0, 0], [0, 0, 1, 0], [0, 0, 1, 1]], dtype=torch.bool)
    tree_ids = torch.tensor([branch_a + branch_b])
    positions = torch.tensor([[4, 5, 4, 5]])
    logits, _ = model(tree_ids, positions, cache, (0,), attn_mask=mask)
    assert (logits[0, :2] - chain_logits[0]).abs().max().item() <= TOL
    assert (logits[0, 2:] - chain_logits[1]).abs().max().item() <= TOL


def test_unsupported_architecture_lists_supported() -> None:
    config = AutoConfig.for_model("gpt2")
    with pytest.raises(UnsupportedModelError, match="supported: llama, mistral, qwen2, qwen3"):
        build_model(config, {}, torch.float32, torch.device("cpu"))


@pytest.mark.parametrize("kv", ["contiguous", "paged"])
@torch.inference_mode()
def test_a_tokens_logits_are_the_same_bits_in_every_forward(target, kv: str) -> None:
    """Greedy exactness by construction, on either cache: a chain's tokens decoded one per step, verified in one
    forward, and verified as one branch of a tree whose other branch sits between them (hidden keys between a
    token's ancestors) all give bit-identical logits, so no near-tie can tip a verifier's argmax away from plain
    decoding's. Needs the native attention (PyTorch's differed in the last bits between these forwards)."""
    kernel = native.kernel()
    model = target.model
    if kernel is None or not kernel.attends(model.config.head_dim, model.dtype, model.device):
        pytest.skip(f"native attention unavailable: kernel {native.status()}")
    prompt = target.tokenizer("Greedy decoding must not depend on how tokens are batched.").input_ids
    chain, other = [330, 1345, 2810, 28, 4917], [1135, 47, 3016, 9016, 12]

    def prefilled():
        cache = decoding_cache(model, 64, GenerationParams(max_new_tokens=16, kv=kv))
        forward_tokens(model, cache, prompt)
        return cache

    cache = prefilled()
    plain = torch.stack([forward_tokens(model, cache, [token])[-1] for token in chain])  # (5, V)
    verified = forward_tokens(model, prefilled(), chain, num_logits=len(chain))  # (5, V)
    assert torch.equal(verified, plain)
    # Nodes a1, b1, a2, b2, ...: the chain and another branch of the same depths, interleaved.
    tokens = [t for pair in zip(chain, other) for t in pair]
    depths = [i // 2 for i in range(len(tokens))]
    mask = torch.tensor([[j <= i and j % 2 == i % 2 for j in range(len(tokens))] for i in range(len(tokens))])
    positions = torch.tensor([depths]) + len(prompt)  # (1, 10)
    with torch.inference_mode():
        tree_logits, _ = model(torch.tensor([tokens]), positions, prefilled(), (0,), attn_mask=mask,
                               num_logits=None)  # (1, 10, V)
    assert torch.equal(tree_logits[0, 0::2], plain)
