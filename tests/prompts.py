"""Varied prompts for exactness tests: chat, code, maths, lists, translation, grounded QA, rewriting."""

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
)
