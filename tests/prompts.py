"""Varied prompts for exactness tests: chat, code, maths, lists, translation, grounded QA, rewriting."""

from playground.config import GenerationParams
from playground.engine import generate
from playground.metrics import compute

NEW_TOKENS = 24  # generated per prompt in exactness tests

PROMPTS = (
    "What is the capital of France, and what is it famous for?",
    "Write a Python function that checks whether a string is a palindrome.",
    "Explain in two sentences why the sky is blue.",
    "List five fruits that are rich in vitamin C.",
    "Translate into German: 'I would like a cup of coffee, please.'",
    "What is 17 multiplied by 23? Show your working.",
    "Summarise: The meeting moved to Thursday because the projector broke and the room was double-booked.",
    "Rewrite more politely: 'Give me the file now.'",
    "Write a haiku about autumn leaves.",
    "The library opens at nine and closes at five. When does it close? Answer briefly.",
    "Give three tips for writing clear emails.",
    "What does the acronym CPU stand for and what does a CPU do?",
    "Write a SQL query that counts orders per customer in a table called orders.",
    "Describe the water cycle for a ten-year-old.",
    "Convert 3.5 kilometres to metres and explain how.",
    "Write a limerick about a cat who loves boxes.",
    "Repeat this list in reverse order: apple, banana, cherry, date.",
    "Explain what a linked list is and one advantage it has over an array.",
    "Give a one-paragraph history of the bicycle.",
    "Fix the grammar: 'Me and him goes to the shop yesterday.'",
)


def assert_greedy_exact(target, proposer, plain_outputs: dict[str, tuple[int, ...]],
                        generation: GenerationParams | None = None) -> tuple[int, int]:
    """Every prompt gives plain decoding's tokens with `proposer`; returns (accepted, drafted) proposals over all
    prompts."""
    assert len(PROMPTS) >= 20
    accepted = drafted = 0
    for prompt in PROMPTS:
        output, trace = generate(target, prompt, proposer, None, generation or GenerationParams(
            max_new_tokens=NEW_TOKENS))
        assert output.token_ids == plain_outputs[prompt], prompt
        metrics = compute(trace)
        accepted += metrics.accepted or 0
        drafted += metrics.drafted or 0
    return accepted, drafted
