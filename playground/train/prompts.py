"""Prompts for distillation, written for this project: task templates crossed with topics.

Training and held-out prompts use disjoint topics, so the held-out acceptance measures generalisation.
"""

from __future__ import annotations

TEMPLATES = (
    "Explain {topic} in simple terms.",
    "Write a short paragraph about {topic}.",
    "Give three interesting facts about {topic}.",
    "What are the advantages and disadvantages of {topic}?",
    "Write a short story that involves {topic}.",
    "Summarise what a beginner should know about {topic}.",
    "List five questions a student might ask about {topic}, with short answers.",
    "Write a haiku about {topic}.",
    "How would you explain {topic} to a ten-year-old?",
    "Write a Python function related to {topic}, with a docstring.",
    "Compare {topic} with something similar and explain the difference.",
    "Give step-by-step instructions for getting started with {topic}.",
    "What is the history of {topic}?",
    "Describe {topic} in one sentence, then in one paragraph.",
    "Why do people care about {topic}?",
    "Write a short poem about {topic}.",
    "What are common misconceptions about {topic}?",
    "Write an email to a friend recommending they learn about {topic}.",
    "What careers are connected to {topic}?",
    "Write a dialogue between a teacher and a student about {topic}.",
    "What does the future of {topic} look like?",
    "Create a quiz with three multiple-choice questions about {topic}.",
    "Give me a fun fact about {topic}.",
    "Write a product description for something inspired by {topic}.",
)

TRAIN_TOPICS = (
    "volcanoes", "the water cycle", "photosynthesis", "black holes", "the Roman Empire", "bread baking",
    "electric cars", "honey bees", "the internet", "chess", "recycling", "the human heart", "rainbows",
    "machine learning", "the moon landing", "coffee", "earthquakes", "the printing press", "solar panels",
    "penguins", "sorting algorithms", "the French language", "climate change", "guitars", "vaccines",
    "the stock market", "origami", "dinosaurs", "bicycles", "the pyramids of Egypt", "prime numbers",
    "sleep", "coral reefs", "spreadsheets", "the Olympic Games", "tea ceremonies", "gravity", "bridges",
    "marathon running", "mushrooms", "tornadoes", "the immune system", "democracy", "smartphones",
    "gardening", "the Renaissance", "elephants", "hash tables", "meditation", "deserts", "the piano",
    "nuclear energy", "public libraries", "rain forests", "the periodic table", "airplanes", "cheese making",
    "the Great Wall of China", "wolves", "linked lists", "photography", "the solar system", "soccer",
    "the human brain", "volunteering", "trains", "bacteria", "poetry", "lighthouses", "budgeting",
    "the ocean tides", "robots", "ancient Greece", "yoga", "SQL databases", "butterflies", "snow",
    "video games", "the Amazon river", "pizza", "magnets", "recursion", "whales", "time zones",
    "the violin", "composting", "satellites",
)

HELD_OUT_TOPICS = ("glaciers", "jazz music", "octopuses", "binary search", "the Silk Road", "wind turbines")


def training_prompts() -> list[str]:
    return [t.format(topic=topic) for topic in TRAIN_TOPICS for t in TEMPLATES]


def held_out_prompts() -> list[str]:
    return [t.format(topic=topic) for topic in HELD_OUT_TOPICS for t in TEMPLATES[:12:3]]
