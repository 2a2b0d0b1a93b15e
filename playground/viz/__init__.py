"""Renderers shared by the web app and the notebooks: token HTML with one colour per decision, legends."""

from .palette import SOURCE_HIGHLIGHT, STATES, token_css
from .tokens import TokenView, hover_text, render_legend, render_prompt, render_tokens, token_views

__all__ = ["SOURCE_HIGHLIGHT", "STATES", "TokenView", "hover_text", "render_legend", "render_prompt",
           "render_tokens", "token_css", "token_views"]
