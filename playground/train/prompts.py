"""Prompts for distillation, written for this project: task templates crossed with topics, then a second stage
built on the target's own answers to those.

The first stage asks open questions. The second turns some of its answers into the source text of input-grounded
tasks (summarise, answer from, rewrite, translate, edit code: answers that copy from a long prompt) and adds
arithmetic word problems with seeded numbers; a draft or heads trained on the first stage alone learn neither the
copying nor positions far beyond a short prompt. Training and held-out prompts use disjoint topics, so the
held-out acceptance measures generalisation; the benchmark suite's passages and problems appear in neither.
"""

from __future__ import annotations

import json
import random
import re
from pathlib import Path

# The task templates and topics (data, in prompts.json beside this module)
TABLES = json.loads((Path(__file__).with_name("prompts.json")).read_text(encoding="utf-8"))
TEMPLATES: tuple[str, ...] = tuple(TABLES["templates"])
TRAIN_TOPICS: tuple[str, ...] = tuple(TABLES["train_topics"])

# More task types, for the draft: a seeded sample of these per topic (`--extra-templates`) widens what it sees
# beyond the held-out report's templates, towards the benchmark's mix of chat, code, rewriting and translation.
EXTRA_TEMPLATES: tuple[str, ...] = tuple(TABLES["extra_templates"])

HELD_OUT_TOPICS: tuple[str, ...] = tuple(TABLES["held_out_topics"])

# More subjects, for the draft (`--wide-topics`): a draft trained on the topics above alone agreed with the target on
# 92-98% of its training answers but on 48% of the held-out topics' answers. None is a held-out topic or a near
# neighbour of one (ice, jazz, cephalopods, searching, trade routes, wind power), and no prompt built on them is a
# benchmark prompt; "habits" and "time management" do touch the suite's chat question on study habits.
WIDE_TOPICS: tuple[str, ...] = tuple(TABLES["wide_topics"])


def training_prompts(extra_templates: int = 0, seed: int = 0, wide_topics: int = 0,
                     templates_per_wide_topic: int = 0) -> list[str]:
    """Every template for every training topic; then `extra_templates` of EXTRA_TEMPLATES per topic; then, for each
    of the first `wide_topics` of WIDE_TOPICS, `templates_per_wide_topic` of all the templates. Samples are drawn
    without replacement by one generator seeded with `seed` (the same prompts for the same arguments; a run
    without wide topics gets the prompts it got before they existed)."""
    prompts = [t.format(topic=topic) for topic in TRAIN_TOPICS for t in TEMPLATES]
    rng = random.Random(seed)
    for topic in TRAIN_TOPICS:
        prompts += [t.format(topic=topic) for t in rng.sample(EXTRA_TEMPLATES, extra_templates)]
    for topic in WIDE_TOPICS[:wide_topics]:
        prompts += [t.format(topic=topic) for t in rng.sample(TEMPLATES + EXTRA_TEMPLATES, templates_per_wide_topic)]
    return prompts


def held_out_prompts() -> list[str]:
    return [t.format(topic=topic) for topic in HELD_OUT_TOPICS for t in TEMPLATES[:12:3]]


# Every GROUNDED_EVERY-th first-stage answer (offset 1) becomes a grounded prompt, every MATHS_EVERY-th prompt index
# (offset 3) adds a word problem: about a quarter more prompts, whose answers run at longer positions.
GROUNDED_EVERY, MATHS_EVERY = 4, 20

# second-stage tasks: on a passage ({text}) or its first sentence ({sentence}), and on code
PASSAGE_TEMPLATES: tuple[str, ...] = tuple(TABLES["passage_templates"])
CODE_TEMPLATES: tuple[str, ...] = tuple(TABLES["code_templates"])


SENTENCE_END = re.compile(r"[.!?](?=\s|$)")  # a full stop, ! or ? before whitespace or the end: not "3.14"


def _passage(answer: str) -> str:
    """An answer cut after its last complete sentence (answers stop at a token budget, often mid-sentence)."""
    text = answer.strip()
    ends = [m.end() for m in SENTENCE_END.finditer(text)]
    return text[: ends[-1]] if ends else text


def _first_sentence(text: str) -> str:
    match = SENTENCE_END.search(text)
    return text[: match.end()] if match else text


def grounded_prompt(index: int, prompt: str, answer: str) -> str | None:
    """The second-stage prompt built on first-stage answer `index` (None when it gets none): see `grounded_task`."""
    return grounded_task(index // GROUNDED_EVERY, prompt, answer) if index % GROUNDED_EVERY == 1 else None


def grounded_task(turn: int, prompt: str, answer: str) -> str | None:
    """A task on an answer's text (None when too short): code answers get a code-editing task, others a passage
    task, each list taken in turn by `turn`."""
    text = _passage(answer)
    if len(text) < 40:
        return None
    if "```" in answer or "Python function" in prompt:
        return CODE_TEMPLATES[turn % len(CODE_TEMPLATES)].format(text=text)
    template = PASSAGE_TEMPLATES[turn % len(PASSAGE_TEMPLATES)]
    return template.format(text=text, sentence=_first_sentence(text).replace("\n", " "))


def maths_prompt(index: int) -> str | None:
    """An arithmetic word problem for prompt index `index` (None for most indices), numbers seeded by the index."""
    if index % MATHS_EVERY != 3:
        return None
    return word_problem(index, index // MATHS_EVERY)


def word_problem(seed: int, kind: int) -> str:
    """Word problem type `kind` (any integer: taken modulo the types) with its numbers seeded by `seed`."""
    rng = random.Random(seed)
    a, b, n = rng.randint(2, 12), rng.randint(2, 40), rng.randint(2, 15)
    item = rng.choice(("notebook", "apple", "ticket", "candle", "stamp", "marble"))
    name = rng.choice(("Maria", "Tom", "Aisha", "Kenji", "Lucas", "Priya"))
    problems = (
        f"Solve for y: {a}y - {b} = {a * n - b}. Show each step.",
        f"One {item} costs {b} cents. How much do {n} of them cost? Explain step by step.",
        f"{name} has {a * n + b} {item}s and shares them equally among {n} friends. How many does each friend get, "
        f"and how many are left over? Explain.",
        f"A cyclist rides {a * n} km in {n} hours. What is the average speed? Explain step by step.",
        f"What is {b}% of {a * 50}? Show your working.",
        f"A rectangle is {a} m wide and {b} m long. What are its area and its perimeter? Show each step.",
    )
    return problems[kind % len(problems)]


def second_stage_prompts(prompts: list[str], answers: list[str]) -> list[str]:
    """The second-stage prompts for first-stage `prompts` and the target's `answers` to them, in order."""
    made = []
    for i, (prompt, answer) in enumerate(zip(prompts, answers)):
        made += [p for p in (grounded_prompt(i, prompt, answer), maths_prompt(i)) if p is not None]
    return made
