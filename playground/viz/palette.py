"""One colour and one non-colour cue per decision, used by every renderer (web app, notebooks, legends).

Colours are from the Okabe-Ito palette, which stays distinguishable under the common colour-vision deficiencies;
each state also carries a cue that survives without colour (border, strike-through, underline, overline).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class State:
    name: str
    label: str
    colour: str  # text/decoration colour
    background: str  # a light tint of the colour, so the token text stays readable
    cue: str  # CSS declarations of the non-colour cue
    meaning: str  # the legend's explanation


STATES: dict[str, State] = {s.name: s for s in (
    State("generated", "generated", "#1f2328", "transparent", "",
          "a token from a plain target forward (nothing was proposed for it)"),
    State("pending", "drafted", "#6e6e6e", "#ececec", "outline: 1px dashed #6e6e6e;",
          "proposed, waiting for the target's verdict"),
    State("accepted", "accepted", "#007a5a", "#d5f2e8", "border-bottom: 2px solid #009E73;",
          "proposed and accepted by the target"),
    State("rejected", "rejected", "#b34700", "#fbe0cf", "text-decoration: line-through 2px;",
          "proposed and rejected by the target"),
    State("discarded", "not judged", "#6e6e6e", "#f4f4f4", "text-decoration: line-through 1px dotted;",
          "proposed after a rejected token, so never judged"),
    State("corrected", "corrected", "#8a5a00", "#fcefd2", "border-bottom: 3px double #E69F00;",
          "drawn by the target in place of a rejected token (residual distribution)"),
    State("bonus", "bonus", "#005a8c", "#d6e9f6", "border-top: 2px solid #0072B2;",
          "the target's extra token after every proposal was accepted"),
)}

SOURCE_HIGHLIGHT = "#F0E442"  # prompt-lookup: the span of earlier text a proposal was copied from


def token_css() -> str:
    """The stylesheet of the token renderers: one class per state, plus the prompt-lookup source span."""
    rules = [".pg-tokens{font-family:ui-monospace,SFMono-Regular,Menlo,Consolas,monospace;font-size:0.95rem;"
             "line-height:1.9;white-space:pre-wrap;word-break:break-word;}",
             ".pg-tok{padding:1px 1px;border-radius:3px;}",
             ".pg-prompt{color:#57606a;}",
             f".pg-source{{background:{SOURCE_HIGHLIGHT};color:#1f2328;outline:1px solid #b8a800;}}",
             # a tree being verified: a block at the text's end, one branch a line (`tokens.render_branches`)
             ".pg-branches{display:inline-block;vertical-align:top;white-space:pre;line-height:1.5;}",
             ".pg-branch{display:block;}.pg-branch:first-child{line-height:1.9;}.pg-blank{visibility:hidden;}",
             ".pg-more{color:#6e6e6e;font-size:0.8rem;font-family:system-ui,sans-serif;}",
             ".pg-legend{display:flex;flex-wrap:wrap;gap:0.4rem 1rem;font-size:0.85rem;margin:0.3rem 0;}"]
    for state in STATES.values():
        rules.append(f".pg-{state.name}{{color:{state.colour};background:{state.background};{state.cue}}}")
    return "".join(rules)
