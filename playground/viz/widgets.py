"""Notebook display: a step-through player over any of the web app's renderers, and figures that survive export.

A widget needs a live kernel, and a saved notebook keeps no widget state, so every output here also carries static
HTML: the player its final frame, plotly figures their own HTML with plotly.js inline. nbconvert's HTML, GitHub's
viewer and a reopened notebook then show the figures, offline.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import ipywidgets as widgets


def offline_figures() -> None:
    """Show plotly figures both as plotly's JSON (live, in Jupyter) and as HTML with plotly.js inline (exports)."""
    import plotly.io as pio

    pio.renderers.default = "plotly_mimetype+notebook"


class Player(widgets.VBox):
    """step_player's widget; its output also holds the frame it opened on as static HTML, which anything that
    cannot run the widget shows instead of 'VBox(children=...)'."""

    def _repr_mimebundle_(self, **kwargs: Any) -> dict[str, Any]:
        bundle = dict(super()._repr_mimebundle_(**kwargs) or {})
        bundle["text/html"] = self.children[1].value
        bundle["text/plain"] = "(a step player: run the cell to step through; a page shows the frame it opened on)"
        return bundle


def step_player(render: Callable[[int], str], first: int, last: int, label: str = "step",
                interval_ms: int = 700) -> Player:
    """A Play button linked to a slider over [first, last]; every change re-renders `render(value)`. The player
    opens on the last value, the finished run, and replays from the first."""
    if last < first:
        raise ValueError(f"last must be >= first ({first}), got {last}")
    play = widgets.Play(value=last, min=first, max=last, step=1, interval=interval_ms,
                        description=f"play {label}s")
    slider = widgets.IntSlider(value=last, min=first, max=last, step=1, description=label,
                               continuous_update=True, layout=widgets.Layout(width="24rem"))
    # Linked in the browser: playing moves the slider without a kernel round trip per frame.
    widgets.jslink((play, "value"), (slider, "value"))
    view = widgets.HTML(render(last))

    def show(change: dict) -> None:
        view.value = render(change["new"])

    slider.observe(show, names="value")
    return Player([widgets.HBox([play, slider]), view])


def check(name: str, answer: float | None, expected: float, rel: float = 0.02) -> None:
    """Print an exercise's numeric answer against the value the notebook computed: ✓ within `rel`, else which way it
    is off (the value itself stays hidden, in the solution below the exercises); None: not answered yet."""
    if answer is None:
        print(f"· {name}: not answered yet (set it above and rerun the cell)")
    elif abs(answer - expected) <= rel * abs(expected):
        print(f"✓ {name}: {answer:,}")
    else:
        print(f"✗ {name}: {answer:,} is too {'high' if answer > expected else 'low'}; the solution below shows the way")
