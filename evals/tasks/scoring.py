"""Per-item graders for the generation tasks: pure functions of (item, response) → 0.0 or 1.0."""

from __future__ import annotations

import json
import re

_FENCE = re.compile(r"^```(?:json)?\s*(.*?)\s*```$", re.DOTALL)
_EDGE_PUNCT = " \t\n.,!?;:'\"“”‘’"


def first_line(response: str) -> str:
    return response.strip().split("\n", 1)[0].strip()


def arith_correct(item: dict, response: str) -> float:
    """Exact match of the first line, allowing only surrounding whitespace and a final period."""
    return float(first_line(response).rstrip(".") == str(item["answer"]))


def parse_json_object(response: str) -> dict | None:
    """The response must be one JSON object; a single ```json fence around it is tolerated."""
    text = response.strip()
    match = _FENCE.match(text)
    if match:
        text = match.group(1)
    try:
        value = json.loads(text)
    except (json.JSONDecodeError, ValueError):
        return None
    return value if isinstance(value, dict) else None


def json_valid(item: dict, response: str) -> float:
    """Valid JSON object whose keys are exactly the requested ones."""
    obj = parse_json_object(response)
    return float(obj is not None and set(obj) == set(item["keys"]))


def json_exact(item: dict, response: str) -> float:
    """Valid, right keys, and every value right (strings case-insensitive, numbers by value)."""
    obj = parse_json_object(response)
    if obj is None or set(obj) != set(item["keys"]):
        return 0.0
    for key in item["keys"]:
        want, got = item["values"][key], obj[key]
        if isinstance(want, int) and not isinstance(want, bool):
            if str(got).strip() != str(want):
                return 0.0
        elif str(got).strip().lower() != str(want).strip().lower():
            return 0.0
    return 1.0


def normalize_word(response: str) -> str:
    return response.strip().strip(_EDGE_PUNCT).lower()


def one_word_correct(item: dict, response: str) -> float:
    """The whole reply must be the right option (case and edge punctuation ignored), nothing else."""
    return float(normalize_word(response) == item["answer"].lower())


def _letters(text: str) -> str:
    return "".join(ch for ch in text if ch.isalpha())


def instruct_ok(item: dict, response: str) -> float:
    """Checks the item's constraint; each kind is a literal, documented rule."""
    check = item["check"]
    kind = check["kind"]
    text = response.strip()
    if kind == "exact_upper":  # the word in capitals, nothing else
        return float(text.strip(_EDGE_PUNCT) == check["word"].upper())
    if kind == "repeat":  # the word exactly n times, whitespace separated
        tokens = [t.strip(_EDGE_PUNCT).lower() for t in text.split()]
        return float(tokens == [check["word"].lower()] * int(check["n"]))
    if kind == "lowercase":  # some letters, none uppercase
        letters = _letters(text)
        return float(len(letters) >= 3 and letters == letters.lower())
    if kind == "uppercase":  # some letters, none lowercase
        letters = _letters(text)
        return float(len(letters) >= 3 and letters == letters.upper())
    if kind == "n_lines":  # exactly n non-empty lines
        lines = [ln for ln in text.splitlines() if ln.strip()]
        return float(len(lines) == int(check["n"]))
    if kind == "number":  # only the digits of the right number
        return float(text.rstrip(".") == str(check["value"]))
    if kind == "starts_with":
        return float(text.lower().startswith(check["prefix"].lower()))
    if kind == "contains":
        return float(re.search(rf"\b{re.escape(check['word'].lower())}\b", text.lower()) is not None)
    if kind == "quoted":  # "word" in straight or curly double quotes, nothing else
        return float(text in (f'"{check["word"]}"', f"“{check['word']}”"))
    raise ValueError(f"unknown instruct check kind {kind!r}")
