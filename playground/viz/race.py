"""The race view: several runs of the same prompt replayed in sync on their own measured engine clocks, one
lane each (name, progress bar, tokens coloured by decision). Runs are measured one after another and only
replayed together, so they never compete for the processor. A remote lane (`RemoteLane`: an OpenAI-compatible
endpoint's stream) replays its text at the wall-clock times its chunks arrived, uncoloured: it has no steps."""

from __future__ import annotations

import html
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from ..trace import CommitEvent, Event, FinishEvent
from .tokens import render_tokens

if TYPE_CHECKING:
    from ..remote import RemoteRun


@dataclass(frozen=True, slots=True)
class Lane:
    name: str
    events: Sequence[Event]
    why: str = ""  # where its time went, shown once the lane has finished

    @property
    def wall_s(self) -> float:
        return next((e.wall_s for e in reversed(self.events) if isinstance(e, FinishEvent)), self.events[-1].t)

    @property
    def total_tokens(self) -> int:
        return sum(e.num_tokens for e in self.events if isinstance(e, CommitEvent))

    def at(self, t: float | None) -> tuple[str, float, str]:
        """(tokens so far, as the head shows them; the share done; the tokens' HTML) at engine time t (None: the
        end)."""
        seen = list(self.events) if t is None else events_until(self.events, t)
        tokens = sum(e.num_tokens for e in seen if isinstance(e, CommitEvent))
        return str(tokens), tokens / self.total_tokens if self.total_tokens else 1.0, render_tokens(seen)


@dataclass(frozen=True, slots=True)
class RemoteLane:
    """A remote endpoint's run (`remote.RemoteRun`): its text appears chunk by chunk at the wall-clock seconds each
    arrived. Its token count is the server's; within the run it is spread over the chunks in proportion (marked ~
    where chunks and tokens differ in number)."""

    name: str
    run: RemoteRun
    why: str = ""

    @property
    def wall_s(self) -> float:
        return self.run.wall_s

    @property
    def total_tokens(self) -> int:
        return self.run.tokens

    def series(self) -> tuple[list[float], list[float]]:
        """(seconds, tokens so far) at each chunk, the count spread over the chunks, ending at the stream's end."""
        chunks = len(self.run.chunk_s)
        times = [0.0, *self.run.chunk_s, self.run.wall_s]
        return times, [0.0, *(self.run.tokens * (i + 1) / chunks for i in range(chunks)), float(self.run.tokens)]

    def at(self, t: float | None) -> tuple[str, float, str]:
        chunks = len(self.run.chunk_s)
        seen = chunks if t is None else sum(arrived <= t for arrived in self.run.chunk_s)
        share = seen / chunks if chunks else 1.0
        exact = chunks == self.run.tokens or seen == chunks
        text = html.escape("".join(self.run.pieces[:seen]))
        return (f"{'' if exact else '~'}{round(self.run.tokens * share)}", share,
                f'<div class="pg-tokens"><span class="pg-remote">{text}</span></div>')


def events_until(events: Sequence[Event], t: float) -> list[Event]:
    """The events a run had emitted by engine time t (events are in time order)."""
    return [e for e in events if e.t <= t]


def race_css() -> str:
    """Lane styles; colours come from the Gradio theme's variables when there is one (fallbacks for notebooks)."""
    border, fill = "var(--border-color-primary,#d0d7de)", "var(--background-fill-secondary,#f6f8fa)"
    return (".pg-race{display:grid;grid-template-columns:1fr;gap:0.6rem;}"
            f".pg-lane{{border:1px solid {border};border-radius:8px;padding:0.4rem 0.6rem;background:{fill};}}"
            ".pg-lane-done{border-color:#009E73;}"
            ".pg-lane-head{display:flex;justify-content:space-between;gap:0.5rem;font-size:0.9rem;}"
            ".pg-lane-head span{font-variant-numeric:tabular-nums;color:var(--body-text-color-subdued,#57606a);}"
            f".pg-bar{{height:4px;background:{border};border-radius:2px;margin:0.3rem 0;}}"
            ".pg-bar>div{height:100%;background:#009E73;border-radius:2px;}"
            ".pg-lane-why{font-size:0.8rem;color:var(--body-text-color-subdued,#57606a);margin-bottom:0.2rem;}"
            ".pg-remote{white-space:pre-wrap;}"
            # column-reverse keeps the newest tokens in view as a lane outgrows its box; text sits at the bottom,
            # so the top fade only touches a lane whose text has reached the top: the cue that it scrolls
            ".pg-lane-tokens{height:6.5rem;overflow-y:auto;display:flex;flex-direction:column-reverse;"
            "-webkit-mask-image:linear-gradient(to bottom,transparent 0,#000 1.2rem);"
            "mask-image:linear-gradient(to bottom,transparent 0,#000 1.2rem);}")


def render_race(lanes: Sequence[Lane | RemoteLane], t: float | None = None) -> str:
    """Every lane as it stood at time t (the end when None); a finished lane shows its final time."""
    parts = [f'<style>{race_css()}</style><div class="pg-race">']
    for lane in lanes:
        done = t is None or t >= lane.wall_s
        tokens, share, shown = lane.at(None if done else t)
        clock = f"done in {lane.wall_s:.2f} s" if done else f"{t:.2f} s"
        parts.append(
            f'<div class="pg-lane{" pg-lane-done" if done else ""}">'
            f'<div class="pg-lane-head"><b>{html.escape(lane.name)}</b>'
            f'<span>{tokens} tokens · {clock}</span></div>'
            f'<div class="pg-bar"><div style="width:{100 * share:.1f}%"></div></div>'
            + (f'<div class="pg-lane-why">{html.escape(lane.why)}</div>' if done and lane.why else "")
            + f'<div class="pg-lane-tokens">{shown}</div></div>')
    parts.append("</div>")
    return "".join(parts)
