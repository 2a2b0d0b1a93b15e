"""Step-through widgets for the notebooks: play/pause and a slider over any of the web app's renderers.

The renderer receives the selected step (or time index) and returns HTML; the player opens on the last value, the
finished run, and replays from the first. Widgets need a live kernel: outputs are never committed.
"""

from __future__ import annotations

from collections.abc import Callable

import ipywidgets as widgets


def step_player(render: Callable[[int], str], first: int, last: int, label: str = "step",
                interval_ms: int = 700) -> widgets.VBox:
    """A Play button linked to a slider over [first, last]; every change re-renders `render(value)`."""
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
    return widgets.VBox([widgets.HBox([play, slider]), view])
