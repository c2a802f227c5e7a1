"""The canary stage: a replayed traffic sample split between the champion and the challenger.

Each request carries a user id; the split is sticky per user (hash of the id against the challenger's
share), like the router's. Per version: requests, errors (a request the server refused or that ended
abnormally), error rate, TPOT p50/p99, TTFT p99. The flow logs these and judges the challenger's with
the policy's canary gates.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable
from pathlib import Path

CHAMPION, CHALLENGER = "champion", "challenger"


def assign(user: str, share: float) -> str:
    """Sticky split: the same user always lands on the same version for a given share."""
    bucket = int.from_bytes(hashlib.sha256(user.encode()).digest()[:8], "big") / 2**64
    return CHALLENGER if bucket < share else CHAMPION


def traffic(n: int, seed: int = 0) -> list[dict]:
    """The replayed sample: prompts from the shipped prompt set, one user id per request."""
    from benchmarks.common import load_prompts

    prompts = load_prompts()
    return [{"user": f"user-{seed}-{i}", "prompt": prompts[i % len(prompts)], "max_tokens": 16} for i in range(n)]


def version_stats(records: list[dict]) -> dict:
    from benchmarks.common import percentile

    tpot = [r["tpot_s"] for r in records if r.get("tpot_s") is not None]
    ttft = [r["ttft_s"] for r in records if r.get("ttft_s") is not None]
    errors = sum(1 for r in records if r["error"])
    return {
        "requests": len(records),
        "errors": errors,
        "error_rate": errors / len(records) if records else 1.0,
        "tpot_p50_s": percentile(tpot, 50),
        "tpot_p99_s": percentile(tpot, 99),
        "ttft_p99_s": percentile(ttft, 99),
    }


def run_canary(champion_dir: Path, challenger_dir: Path, n: int, share: float, out: Path,
               advance: Callable[[int], None]) -> dict:
    if not 0.0 < share < 1.0:
        raise ValueError(f"canary share must be between 0 and 1 (exclusive), got {share}")
    if n < 2:
        raise ValueError(f"a canary needs at least 2 requests, got {n}")
    records = _replay_engines(champion_dir, challenger_dir, traffic(n), share, advance)
    by_version = {v: [r for r in records if r["version"] == v] for v in (CHAMPION, CHALLENGER)}
    if not by_version[CHALLENGER]:
        raise RuntimeError(f"no request of the {n}-request sample went to the challenger at share {share}")
    result = {v: version_stats(rs) for v, rs in by_version.items()}
    trace = out / "canary_trace.jsonl"
    trace.parent.mkdir(parents=True, exist_ok=True)
    trace.write_text("".join(json.dumps(r) + "\n" for r in records))
    (out / "canary.json").write_text(json.dumps(result, indent=2))
    result["artifacts"] = [str(trace), str(out / "canary.json")]
    result["summary"] = {
        "requests": len(records),
        "challenger_requests": result[CHALLENGER]["requests"],
        "challenger_error_rate": result[CHALLENGER]["error_rate"],
        "challenger_tpot_p99_s": result[CHALLENGER]["tpot_p99_s"],
        "champion_tpot_p99_s": result[CHAMPION]["tpot_p99_s"],
    }
    return result


def _replay_engines(champion_dir: Path, challenger_dir: Path, sample: list[dict], share: float,
                    advance: Callable[[int], None]) -> list[dict]:
    """Engine-level replay: both versions loaded side by side, each request sent to its version."""
    from serving import LLMEngine, SamplingParams

    engines = {
        CHAMPION: LLMEngine.from_pretrained(str(champion_dir), device="cpu", kv_cache_memory_gb=0.25),
        CHALLENGER: LLMEngine.from_pretrained(str(challenger_dir), device="cpu", kv_cache_memory_gb=0.25),
    }
    records: dict[str, dict] = {}
    for i, item in enumerate(sample):
        version = assign(item["user"], share)
        rid = f"canary-{i}"
        record = {"id": rid, "user": item["user"], "version": version, "error": None}
        try:
            engines[version].add_request(item["prompt"], SamplingParams(max_tokens=item["max_tokens"], temperature=0.0),
                                         request_id=rid)
        except ValueError as exc:
            record["error"] = f"refused: {exc}"
            advance(1)
        records[rid] = record
    while any(e.has_unfinished() for e in engines.values()):
        for engine in engines.values():
            if not engine.has_unfinished():
                continue
            for out in engine.step():
                if not out.finished:
                    continue
                r = records[out.request_id]
                r.update(tokens=len(out.token_ids), finish_reason=out.finish_reason,
                         ttft_s=out.metrics.ttft, tpot_s=out.metrics.tpot)
                if out.finish_reason not in ("stop", "length"):
                    r["error"] = f"finished with {out.finish_reason}"
                advance(1)
    return list(records.values())
