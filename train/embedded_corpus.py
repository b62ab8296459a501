"""The default training text: a synthetic English-like corpus generated from a fixed seed.

Nothing is downloaded or shipped: the text is produced by the small grammars below, written for
this project. It has structure a tiny model learns within minutes (spelling, word order,
recurring facts, arithmetic), so the loss of a CPU smoke run falls visibly.
"""
from __future__ import annotations

import random
from collections.abc import Iterator

_NOUNS = [
    "fox", "river", "engineer", "lantern", "garden", "mountain", "teacher", "robot", "harbor", "violin",
    "forest", "kettle", "painter", "window", "sailor", "meadow", "clock", "library", "falcon", "bridge",
]
_ADJECTIVES = [
    "quiet", "bright", "old", "curious", "small", "golden", "patient", "cold", "busy", "gentle", "tall", "green",
]
_VERBS = ["watches", "follows", "remembers", "finds", "builds", "carries", "visits", "paints", "greets", "counts"]
_PLACES = ["near the harbor", "under the bridge", "in the garden", "by the river", "at the library", "on the hill"]
_TIMES = ["every morning", "at noon", "after the rain", "before dinner", "in winter", "at night"]
_CITIES = [
    ("Arlen", "Vesta"), ("Borrow", "Quill"), ("Caddis", "Moran"), ("Dunmore", "Pell"), ("Elsby", "Tarn"),
    ("Fenwick", "Ostra"), ("Galloway", "Rime"), ("Hollis", "Sable"),
]
_NUMBER_WORDS = ["zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine", "ten", "eleven", "twelve"]


def _sentence(rng: random.Random) -> str:
    subject = f"the {rng.choice(_ADJECTIVES)} {rng.choice(_NOUNS)}"
    obj = f"the {rng.choice(_NOUNS)}"
    parts = [subject, rng.choice(_VERBS), obj]
    if rng.random() < 0.5:
        parts.append(rng.choice(_PLACES))
    if rng.random() < 0.3:
        parts.append(rng.choice(_TIMES))
    text = " ".join(parts)
    return text[0].upper() + text[1:] + "."


def _story(rng: random.Random) -> str:
    return " ".join(_sentence(rng) for _ in range(rng.randint(3, 9)))


def _arithmetic(rng: random.Random) -> str:
    lines = []
    for _ in range(rng.randint(4, 12)):
        a, b = rng.randint(0, 99), rng.randint(0, 99)
        if rng.random() < 0.5:
            lines.append(f"{a} + {b} = {a + b}")
        else:
            lines.append(f"{max(a, b)} - {min(a, b)} = {max(a, b) - min(a, b)}")
    return "\n".join(lines)


def _counting(rng: random.Random) -> str:
    start = rng.randint(0, 6)
    stop = rng.randint(start + 3, len(_NUMBER_WORDS) - 1)
    return "Counting: " + ", ".join(_NUMBER_WORDS[start : stop + 1]) + "."


def _facts(rng: random.Random) -> str:
    # The same city -> region pairs recur in every document, so recall can be learned.
    pairs = rng.sample(_CITIES, rng.randint(2, 5))
    return " ".join(f"The city of {city} lies in the region of {region}." for city, region in pairs)


_DOCUMENT_KINDS = (_story, _arithmetic, _counting, _facts)


def embedded_documents(num_documents: int, seed: int = 0) -> Iterator[str]:
    """`num_documents` synthetic documents, identical for the same seed on every machine."""
    if num_documents < 1:
        raise ValueError(f"num_documents must be >= 1, got {num_documents}")
    rng = random.Random(seed)
    for _ in range(num_documents):
        sections = [rng.choice(_DOCUMENT_KINDS)(rng) for _ in range(rng.randint(1, 4))]
        yield "\n\n".join(sections) + "\n"
