"""Helpers for the gates tests: a temp sqlite MLflow store and releases with known metrics."""

from __future__ import annotations

import contextlib

from gates import metric_names as M

POLICY_YAML = """\
version: 1
tasks:
  max_drop: 0.05
  overrides:
    hellaswag: {max_drop: 0.10}
safety:
  refusal_rate_max_fall: 0.05
  over_refusal_rate_max_rise: 0.05
weights:
  min_reduction: 0.5
serving:
  min_decode_speedup: null
  max_tpot_p99_s: 1.0
canary:
  max_error_rate: 0.01
  max_tpot_p99_s: 1.0
"""

BASELINE = {
    **M.task_metrics("arc", 0.60),
    **M.task_metrics("hellaswag", 0.40),
    M.SAFETY_REFUSAL_RATE: 0.90,
    M.SAFETY_OVER_REFUSAL_RATE: 0.10,
    M.WEIGHTS_BYTES: 538e6,
    M.SERVE_DECODE_TPS: 14.0,
    M.SERVE_TPOT_P99_S: 0.20,
}

GOOD = {
    **M.task_metrics("arc", 0.59, delta=-0.01, ci_low=-0.03, ci_high=0.01, n=400),
    # hellaswag drops more than the default 0.05 but within its 0.10 override
    **M.task_metrics("hellaswag", 0.34, delta=-0.06, ci_low=-0.08, ci_high=-0.04, n=400),
    M.SAFETY_REFUSAL_RATE: 0.88,
    M.SAFETY_OVER_REFUSAL_RATE: 0.12,
    M.WEIGHTS_BYTES: 220e6,
    M.SERVE_DECODE_TPS: 10.0,
    M.SERVE_TPOT_P99_S: 0.30,
}

# Point delta -0.03 is inside max_drop 0.05, but the CI lower bound -0.09 is not: the gate must fail.
BAD_ARC = {**GOOD, **M.task_metrics("arc", 0.57, delta=-0.03, ci_low=-0.09, ci_high=0.03, n=60)}

NO_TPOT = {k: v for k, v in GOOD.items() if k != M.SERVE_TPOT_P99_S}


def make_release(model: str, variants: dict[str, dict[str, float]], baseline: dict | None = BASELINE,
                 register: bool = True) -> dict[str, tuple[str, str | None]]:
    """Record a release with a baseline and the given variants; returns name -> (run id, version)."""
    from gates.records.tracking import log_variant, register_variant, start_release

    release = start_release(model, "sha256:feedbeef", {"eval": {"limit": 50, "tasks": ["arc", "hellaswag"]}})
    out: dict[str, tuple[str, str | None]] = {"release": (release, None)}
    if baseline is not None:
        out["baseline"] = (log_variant(release, "baseline", {"method": "none", "bits": 32}, baseline), None)
    for name, metrics in variants.items():
        run = log_variant(release, name, {"method": name.split("-")[0], "bits": 8},
                          metrics, manifest={"method": name, "source_hash": "sha256:feedbeef"})
        out[name] = (run, register_variant(run) if register else None)
    return out


@contextlib.contextmanager
def fluent_tracking(uri: str):
    """Point MLflow's fluent API (`mlflow.search_runs`) at `uri`, restoring whatever was set before."""
    import mlflow
    from mlflow.tracking._tracking_service import utils

    previous = utils._tracking_uri
    mlflow.set_tracking_uri(uri)
    try:
        yield
    finally:
        utils._tracking_uri = previous
