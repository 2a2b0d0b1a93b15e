"""Prompts for distillation, written for this project: task templates crossed with topics, then a second stage
built on the target's own answers to those.

The first stage asks open questions. The second turns some of its answers into the source text of input-grounded
tasks (summarise, answer from, rewrite, translate, edit code: answers that copy from a long prompt) and adds
arithmetic word problems with seeded numbers; a draft or heads trained on the first stage alone learn neither the
copying nor positions far beyond a short prompt. Training and held-out prompts use disjoint topics, so the
held-out acceptance measures generalisation; the benchmark suite's passages and problems appear in neither.
"""

from __future__ import annotations

import random
import re

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

# More task types, for the draft: a seeded sample of these per topic (`--extra-templates`) widens what it sees
# beyond the held-out report's templates, towards the benchmark's mix of chat, code, rewriting and translation.
EXTRA_TEMPLATES = (
    "Suggest a weekend plan for a family that loves {topic}.",
    "Write a short FAQ about {topic} with four questions and answers.",
    "Explain the most important idea behind {topic} in two sentences.",
    "Give a checklist for someone starting a project about {topic}.",
    "Write a tweet announcing a public talk about {topic}.",
    "Describe a typical day for a person whose job involves {topic}.",
    "What tips would you give someone who wants to get better at understanding {topic}?",
    "Write a limerick about {topic}.",
    "Write a short news report about a new discovery related to {topic}.",
    "Explain {topic} using an analogy from everyday life.",
    "What would change in the world if {topic} disappeared tomorrow?",
    "Write the opening paragraph of an essay about {topic}.",
    "Give a short glossary of five terms related to {topic}.",
    "Write a Python class that models something related to {topic}, with a short example of its use.",
    "Design a small SQL table for data about {topic} and write one query on it.",
    "Explain {topic} to a grandparent in a warm, friendly tone.",
    "Give two arguments for and two against spending public money on {topic}.",
    "Write an encouraging message for a student who finds {topic} hard.",
    "Summarise {topic} as a numbered list of key points.",
    "Describe {topic} from the point of view of a curious cat.",
    "Correct the mistakes in this sentence and explain each one: 'Their is many thing to learn about {topic}.'",
    "Translate into French: 'My sister is reading a book about {topic}.'",
    "Translate into Spanish: 'Our teacher talked about {topic} for the whole lesson.'",
    "Rewrite this sentence to be more polite: 'Tell me everything about {topic} right now.'",
)

HELD_OUT_TOPICS = ("glaciers", "jazz music", "octopuses", "binary search", "the Silk Road", "wind turbines")

# More subjects, for the draft (`--wide-topics`): a draft trained on the topics above alone agreed with the target on
# 92-98% of its training answers but on 48% of the held-out topics' answers. None is a held-out topic or a near
# neighbour of one (ice, jazz, cephalopods, searching, trade routes, wind power), and no prompt built on them is a
# benchmark prompt; "habits" and "time management" do touch the suite's chat question on study habits.
WIDE_TOPICS = (
    "ants", "owls", "sharks", "horses", "frogs", "parrots", "spiders", "camels", "kangaroos", "salmon migration",
    "bird songs", "tigers", "jellyfish", "earthworms", "bats", "dolphins", "crows", "tortoises", "foxes",
    "hummingbirds", "oak trees", "cactuses", "bamboo", "sunflowers", "seaweed", "wetlands", "caves", "islands",
    "rivers and deltas", "thunderstorms", "fog", "hurricanes", "the seasons", "soil", "fossils", "crystals",
    "sand dunes", "waterfalls", "the northern lights", "comets", "Mars", "Jupiter", "telescopes", "the Big Bang",
    "space stations", "rockets", "exoplanets", "eclipses", "atoms", "electricity", "sound waves", "light and colour",
    "friction", "temperature", "chemical reactions", "acids and bases", "DNA", "evolution", "cells", "the skeleton",
    "muscles", "the lungs", "digestion", "blood types", "allergies", "the five senses", "dreams", "memory",
    "habits", "emotions", "friendship", "laughter", "first aid", "nutrition", "vitamins", "hydration", "running shoes",
    "swimming", "tennis", "basketball", "cricket", "rock climbing", "skiing", "cycling races", "table tennis",
    "martial arts", "chess openings", "board games", "card tricks", "jigsaw puzzles", "crossword puzzles", "knitting",
    "pottery", "woodworking", "painting with watercolours", "sculpture", "calligraphy", "comic books", "animation",
    "film making", "theatre", "opera", "ballet", "drums", "the flute", "choirs", "folk songs", "movie soundtracks",
    "podcasts", "radio", "newspapers", "museums", "zoos", "theme parks", "city parks", "skyscrapers", "castles",
    "fountains", "canals", "tunnels", "roads", "traffic lights", "maps", "compasses", "clocks", "calendars",
    "the metric system", "money", "banks", "taxes", "inflation", "small businesses", "advertising", "supermarkets",
    "online shopping", "shipping containers", "farming", "tractors", "rice", "wheat", "chocolate", "spices",
    "soup", "sandwiches", "noodles", "ice cream", "fermentation", "vegetarian cooking", "breakfast around the world",
    "kitchen knives", "table manners", "weddings", "birthdays", "holidays in winter", "camping", "hiking trails",
    "packing a suitcase", "airports", "passports", "hotels", "learning a new language", "sign language", "alphabets",
    "dictionaries", "punctuation", "storytelling", "fairy tales", "myths and legends", "science fiction",
    "detective novels", "writing letters", "handwriting", "public speaking", "job interviews", "teamwork",
    "leadership", "time management", "saving money", "renting a flat", "moving house", "cleaning", "laundry",
    "houseplants", "pets", "dog training", "cats", "aquariums", "beekeeping tools", "fire fighters", "nurses",
    "architects", "pilots", "librarians", "teachers", "farmers", "chefs", "journalists", "engineers", "lawyers",
    "the ancient Maya", "the Vikings", "medieval knights", "samurai", "the Industrial Revolution", "the steam engine",
    "the telephone", "the light bulb", "the wheel", "writing systems", "the compass", "paper", "glass", "steel",
    "plastic", "concrete", "cotton", "wool", "rubber", "batteries", "computer memory", "operating systems",
    "web browsers", "passwords", "encryption", "email", "open-source software", "version control", "unit testing",
    "regular expressions", "stacks and queues", "the command line", "graphs in computer science",
    "object-oriented programming", "functional programming", "APIs", "JSON", "cloud computing", "computer viruses",
    "pixels", "3D printing", "drones", "virtual reality", "spelling", "fractions", "percentages", "geometry",
    "probability", "statistics", "negative numbers", "the number zero", "infinity", "symmetry", "triangles",
    "circles", "graphs and charts", "logic puzzles", "elections", "human rights", "the United Nations", "cities",
    "villages", "immigration", "population growth", "clean water", "pollution", "endangered species",
    "national parks", "forest fires", "floods", "droughts", "electric bicycles", "buses", "ships", "submarines",
    "hot air balloons", "motorcycles", "car engines", "road safety",
)


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

PASSAGE_TEMPLATES = (
    "Summarise the following text in two sentences.\n\n{text}",
    "{text}\n\nUsing only the text above, answer: what is the main idea, and which detail supports it?",
    "Rewrite the following paragraph in simpler words.\n\n{text}",
    "Turn the text below into a bulleted list of its key points.\n\n{text}",
    "Translate into French: '{sentence}'",
    "Translate into Spanish: '{sentence}'",
    "Translate into German: '{sentence}'",
    "Rewrite this sentence to be more formal: '{sentence}'",
)

CODE_TEMPLATES = (
    "Add comments to the code below and explain what it does.\n\n{text}",
    "Improve the names and add type hints to this code, keeping its behaviour.\n\n{text}",
)


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
    """The second-stage prompt built on first-stage answer `index` (None when it gets none): code answers get a
    code-editing task, others cycle through the passage templates."""
    if index % GROUNDED_EVERY != 1:
        return None
    text = _passage(answer)
    if len(text) < 40:
        return None
    if "```" in answer or "Python function" in prompt:
        return CODE_TEMPLATES[(index // GROUNDED_EVERY) % len(CODE_TEMPLATES)].format(text=text)
    template = PASSAGE_TEMPLATES[(index // GROUNDED_EVERY) % len(PASSAGE_TEMPLATES)]
    return template.format(text=text, sentence=_first_sentence(text).replace("\n", " "))


def maths_prompt(index: int) -> str | None:
    """An arithmetic word problem for prompt index `index` (None for most indices), numbers seeded by the index."""
    if index % MATHS_EVERY != 3:
        return None
    rng = random.Random(index)
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
    return problems[(index // MATHS_EVERY) % len(problems)]


def second_stage_prompts(prompts: list[str], answers: list[str]) -> list[str]:
    """The second-stage prompts for first-stage `prompts` and the target's `answers` to them, in order."""
    made = []
    for i, (prompt, answer) in enumerate(zip(prompts, answers)):
        made += [p for p in (grounded_prompt(i, prompt, answer), maths_prompt(i)) if p is not None]
    return made
