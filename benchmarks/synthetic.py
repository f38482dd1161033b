"""Deterministic synthetic memory facts for benchmarks (short, varied, realistic sentences)."""

from __future__ import annotations

import random

NAMES = ["Ana", "Ben", "Chloe", "Dev", "Elif", "Farid", "Grace", "Hugo", "Ines", "Jon", "Kai", "Lena", "Mateo",
         "Nia", "Omar", "Priya", "Quinn", "Rosa", "Sami", "Tara"]
VERBS = ["visited", "started learning", "gave up", "talked about", "planned", "enjoyed", "complained about",
         "bought tickets for", "wrote a poem about", "took photos of", "volunteered at", "signed up for"]
OBJECTS = ["a pottery class", "the Lisbon marathon", "a jazz concert", "her grandmother's farm", "a chess club",
           "a cooking course", "the botanical garden", "a charity run", "a startup idea", "a road trip to Seville",
           "a Spanish course", "a local animal shelter", "an astronomy night", "a camping weekend", "a book club",
           "a salsa workshop", "the science museum", "a coding bootcamp", "a surf lesson", "a wine tasting"]
WHENS = ["last weekend", "in May 2023", "two years ago", "yesterday", "every Sunday", "during the summer holidays",
         "after work on Fridays", "on her birthday", "in early spring", "before moving to Porto"]
DETAILS = ["with her best friend", "and loved it", "but found it exhausting", "for the first time",
           "with the whole family", "to relieve stress", "because a colleague recommended it", "despite the rain"]


def synthetic_facts(count: int, seed: int, clauses: int = 1) -> list[str]:
    """`count` distinct fact sentences of `clauses` clauses each, the same for the same seed (a clause's length in
    tokens: benchmarks/RESULTS.md, "Serving through the OpenAI API on a GPU")."""
    rng = random.Random(seed)
    facts: list[str] = []
    seen: set[str] = set()
    while len(facts) < count:
        text = ", and ".join(f"{rng.choice(NAMES)} {rng.choice(VERBS)} {rng.choice(OBJECTS)} {rng.choice(WHENS)} "
                             f"{rng.choice(DETAILS)}" for _ in range(clauses)) + "."
        if text in seen:
            text = f"{text[:-1]} (note {len(facts)})."
        seen.add(text)
        facts.append(text)
    return facts


def synthetic_queries(count: int, seed: int) -> list[str]:
    """`count` distinct questions (at most len(NAMES) * len(OBJECTS)), the same for the same seed."""
    rng = random.Random(seed)
    queries: dict[str, None] = {}
    while len(queries) < min(count, len(NAMES) * len(OBJECTS)):
        queries[f"When did {rng.choice(NAMES)} go to {rng.choice(OBJECTS)}?"] = None
    return list(queries)
