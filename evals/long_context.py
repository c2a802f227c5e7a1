"""Long-context retrieval: a pass key hidden at several depths of filler text, at several prompt lengths.

KV-cache quantization fails first where many cached tokens are attended to: a short-prompt task cannot
see it. Each probe fills exactly `length` tokens of context: a prompt (BOS, an instruction, filler with
the pass-key sentence at `depth`, the question) and `max_new_tokens` of greedy answer through the engine; it is correct when the first
number the model writes is the key. Baseline and variant answer the same probes, so the comparison per
length is paired: retrieval accuracy, its delta and a paired-bootstrap 95 % CI over probes.

The filler is the pass-key test's usual repeated sentences (Mohtashami & Jaggi 2023, "Landmark
Attention"), written here: no eval task, the fidelity text (`evals.fidelity`) or any calibration text
uses it.
"""

from __future__ import annotations

import hashlib
import json
import random
import re
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np

INTRO = ("There is an important info hidden inside a lot of irrelevant text. Find it and memorize it. "
         "I will quiz you about the important information there.\n")
FILLER = " The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again."
NEEDLE = " The pass key is {key}. Remember it. {key} is the pass key."
QUESTION = "\nWhat is the pass key? The pass key is"
DEFAULT_LENGTHS = (512, 1024, 2048, 4096, 8192)
DEFAULT_DEPTHS = (0.1, 0.5, 0.9)


@dataclass(frozen=True)
class ProbePlan:
    lengths: tuple[int, ...] = DEFAULT_LENGTHS
    probes_per_length: int = 6  # spread over `depths` in turn
    depths: tuple[float, ...] = DEFAULT_DEPTHS
    max_new_tokens: int = 8
    seed: int = 0

    def __post_init__(self) -> None:
        if not self.lengths or any(isinstance(n, bool) or not isinstance(n, int) or n < 64 for n in self.lengths):
            raise ValueError(f"long-context lengths must be integers >= 64, got {self.lengths!r}")
        if len(set(self.lengths)) != len(self.lengths):
            raise ValueError(f"long-context lengths repeat: {self.lengths!r}")
        if isinstance(self.probes_per_length, bool) or not isinstance(self.probes_per_length, int) \
                or self.probes_per_length < 1:
            raise ValueError(f"probes_per_length must be an integer >= 1, got {self.probes_per_length!r}")
        if not self.depths or any(not 0.0 <= d <= 1.0 for d in self.depths):
            raise ValueError(f"depths must be fractions in [0, 1], got {self.depths!r}")
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens!r}")

    def capped(self, max_model_len: int) -> ProbePlan:
        """The lengths a model of `max_model_len` tokens of context can take."""
        fits = tuple(n for n in self.lengths if n <= max_model_len)
        if not fits:
            raise ValueError(f"no probe length of {self.lengths} fits a context of {max_model_len} tokens")
        return replace(self, lengths=fits)

    def key(self) -> str:
        return hashlib.sha256(json.dumps(asdict(self), sort_keys=True).encode()).hexdigest()[:16]


@dataclass(frozen=True)
class Probe:
    length: int
    depth: float
    key: str
    tokens: list[int] = field(repr=False)


@dataclass
class ProbeAnswer:
    length: int
    depth: float
    key: str
    answer: str
    correct: bool


def _encode(tokenizer: Any, text: str) -> list[int]:
    return tokenizer(text, add_special_tokens=False, return_attention_mask=False).input_ids


def build_probe(tokenizer: Any, length: int, depth: float, key: str, max_new_tokens: int = 8) -> Probe:
    """`length - max_new_tokens` tokens: BOS, intro, filler, needle at `depth` of the filler, filler, question."""
    bos = tokenizer.bos_token_id if tokenizer.bos_token_id is not None else tokenizer.eos_token_id
    intro, filler = _encode(tokenizer, INTRO), _encode(tokenizer, FILLER)
    needle, question = _encode(tokenizer, NEEDLE.format(key=key)), _encode(tokenizer, QUESTION)
    room = length - max_new_tokens - 1 - len(intro) - len(needle) - len(question)
    if room < 0:
        raise ValueError(f"a probe of {length} tokens cannot hold the instruction, pass key and question")
    body = (filler * (room // len(filler) + 1))[:room]
    at = min(int(round(depth * (room // len(filler)))) * len(filler), len(body))  # between whole fillers
    tokens = [bos, *intro, *body[:at], *needle, *body[at:], *question]
    return Probe(length, depth, key, tokens)


def build_probes(tokenizer: Any, plan: ProbePlan) -> list[Probe]:
    rng = random.Random(plan.seed)
    probes = []
    for length in plan.lengths:
        for i in range(plan.probes_per_length):
            depth = plan.depths[i % len(plan.depths)]
            probes.append(build_probe(tokenizer, length, depth, str(rng.randint(10000, 99999)), plan.max_new_tokens))
    return probes


def answer_correct(text: str, key: str) -> bool:
    found = re.search(r"\d+", text)
    return found is not None and found.group(0) == key


def run_probes(engine: Any, plan: ProbePlan) -> list[ProbeAnswer]:
    """Every probe through the engine (greedy); the lengths are first capped to the engine's context."""
    from evals.lm import EngineLM
    from serving import SamplingParams

    plan = plan.capped(int(engine.max_model_len))
    probes = build_probes(engine.tokenizer, plan)
    params = SamplingParams(max_tokens=plan.max_new_tokens, temperature=0.0)
    outs = EngineLM(engine, show_progress=False)._run([p.tokens for p in probes], [params] * len(probes),
                                                      "long-context")
    return [ProbeAnswer(p.length, p.depth, p.key, out.text, answer_correct(out.text, p.key))
            for p, out in zip(probes, outs, strict=True)]


def save(answers: list[ProbeAnswer], plan: ProbePlan, path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"plan": asdict(plan), "answers": [asdict(a) for a in answers]}, indent=1))
    return path


def load(path: Path) -> list[ProbeAnswer]:
    return [ProbeAnswer(**a) for a in json.loads(Path(path).read_text())["answers"]]


@dataclass
class LengthComparison:
    length: int
    n: int
    baseline: float  # retrieval accuracy
    variant: float
    delta: float
    ci_low: float
    ci_high: float
    lost: list[str] = field(default_factory=list)  # "depth 0.5: key 12345, answered '...'"


def compare(base: list[ProbeAnswer], var: list[ProbeAnswer], n_boot: int = 2000, alpha: float = 0.05,
            seed: int = 0) -> dict[int, LengthComparison]:
    """Per length: paired accuracies, delta and its percentile bootstrap CI over probes."""
    pairs: dict[int, list[tuple[ProbeAnswer, ProbeAnswer]]] = {}
    by_probe = {(a.length, a.depth, a.key): a for a in var}
    for b in base:
        v = by_probe.get((b.length, b.depth, b.key))
        if v is not None:
            pairs.setdefault(b.length, []).append((b, v))
    if not pairs:
        raise ValueError("baseline and variant answered no probe in common; measure both with one plan")
    out = {}
    for length, rows in sorted(pairs.items()):
        bs = np.array([b.correct for b, _ in rows], dtype=float)
        vs = np.array([v.correct for _, v in rows], dtype=float)
        rng = np.random.default_rng(seed + length)
        idx = rng.integers(0, len(rows), size=(n_boot, len(rows)))
        deltas = vs[idx].mean(axis=1) - bs[idx].mean(axis=1)
        low, high = (float(x) for x in np.percentile(deltas, [100 * alpha / 2, 100 * (1 - alpha / 2)]))
        lost = [f"depth {b.depth:g}: key {b.key}, answered {v.answer.strip()[:40]!r}"
                for b, v in rows if b.correct and not v.correct]
        out[length] = LengthComparison(length, len(rows), float(bs.mean()), float(vs.mean()),
                                       round(float(vs.mean() - bs.mean()), 12), low, high, lost)
    return out
