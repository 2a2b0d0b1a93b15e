"""The benchmark's prompt suite, written for this project: one list of (category, prompt) pairs.

Input-grounded categories (summarisation, question answering over a passage, rewriting, code editing) carry
their source text inside the prompt, which is where prompt-lookup decoding should shine.
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Sequence
from pathlib import Path

from ..config import ConfigError, GenerationParams

PASSAGE_TIDES = (
    "Tides are the regular rise and fall of the sea surface. They are caused mainly by the Moon's gravity, which "
    "pulls the ocean on the side of the Earth facing the Moon slightly more than the Earth itself, and pulls the "
    "Earth slightly more than the ocean on the far side. The result is two bulges of water, so most coasts see "
    "two high tides and two low tides a day. The Sun adds a smaller effect: when Sun and Moon line up, at new and "
    "full moon, the tides are larger and are called spring tides; when they are at right angles, the tides are "
    "smaller and are called neap tides."
)

PASSAGE_LIBRARY = (
    "The town library opens at nine on weekdays and at ten on Saturdays; it is closed on Sundays. Members may "
    "borrow up to six books at a time for three weeks, and may renew a loan twice online if nobody else has "
    "reserved the book. Late returns cost twenty cents per book per day, up to a maximum of five dollars. "
    "Children under twelve pay no late fees. The reading room on the first floor has twenty desks with power "
    "sockets, and the study rooms on the second floor can be booked for two hours at a time."
)

CODE_SNIPPET = (
    "def average(values):\n"
    "    total = 0\n"
    "    for v in values:\n"
    "        total = total + v\n"
    "    return total / len(values)\n"
)

GROUNDED = ("summarisation", "qa", "code editing", "rewriting")  # categories whose prompts carry the text to reuse

SUITE: tuple[tuple[str, str], ...] = (
    ("chat", "What are three good habits for staying focused while studying?"),
    ("chat", "Suggest a short plan for a relaxing Sunday afternoon at home."),
    ("code", "Write a Python function that returns the n-th Fibonacci number using a loop."),
    ("code editing", "Add type hints and a docstring to this function, and make it return 0.0 for an empty list:\n\n"
             + CODE_SNIPPET),
    ("summarisation", "Summarise the following text in three sentences.\n\n" + PASSAGE_TIDES),
    ("summarisation", "Summarise the library rules below as a bulleted list.\n\n" + PASSAGE_LIBRARY),
    ("qa", PASSAGE_LIBRARY + "\n\nUsing only the text above: how many books can a member borrow, for how long, "
           "and what does a late return cost?"),
    ("qa", PASSAGE_TIDES + "\n\nUsing only the text above: what are spring tides and when do they happen?"),
    ("maths", "A shop sells pencils at 3 for 45 cents. How much do 12 pencils cost? Explain step by step."),
    ("maths", "Solve for x: 3x + 7 = 25. Show each step."),
    ("translation", "Translate into French: 'The weather is lovely today, so we will have lunch in the garden.'"),
    ("translation", "Translate into Spanish: 'Where is the train station? I need to buy a ticket to the city.'"),
    ("rewriting", "Rewrite this sentence to be more formal: 'Hey, can you send me the report by tomorrow? Thanks!'"),
    ("rewriting", "Rewrite the following paragraph in simpler words for a ten-year-old.\n\n" + PASSAGE_TIDES),
)


def spread(count: int, suite: Sequence[tuple[str, str]] = SUITE) -> list[int]:
    """The indices of `count` prompts of a suite spread over its categories, in suite order: the first prompt of
    every category, then the second of every category, and so on, until `count` are taken. Why: a short run
    (`--limit`) should sample every kind of task; the built-in suite's first 7 prompts hold no maths, translation or
    rewriting, and on them Medusa with copies replays 1.87 tokens per forward against 2.47 over all 14."""
    if not 1 <= count <= len(suite):
        raise ValueError(f"count must be in 1..{len(suite)}, got {count}")
    seen: Counter[str] = Counter()
    rank = []  # (how many of its category come before it, suite index) per prompt
    for index, (category, _) in enumerate(suite):
        rank.append((seen[category], index))
        seen[category] += 1
    return sorted(index for _, index in sorted(rank)[:count])


def per_category(suite: Sequence[tuple[str, str]], count: int) -> list[int]:
    """The indices of the first `count` prompts of each category, in suite order."""
    seen: Counter[str] = Counter()
    kept = []
    for index, (category, _) in enumerate(suite):
        if seen[category] < count:
            kept.append(index)
        seen[category] += 1
    return kept


def read_prompts_file(path: str) -> tuple[tuple[str, str], ...]:
    """(category, prompt) per row of a JSONL file: `{"prompt": ..., "category": ...}` (category optional: "file"), or
    a row of Spec-Bench's `question.jsonl` (`{"question_id", "category", "turns": [...]}`: its first turn). A bad row
    is one message naming its line."""
    file = Path(path).expanduser()
    if not file.is_file():
        raise ConfigError(f"prompts: no such file {path!r} (a JSONL file of prompts, or Spec-Bench's question.jsonl)")
    suite = []
    for number, line in enumerate(file.read_text(encoding="utf-8", errors="replace").splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except ValueError:
            raise ConfigError(f"prompts: line {number} is not JSON") from None
        turns = row.get("turns") if isinstance(row, dict) else None
        prompt = row.get("prompt") if isinstance(row, dict) else None
        if isinstance(turns, list) and turns and isinstance(turns[0], str):
            prompt = turns[0]
        if not isinstance(prompt, str) or not prompt.strip():
            raise ConfigError(f"prompts: line {number} must hold a \"prompt\" string or Spec-Bench's \"turns\" list")
        category = row.get("category", "file")
        suite.append((category if isinstance(category, str) and category else "file", prompt))
    if not suite:
        raise ConfigError(f"prompts: {path!r} holds no prompts")
    return tuple(suite)


LENGTH_EIGHTHS = (8, 2, 4, 6, 1, 8, 3, 5)  # output limits in eighths of --max-new-tokens, cycled


def workload(num_requests: int, max_new_tokens: int) -> list[tuple[str, GenerationParams]]:
    """A serving workload: the suite's prompts in turn, with output limits of mixed lengths up to max_new_tokens."""
    return [(SUITE[i % len(SUITE)][1],
             GenerationParams(max_new_tokens=max(1, max_new_tokens * LENGTH_EIGHTHS[i % len(LENGTH_EIGHTHS)] // 8)))
            for i in range(num_requests)]
