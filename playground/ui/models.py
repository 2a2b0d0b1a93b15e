"""The model panel and the models behind it: loaded once per spec and shared by every session (weights are
read-only); the Load button loads the target (and its draft) ahead of a run, with progress and a summary."""

from __future__ import annotations

import threading
import gradio as gr

from ..config import DEVICES, DTYPES, QUANTS, ConfigError, ModelSpec
from ..decoding.speculative import check_compatible
from ..models import LoadedModel, ModelLoadError, load_model, native
from ..models.loader import default_draft, draft_spec
from ..models.vocab import proposal_rows

_models: dict[ModelSpec, LoadedModel] = {}
_lock = threading.Lock()
NO_QUANT = "none"


def get_model(spec: ModelSpec) -> LoadedModel:
    """The loaded model for a spec; the first call loads (converting a GGUF once), later calls are free."""
    with _lock:
        if spec not in _models:
            _models[spec] = load_model(spec)
        return _models[spec]


def target_spec(source: str, device: str, dtype: str = "float32", quant: str = NO_QUANT) -> ModelSpec:
    """The panel's target as a spec (every field validated by ModelSpec, with its name in the message)."""
    return ModelSpec(source=(source or "").strip() or "embedded", device=device, dtype=dtype,
                     quant=None if quant in (None, NO_QUANT) else quant)


def get_draft(target: LoadedModel, draft_source: str) -> LoadedModel:
    """The draft for a target: the panel's draft, else the shipped one; refused unless tokenizers match."""
    draft = get_model(draft_spec(draft_source, target))
    check_compatible(target, draft)
    return draft


def describe(model: LoadedModel) -> str:
    cfg = model.model.config
    params = sum(p.numel() for p in model.model.parameters())
    element = next(model.model.parameters()).element_size()
    kv_per_token = 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * element
    quant = f", {model.spec.quant}" if model.spec.quant else ""
    halves = sorted({str(panels.data.dtype).removeprefix("torch.") for _, panels in model.model.packed_products()
                     if panels.data.itemsize == 2})
    panels = (f"; its weights are exactly {' and '.join(halves)} numbers, read as such (half the bytes, the same "
              "results)" if halves else "")
    return (f"**{model.name}**: {cfg.model_type}, {cfg.num_layers} layers, {params / 1e6:.0f}M parameters, "
            f"{model.spec.dtype}{quant} on {model.model.device}; KV {kv_per_token / 1024:.1f} KiB per token{panels}")


def load(source: str, draft_source: str, device: str, dtype: str, quant: str,
         progress: gr.Progress = gr.Progress()) -> str:
    """Load the target and its draft now (a run would load them too); a summary, or the error as a message."""
    try:
        spec = target_spec(source, device, dtype, quant)
        progress(0.1, desc=f"loading {spec.source!r} (a GGUF is converted once, then loads in under a second)")
        target = get_model(spec)
        lines = [f"Target: {describe(target)}"]
        if (draft_source or "").strip() or default_draft(target.spec.source):
            progress(0.6, desc="loading the draft and checking its tokenizer against the target's")
            draft = get_draft(target, draft_source)
            rows = proposal_rows(draft)
            vocab = ("" if rows is None else
                     f"; proposes from {len(rows):,} of its {draft.model.config.vocab_size:,} tokens")
            lines.append(f"Draft: {describe(draft)}{vocab}; tokenizer matches the target's")
        else:
            lines.append("No draft: speculative decoding needs one with the target's tokenizer.")
        if target.model.device.type == "cpu":
            lines.append(f"Float32 matrix products and attention on the CPU: native kernels {native.status()}.")
    except (ConfigError, ModelLoadError, ValueError) as exc:
        raise gr.Error(str(exc), duration=None) from exc
    return "\n\n".join(lines)


def build_panel() -> tuple[gr.Textbox, gr.Textbox, gr.Dropdown, gr.Dropdown, gr.Dropdown]:
    """The Model accordion; returns (model source, draft source, device, dtype, quantisation) for the tabs."""
    with gr.Accordion("Model", open=False):
        with gr.Row():
            source = gr.Textbox("embedded", label="Model: 'embedded' (SmolLM2-135M-Instruct), a hub id, "
                                "a local folder or a .gguf file", scale=3)
            draft = gr.Textbox("", label="Draft for speculative decoding (empty: the shipped draft of the "
                               "embedded model)", scale=3)
        with gr.Row():
            device = gr.Dropdown(list(DEVICES), value="auto", label="Device")
            dtype = gr.Dropdown(list(DTYPES), value="float32", label="dtype (greedy exactness holds in float32)")
            quant = gr.Dropdown([NO_QUANT, *QUANTS], value=NO_QUANT, label="Quantisation (bitsandbytes)")
            button = gr.Button("Load", scale=0, min_width=100)
        status = gr.Markdown(elem_id="pg-model-status")
    button.click(load, [source, draft, device, dtype, quant], [status], api_name="load_model")
    return source, draft, device, dtype, quant

