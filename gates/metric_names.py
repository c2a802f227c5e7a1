"""The metric names that producers (evals, benchmarks, flows) log and the gate evaluator reads.

One module so both sides agree. Every name is a plain MLflow metric key; values are floats.

| key | meaning | logged by |
| --- | --- | --- |
| `task/<task>/score` | the task's primary score (higher is better unless the policy says otherwise) | evals |
| `task/<task>/n` | number of paired samples behind the score | evals |
| `task/<task>/delta` | variant score minus baseline score (paired, point estimate) | evals |
| `task/<task>/delta_ci_low` / `_high` | paired-bootstrap CI bounds of that delta | evals |
| `safety/refusal_rate` | fraction of harmful prompts refused, pooled over the items of every refusal task (HarmBench + AdvBench) | evals |
| `safety/over_refusal_rate` | fraction of benign prompts refused | evals |
| `weights/bytes` | bytes of weights in memory (parameters + buffers) as served: after the engine ran and packed them | quantize / flows |
| `serve/decode_tps`, `serve/prefill_tps` | tokens per second through our engine | benchmarks |
| `serve/ttft_p50_s` ... `serve/tpot_p99_s` | latency quantiles in seconds (p50/p95/p99) | benchmarks |
| `serve/decode_speedup_b<N>` (`_ci_low`, `_ci_high`) | variant / baseline decode tok/s at batch N: geometric mean of the paired per-round ratios and its 95 % CI | flows (speed) |
| `serve/prefill_speedup` (`_ci_low`, `_ci_high`) | the same for prefill tok/s | flows (speed) |
| `serve/long_decode_speedup_b<N>` (`_ci_low`, `_ci_high`) | the same at the long-context point (KV-quantized variants) | flows (speed) |
| `serve/speed_rounds` | the most paired rounds any of the variant's points took | flows (speed) |
| `serve/point/<point>/prompt_tokens`, `.../steps`, `.../batch`, `.../calls` | the operating point each speed metric was timed at (prompt or context tokens, timed steps, batch; prefill: prompts timed a round, their median kept) | flows (speed) |
| `serve/point/<point>/rounds`, `.../ci_level` | the paired rounds that point took to its stop and the look-adjusted level of its CI | flows (speed) |
| `serve/paired_decode_b<N>_tps`, `serve/paired_prefill_tps` | the model's own median tok/s over those rounds | flows (speed) |
| `weights/loaded_bytes` | bytes of weights right after loading, before the engine packed anything | flows |
| `capacity/max_seqs`, `capacity/kv_blocks`, `capacity/kv_tokens` | KV-cache capacity | benchmarks |
| `capacity/kv_bytes_per_block` | bytes one KV block takes (codes + scales for an 8-bit cache) | flows |
| `capacity/gain` | variant `capacity/max_seqs` / baseline's, at the same fixed budget | flows |
| `canary/error_rate`, `canary/tpot_p99_s`, `canary/requests` | the canary stage's SLO measurements | flows |
| `canary/tpot_speedup` (`_ci_low`, `_ci_high`), `canary/speed_windows` | champion TPOT / challenger TPOT over paired windows of the replay | flows |

The gate evaluator writes its verdicts under `gate/<gate name>/...` (see `gates.records.evaluation`).
"""

from __future__ import annotations

import math
import numbers
import re
from collections.abc import Iterable, Mapping

SAFETY_REFUSAL_RATE = "safety/refusal_rate"
SAFETY_OVER_REFUSAL_RATE = "safety/over_refusal_rate"
WEIGHTS_BYTES = "weights/bytes"
SERVE_DECODE_TPS = "serve/decode_tps"
SERVE_PREFILL_TPS = "serve/prefill_tps"
CAPACITY_MAX_SEQS = "capacity/max_seqs"
CAPACITY_KV_BLOCKS = "capacity/kv_blocks"
CAPACITY_KV_TOKENS = "capacity/kv_tokens"
CAPACITY_KV_BYTES_PER_BLOCK = "capacity/kv_bytes_per_block"
CAPACITY_GAIN = "capacity/gain"
CANARY_ERROR_RATE = "canary/error_rate"
CANARY_TPOT_P99_S = "canary/tpot_p99_s"
CANARY_REQUESTS = "canary/requests"
CANARY_TPOT_SPEEDUP = "canary/tpot_speedup"
CANARY_SPEED_WINDOWS = "canary/speed_windows"
WEIGHTS_LOADED_BYTES = "weights/loaded_bytes"
SERVE_PREFILL_SPEEDUP = "serve/prefill_speedup"
SERVE_SPEED_ROUNDS = "serve/speed_rounds"
CI_FIELDS = ("ci_low", "ci_high")
MACHINE_TAG = "quantgate.machine"  # a run tag: the CPU, flags, kernel path, threads, dtype its speeds were measured on

LATENCY_KINDS = ("ttft", "tpot")
QUANTILES = (50, 95, 99)
TASK_FIELDS = ("score", "n", "delta", "delta_ci_low", "delta_ci_high")

# MLflow accepts these characters in metric/param/tag keys; we keep task names to a safe subset.
_KEY_RE = re.compile(r"^[A-Za-z0-9_\-./ :]+$")
_TASK_RE = re.compile(r"^[A-Za-z0-9_\-.:]+$")
_TASK_KEY_RE = re.compile(r"^task/([A-Za-z0-9_\-.:]+)/(" + "|".join(TASK_FIELDS) + r")$")


def check_task_name(task: str) -> str:
    if not isinstance(task, str) or not _TASK_RE.match(task):
        raise ValueError(
            f"task name {task!r} cannot be a metric key: use letters, digits, '_', '-', '.', ':' only"
        )
    return task


def task_key(task: str, field: str) -> str:
    if field not in TASK_FIELDS:
        raise ValueError(f"unknown task metric field {field!r} (known: {', '.join(TASK_FIELDS)})")
    return f"task/{check_task_name(task)}/{field}"


def task_score(task: str) -> str:
    return task_key(task, "score")


def task_delta(task: str) -> str:
    return task_key(task, "delta")


def task_delta_ci_low(task: str) -> str:
    return task_key(task, "delta_ci_low")


def task_delta_ci_high(task: str) -> str:
    return task_key(task, "delta_ci_high")


def latency(kind: str, quantile: int) -> str:
    """`serve/ttft_p99_s` and friends: serving-benchmark latency quantiles in seconds."""
    if kind not in LATENCY_KINDS or quantile not in QUANTILES:
        raise ValueError(f"no latency metric for {kind!r} p{quantile} (kinds {LATENCY_KINDS}, quantiles {QUANTILES})")
    return f"serve/{kind}_p{quantile}_s"


def decode_speedup(batch: int) -> str:
    """`serve/decode_speedup_b4`: the paired decode ratio at decode batch `batch`."""
    if isinstance(batch, bool) or not isinstance(batch, int) or batch < 1:
        raise ValueError(f"a decode batch is an integer >= 1, got {batch!r}")
    return f"serve/decode_speedup_b{batch}"


def long_decode_speedup(batch: int) -> str:
    """`serve/long_decode_speedup_b1`: the paired decode ratio at the long-context point."""
    return decode_speedup(batch).replace("serve/decode_", "serve/long_decode_")


SPEED_POINT_FIELDS = ("prompt_tokens", "steps", "batch", "calls", "rounds", "ci_level")


def speed_point(point: str, field: str) -> str:
    """`serve/point/decode_b16/prompt_tokens`: where a speed metric was timed, and how many rounds it took."""
    if field not in SPEED_POINT_FIELDS:
        raise ValueError(f"unknown speed-point field {field!r} (known: {', '.join(SPEED_POINT_FIELDS)})")
    return f"serve/point/{point}/{field}"


def paired_tps(point: str) -> str:
    """`serve/paired_decode_b4_tps`, `serve/paired_prefill_tps`: one model's median tok/s over the rounds."""
    return f"serve/paired_{point}_tps"


def ci(key: str, bound: str) -> str:
    """`<key>_ci_low` / `<key>_ci_high`: a ratio's CI bounds."""
    if bound not in CI_FIELDS:
        raise ValueError(f"unknown CI bound {bound!r} (known: {', '.join(CI_FIELDS)})")
    return f"{key}_{bound}"


SERVE_TPOT_P99_S = latency("tpot", 99)
SERVE_TTFT_P99_S = latency("ttft", 99)


def task_metrics(
    task: str,
    score: float,
    delta: float | None = None,
    ci_low: float | None = None,
    ci_high: float | None = None,
    n: int | None = None,
) -> dict[str, float]:
    """The metric dict for one task, ready for `tracking.log_variant` (None fields are left out)."""
    values = {"score": score, "delta": delta, "delta_ci_low": ci_low, "delta_ci_high": ci_high, "n": n}
    return {task_key(task, k): float(v) for k, v in values.items() if v is not None}


def tasks_in(metrics: Iterable[str]) -> set[str]:
    """Task names that appear in a collection of metric keys."""
    return {m.group(1) for key in metrics if (m := _TASK_KEY_RE.match(key))}


def check_metrics(metrics: Mapping[str, object]) -> dict[str, float]:
    """Validate keys and values before logging: finite numbers only, keys MLflow accepts."""
    clean: dict[str, float] = {}
    for key, value in metrics.items():
        if not isinstance(key, str) or not _KEY_RE.match(key):
            raise ValueError(f"metric key {key!r} has characters MLflow does not accept")
        if isinstance(value, bool) or not isinstance(value, numbers.Real):
            raise ValueError(f"metric {key!r} is {type(value).__name__} {value!r}, not a number")
        number = float(value)
        if not math.isfinite(number):
            raise ValueError(f"metric {key!r} is {number}; log only measured, finite values (omit the key)")
        clean[key] = number
    return clean


# Where the gate evaluator records verdicts (metrics and tags on the variant run).
STAGES = ("release", "canary")


def gate_key(gate_name: str, field: str) -> str:
    """`gate/<gate name>/<field>`: metrics pass/observed/threshold, tags verdict/reason/observed/threshold."""
    return f"gate/{gate_name}/{field}"


def stage_tag(stage: str, field: str) -> str:
    """`gates/<stage>/<field>`: verdict ("pass"/"fail"), names (JSON list), evaluated_at, policy_sha256."""
    if stage not in STAGES:
        raise ValueError(f"unknown gate stage {stage!r} (known: {', '.join(STAGES)})")
    return f"gates/{stage}/{field}"

EVIDENCE_DIR = "evidence"  # a variant run's artifact folder: per-sample logs, comparison Markdown, plots
