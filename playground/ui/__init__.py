"""The Gradio web app: `build_app()` assembles the tabs (one module each) and `launch_options()` the theme and
stylesheet that `Blocks.launch` takes in Gradio 6."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import gradio as gr

from ..trace import MAX_TRACE_BYTES
from ..viz import token_css
from . import decode, memory, models, quota, race, theory

STYLESHEET = Path(__file__).resolve().parent.parent.parent / "assets" / "style.css"
GLOSSARY = Path(__file__).resolve().parent.parent.parent / "docs" / "glossary.md"  # shown in the app, as written
CONCURRENCY = 1  # runs share the CPU; one at a time keeps every measured speed honest
CACHE_CLEANUP_S = 3600


def build_app(on_gpu: Callable[[Callable], Callable] | None = None, public: bool = False) -> gr.Blocks:
    """The app. on_gpu wraps the handlers that run models (a Space passes `spaces.GPU`); public (also on whenever
    SPACE_ID is set, as on a Space) limits the model panel to the embedded model and $PLAYGROUND_MODELS and each
    visitor to `quota.TOKENS_PER_HOUR` generated tokens an hour."""
    models.catalog.access = models.Access.from_env(public)
    quota.QUOTA.limit = quota.TOKENS_PER_HOUR if models.catalog.access.public else None
    # uploads and exported traces are temporary files: each is deleted an hour after it was made
    with gr.Blocks(title="Decoding playground", delete_cache=(CACHE_CLEANUP_S, CACHE_CLEANUP_S)) as app:
        gr.Markdown("# Decoding playground\nA model adds one token per forward. Speculative decoding *drafts* a few "
                    "tokens cheaply, then the model *verifies* them all in one forward and keeps those it agrees "
                    "with, so one forward can add several tokens. Watch each algorithm draft, accept and reject, "
                    "and what it buys in speed. Speeds are engine time only; drawing the page is never counted.")
        with gr.Accordion("The words used here", open=False):
            gr.Markdown(GLOSSARY.read_text(encoding="utf-8").split("\n", 1)[1])
        # (source, draft, device, dtype, weights), inputs of every run
        wrap = on_gpu or (lambda fn: fn)
        model = models.build_panel(models.catalog.access, wrap)
        history = gr.State([])  # this browser session's runs, for the Theory tab's measured points
        with gr.Tab("Decode"):
            decode.build_tab(model, wrap, history)
        with gr.Tab("Race"):
            race.build_tab(model, wrap, history)
        with gr.Tab("Memory"):
            memory.build_tab(model, wrap)
        with gr.Tab("Theory"):
            theory.build_tab(app, history, model, wrap)
    app.queue(default_concurrency_limit=CONCURRENCY)
    return app


def launch_options() -> dict[str, Any]:
    """Theme and stylesheet: the layout rules from assets/style.css, the decision colours from viz.palette."""
    # fonts Gradio serves itself: nothing is fetched from elsewhere, so the app looks the same offline
    theme = gr.themes.Soft(primary_hue="teal", neutral_hue="slate",
                           font=[gr.themes.LocalFont("IBMPlexSans"), "system-ui", "sans-serif"],
                           font_mono=[gr.themes.LocalFont("IBMPlexMono"), "ui-monospace", "monospace"])
    return {"theme": theme, "css": STYLESHEET.read_text(encoding="utf-8") + token_css(),
            "max_file_size": MAX_TRACE_BYTES}  # the only uploads are traces
