"""The model panel and the models behind it (`Catalog`): loaded once per spec and shared by every session (weights
are read-only), a few at a time; the Load button loads the target (and its draft) ahead of a run, with progress and
a summary. `Access` says which models a visitor may load (all, or in a public app an allow-list)."""

from __future__ import annotations

import os
import re
import threading
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

import gradio as gr

from ..config import DEVICES, DTYPES, QUANTS, ConfigError, ModelSpec
from ..decoding.speculative import check_compatible
from ..models import LoadedModel, ModelLoadError, load_model, native
from ..models.loader import HUB_ID, default_draft, draft_spec
from ..models.vocab import proposal_rows
from .stops import RUN_QUEUE

# How the products read the weights: ModelSpec.weights, or a bitsandbytes quantisation (which reads float32 first)
WEIGHT_CHOICES = [("auto: blocks, 8-bit activations", "auto"), ("GGUF blocks, 8-bit activations", "gguf-int8"),
                  ("GGUF blocks, float32 activations", "gguf"),
                  ("float32", "float32"), *((f"bitsandbytes {q}", q) for q in QUANTS)]
MAX_LOADED = 3  # models kept loaded at once; the least recently used goes first
MODELS_ENV = "PLAYGROUND_MODELS"  # public mode: hub ids the panel offers beside the embedded model (comma-separated)
EMBEDDED = "embedded"


@dataclass(frozen=True, slots=True)
class Access:
    """Which models the panel may load. Public (a public Space, or `python app.py --public`): only the embedded
    model and the `allowed` hub ids, never a local path, and messages that name no file of this machine; a visitor
    must not make the server download any model or read its files."""

    public: bool = False
    allowed: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        for source in self.allowed:
            if not HUB_ID.match(source) or "/" not in source:
                raise ConfigError(f"{MODELS_ENV}: {source!r} is not a hub id (org/name); a public app loads no "
                                  "local path")

    @classmethod
    def from_env(cls, public: bool) -> Access:
        """Public where asked or on a Space (SPACE_ID set); the allow-list from $PLAYGROUND_MODELS."""
        allowed = tuple(s.strip() for s in os.environ.get(MODELS_ENV, "").split(",") if s.strip())
        return cls(public=public or bool(os.environ.get("SPACE_ID")), allowed=allowed)

    @property
    def choices(self) -> tuple[str, ...]:
        return (EMBEDDED, *self.allowed)

    def check(self, source: str, name: str = "model") -> None:
        if self.public and source not in self.choices:
            raise ModelLoadError(f"{name}: this public app loads only {', '.join(self.choices)}; got {source[:80]!r}")


class Catalog:
    """The loaded models, shared by every session (weights are read-only): a model is loaded on first use, and past
    MAX_LOADED the least recently used is dropped (a run holding it keeps it until it ends)."""

    def __init__(self, access: Access = Access()) -> None:
        self.access = access
        self._loaded: OrderedDict[ModelSpec, LoadedModel] = OrderedDict()
        self._lock = threading.Lock()

    def get(self, spec: ModelSpec) -> LoadedModel:
        with self._lock:
            if spec in self._loaded:
                self._loaded.move_to_end(spec)
                return self._loaded[spec]
            try:
                model = load_model(spec)
            except ModelLoadError as exc:
                if self.access.public:  # no path of this machine in a public message
                    raise ModelLoadError(PATH.sub("<path>", str(exc))) from None
                raise
            self._loaded[spec] = model
            while len(self._loaded) > MAX_LOADED:
                self._loaded.popitem(last=False)
            return model


PATH = re.compile(r"(?<![\w.])/[^\s'\"]+")  # an absolute path in a message
catalog = Catalog()  # the app's; `playground.ui.build_app` sets its access


def get_model(spec: ModelSpec) -> LoadedModel:
    """The loaded model for a spec the app's access allows; the first call loads (converting a GGUF once), later
    calls are free."""
    catalog.access.check(spec.source)
    return catalog.get(spec)


def target_spec(source: str, device: str, dtype: str = "float32", weights: str = "auto") -> ModelSpec:
    """The panel's target as a spec (every field validated by ModelSpec, with its name in the message); `weights`
    one of ModelSpec.weights or a bitsandbytes quantisation."""
    quant = weights if weights in QUANTS else None
    return ModelSpec(source=(source or "").strip() or "embedded", device=device, dtype=dtype, quant=quant,
                     weights="float32" if quant else weights)


def get_draft(target: LoadedModel, draft_source: str) -> LoadedModel:
    """The draft for a target: the panel's draft, else the shipped one; refused unless tokenizers match."""
    if (draft_source or "").strip():
        catalog.access.check(draft_source.strip(), "draft")
    draft = catalog.get(draft_spec(draft_source, target))
    check_compatible(target, draft)
    return draft


def describe(model: LoadedModel) -> str:
    cfg = model.model.config
    params = sum(p.numel() for p in model.model.parameters())
    element = next(model.model.parameters()).element_size()
    kv_per_token = 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * element
    quant = f", {model.spec.quant}" if model.spec.quant else ""
    reads = (f"; its products read {model.model.formats_read()}" if model.model.device.type == "cpu"
             and not model.spec.quant else "")
    return (f"**{model.name}**: {cfg.model_type}, {cfg.num_layers} layers, {params / 1e6:.0f}M parameters, "
            f"{model.spec.dtype}{quant} on {model.model.device}; KV {kv_per_token / 1024:.1f} KiB per token{reads}")


def load(source: str, draft_source: str, device: str, dtype: str, weights: str):
    """Load the target and its draft now (a run would load them too); yields what it is doing, then a summary (or
    the error as a message)."""
    try:
        spec = target_spec(source, device, dtype, weights)
        yield (f"Loading {spec.source!r}: a GGUF file is converted once (about 30 s on a laptop CPU), then loads in "
               "under a second...")
        target = get_model(spec)
        lines = [f"Target: {describe(target)}"]
        if (draft_source or "").strip() or default_draft(target.spec.source):
            yield f"Target: {describe(target)}\n\nLoading the draft and checking its tokenizer against the target's..."
            draft = get_draft(target, draft_source)
            rows = proposal_rows(draft)
            vocab = ("" if rows is None else
                     f"; proposes from {len(rows):,} of its {draft.model.config.vocab_size:,} tokens")
            lines.append(f"Draft: {describe(draft)}{vocab}; tokenizer matches the target's")
        else:
            lines.append("No draft: speculative decoding needs one with the target's tokenizer.")
        if target.model.device.type == "cpu":
            lines.append(f"Matrix products and attention on the CPU: native kernels {native.status()}.")
    except (ConfigError, ModelLoadError, ValueError) as exc:
        raise gr.Error(str(exc), duration=None) from exc
    yield "\n\n".join(lines)


def build_panel(access: Access, on_gpu: Callable[[Callable], Callable]
                ) -> tuple[gr.Component, gr.Component, gr.Dropdown, gr.Dropdown, gr.Dropdown]:
    """The Model accordion; returns (model source, draft source, device, dtype, weights) for the tabs. A public
    app offers its allowed models to choose from instead of a free text field. on_gpu wraps the loading handler."""
    with gr.Accordion("Model", open=False):
        with gr.Row():
            source: gr.Dropdown | gr.Textbox
            draft: gr.Dropdown | gr.Textbox
            if access.public:
                source = gr.Dropdown(list(access.choices), value=EMBEDDED, label="Model ('embedded': "
                                     "SmolLM2-135M-Instruct)", scale=3)
                draft = gr.Dropdown([("the shipped draft of the embedded model", ""), *access.allowed], value="",
                                    label="Draft for speculative decoding", scale=3)
            else:
                source = gr.Textbox(EMBEDDED, label="Model: 'embedded' (SmolLM2-135M-Instruct), a hub id, "
                                    "a local folder or a .gguf file", scale=3)
                draft = gr.Textbox("", label="Draft for speculative decoding (empty: the shipped draft of the "
                                   "embedded model)", scale=3)
        with gr.Row():
            device = gr.Dropdown(list(DEVICES), value="auto", label="Device")
            dtype = gr.Dropdown(list(DTYPES), value="float32", label="dtype (greedy exactness holds in float32)")
            weights = gr.Dropdown(WEIGHT_CHOICES, value="auto", label="Weights the products read (GGUF blocks: a "
                                  "fifth of float32's bytes; 8-bit activations: integer products)")
            button = gr.Button("Load", scale=0, min_width=100)
        status = gr.Markdown(elem_id="pg-model-status")
    button.click(on_gpu(load), [source, draft, device, dtype, weights], [status], api_name="load_model",
                 show_progress="minimal", concurrency_id=RUN_QUEUE)
    return source, draft, device, dtype, weights
