"""Fidelity: how far a variant's next-token distributions move from the baseline's on a fixed held text.

The text is teacher-forced through the engine (`LLMEngine`, prompt logprobs, as lm-eval scoring does in
`evals.lm`), so the numbers are the served model's: its kernels, its KV cache format. Per scored
position two quantities, variant against baseline:

- **KL(baseline || variant)** in nats, over the partition the engine lets both sides see exactly: every
  token in both models' top-k (k = 20, the engine's most) as its own outcome, everything else as one
  "rest" outcome. Merging outcomes never raises a KL, so this is a lower bound on the full-vocabulary KL;
  it is exact when the rest holds little mass (`tail_mass` reports how much the baseline put there).
- **top-1 flip**: the variant's most likely token differs from the baseline's.

Positions within a chunk are correlated, so the CI is a cluster bootstrap over chunks (percentile, 95 %):
chunks are resampled with replacement and the mean over the resampled positions recomputed.

The held text is the prose of the Python Language Reference as CPython ships it (`pydoc_data/topics.py`,
PSF License 2.0), paragraphs of plain English only (no grammar rules, no code): no eval task, the
long-context filler (`evals.long_context`) or any calibration text draws on it. Its sha256 is recorded
beside the figures.
"""

from __future__ import annotations

import hashlib
import json
import math
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

MAX_TOP_K = 20  # the engine returns at most 20 alternatives per prompt token
TEXT_SOURCE = "Python Language Reference prose, CPython pydoc_data/topics.py (PSF License 2.0)"
MIN_PARAGRAPH_CHARS = 160
_EPS = 1e-12


@dataclass(frozen=True)
class FidelityPlan:
    chunks: int = 16
    chunk_tokens: int = 128
    top_k: int = MAX_TOP_K
    seed: int = 0  # of the bootstrap
    first_chunk: int = 0  # windows first_chunk .. first_chunk + chunks - 1 of the text (a held-out split)

    def __post_init__(self) -> None:
        for name in ("chunks", "chunk_tokens"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 2:
                raise ValueError(f"fidelity {name} must be an integer >= 2, got {value!r}")
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int) or not 1 <= self.top_k <= MAX_TOP_K:
            raise ValueError(f"fidelity top_k must be an integer in [1, {MAX_TOP_K}], got {self.top_k!r}")

    def key(self) -> str:
        return hashlib.sha256(json.dumps(asdict(self), sort_keys=True).encode()).hexdigest()[:16]


def held_text() -> str:
    """Plain-prose paragraphs of every reference topic, in sorted topic order."""
    from pydoc_data.topics import topics

    paragraphs = []
    for name in sorted(topics):
        for block in topics[name].split("\n\n"):
            lines = block.split("\n")
            if any(not line or line[0].isspace() for line in lines):
                continue  # indented: grammar, code, tables
            text = " ".join(lines)
            if len(text) >= MIN_PARAGRAPH_CHARS and "::=" not in text and ">>>" not in text and "***" not in text:
                paragraphs.append(text)
    return "\n\n".join(paragraphs)


def text_sha256() -> str:
    return hashlib.sha256(held_text().encode()).hexdigest()


def held_chunks(tokenizer: Any, plan: FidelityPlan) -> list[list[int]]:
    """`plan.chunks` consecutive, non-overlapping windows of the held text, each after a BOS-or-EOS token."""
    ids = tokenizer(held_text(), add_special_tokens=False, return_attention_mask=False).input_ids
    need = (plan.first_chunk + plan.chunks) * (plan.chunk_tokens - 1)
    if len(ids) < need:
        raise ValueError(f"the held text has {len(ids)} tokens; {plan.chunks} chunks of {plan.chunk_tokens} "
                         f"from chunk {plan.first_chunk} need {need}")
    prefix = tokenizer.bos_token_id if tokenizer.bos_token_id is not None else tokenizer.eos_token_id
    step = plan.chunk_tokens - 1
    first = plan.first_chunk
    return [[prefix, *ids[i * step:(i + 1) * step]] for i in range(first, first + plan.chunks)]


def teacher_force(engine: Any, plan: FidelityPlan) -> dict:
    """Every chunk through the engine at once; per scored position the top-k (ids, logprobs)."""
    from evals.lm import EngineLM
    from serving import SamplingParams

    chunks = held_chunks(engine.tokenizer, plan)
    params = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=plan.top_k)
    outs = EngineLM(engine, show_progress=False)._run(chunks, [params] * len(chunks), "fidelity")
    tops = []
    for chunk, out in zip(chunks, outs, strict=True):
        plps = out.prompt_logprobs
        if plps is None or len(plps) != len(chunk):
            raise RuntimeError(f"engine returned {0 if plps is None else len(plps)} prompt logprobs for {len(chunk)} tokens")
        tops.append([[[int(i) for i, _ in e.top], [float(lp) for _, lp in e.top]] for e in plps[1:]])
    return {"plan": asdict(plan), "text_sha256": text_sha256(), "text_source": TEXT_SOURCE, "tokens": chunks,
            "top": tops}


def save(record: dict, path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(record))
    return path


def load(path: Path) -> dict:
    return json.loads(Path(path).read_text())


def position_kl(base: list[list], var: list[list]) -> tuple[float, float]:
    """(KL over the shared-top-k partition, baseline mass outside it) of one position's [[ids], [logprobs]]."""
    b = dict(zip(base[0], base[1], strict=True))
    v = dict(zip(var[0], var[1], strict=True))
    shared = [t for t in base[0] if t in v]
    p = np.exp(np.array([b[t] for t in shared], dtype=float))
    q = np.exp(np.array([v[t] for t in shared], dtype=float))
    p_rest, q_rest = max(1.0 - float(p.sum()), 0.0), max(1.0 - float(q.sum()), _EPS)
    kl = float(np.sum(p * (np.log(np.maximum(p, _EPS)) - np.log(np.maximum(q, _EPS)))))
    if p_rest > 0:
        kl += p_rest * (math.log(p_rest) - math.log(q_rest))
    return max(kl, 0.0), p_rest


@dataclass
class FidelityResult:
    kl: float
    kl_ci_low: float
    kl_ci_high: float
    flip_rate: float
    flip_ci_low: float
    flip_ci_high: float
    positions: int
    chunks: int
    tail_mass: float  # mean baseline probability outside the shared top-k partition
    text_sha256: str
    flips: list[dict]  # the first flipped positions: chunk, position, baseline and variant token ids


def compare(base: dict, var: dict, n_boot: int = 2000, alpha: float = 0.05, max_flips: int = 50) -> FidelityResult:
    """Variant against baseline on the same chunks (refused when the two saw different text or tokens)."""
    if base["tokens"] != var["tokens"] or base["text_sha256"] != var["text_sha256"]:
        raise ValueError("baseline and variant were teacher-forced on different text or tokens; measure both again")
    kl_sums, flip_sums, counts, tails, flips = [], [], [], [], []
    for c, (b_chunk, v_chunk) in enumerate(zip(base["top"], var["top"], strict=True)):
        kl_sum = flip_sum = 0.0
        for pos, (b, v) in enumerate(zip(b_chunk, v_chunk, strict=True)):
            kl, tail = position_kl(b, v)
            kl_sum += kl
            tails.append(tail)
            if b[0][0] != v[0][0]:
                flip_sum += 1
                if len(flips) < max_flips:
                    flips.append({"chunk": c, "position": pos + 1, "baseline": b[0][0], "variant": v[0][0],
                                  "kl": round(kl, 6)})
        kl_sums.append(kl_sum)
        flip_sums.append(flip_sum)
        counts.append(len(b_chunk))
    kl_arr, flip_arr, n_arr = (np.array(x, dtype=float) for x in (kl_sums, flip_sums, counts))
    seed = int(base["plan"].get("seed", 0))
    kl_lo, kl_hi = cluster_ci(kl_arr, n_arr, seed, n_boot, alpha)
    flip_lo, flip_hi = cluster_ci(flip_arr, n_arr, seed + 1, n_boot, alpha)
    total = float(n_arr.sum())
    return FidelityResult(kl=float(kl_arr.sum() / total), kl_ci_low=kl_lo, kl_ci_high=kl_hi,
                          flip_rate=float(flip_arr.sum() / total), flip_ci_low=flip_lo, flip_ci_high=flip_hi,
                          positions=int(total), chunks=len(counts), tail_mass=float(np.mean(tails)),
                          text_sha256=base["text_sha256"], flips=flips)


def cluster_ci(sums: np.ndarray, counts: np.ndarray, seed: int, n_boot: int = 2000,
               alpha: float = 0.05) -> tuple[float, float]:
    """Percentile CI of sum(sums) / sum(counts) with whole chunks resampled."""
    rng = np.random.default_rng(seed)
    idx = rng.integers(0, len(sums), size=(n_boot, len(sums)))
    ratios = sums[idx].sum(axis=1) / counts[idx].sum(axis=1)
    low, high = np.percentile(ratios, [100 * alpha / 2, 100 * (1 - alpha / 2)])
    return float(low), float(high)
