"""The release's fidelity and long-context measurements, and the deployment the safety suites run with.

They run inside the `measure` stage on the engine it already loaded (no second load per model) and are
cached with it: the policy's plan is part of `MeasureConfig`, so its key covers them. Per model:
`fidelity.json` (top-k logprobs of the held text, `evals.fidelity`) and, for the models the policy
probes, `long_context.json` (`evals.long_context`). The comparison with the baseline runs where the
task comparison does (`flows.measuring.compare`) and yields `gates.judging.fidelity_gates`' metrics plus a
report artifact naming the flipped positions and the lost pass keys.
"""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path
from typing import Any

from evals import fidelity as F
from evals import long_context as L
from flows.data import BASELINE, DEFAULT_SUITES, MeasureConfig, Variant
from gates.judging import fidelity_gates as G
from gates.judging.policy import Policy
from quantize.capacity import split_variant, variant_label

FIDELITY_FILE = "fidelity.json"
PROBES_FILE = "long_context.json"
REPORT_FILE = "fidelity_report.json"


def measure_config(policy: Policy, methods: list[str], suites: list[str] | None, limit: int | None) -> MeasureConfig:
    """The release's `MeasureConfig`: its suites and limit, and what the policy asks measured beside them."""
    return MeasureConfig(suites=tuple(suites or DEFAULT_SUITES), limit=limit, **config_fields(policy, methods))


def config_fields(policy: Policy, methods: list[str]) -> dict:
    """The `MeasureConfig` fields the policy's fidelity, long_context and deployment sections set."""
    fidelity, probe = policy.fidelity, policy.long_context
    probed = tuple(variant_label(m) for m in methods if probe.probes(split_variant(m)[1]))
    return {
        "fidelity_chunks": fidelity.chunks if fidelity.enabled else 0,
        "fidelity_chunk_tokens": fidelity.chunk_tokens,
        "probe_lengths": tuple(probe.lengths) if probed else (),
        "probes_per_length": probe.probes_per_length if probed else 0,
        "probe_models": (BASELINE, *probed) if probed else (),
        "system_prompt": policy.deployment.system_prompt,
        "chat_template": policy.deployment.chat_template,
    }


def measure(engine: Any, variant: Variant, config: MeasureConfig, out: Path) -> list[str]:
    """Teacher-force the held text and run the probes this model is due; returns the files written."""
    paths = []
    if config.fidelity_chunks:
        plan = F.FidelityPlan(chunks=config.fidelity_chunks, chunk_tokens=config.fidelity_chunk_tokens,
                              first_chunk=config.split * config.fidelity_chunks)
        paths.append(str(F.save(F.teacher_force(engine, plan), out / FIDELITY_FILE)))
    if variant.name in config.probe_models:
        plan = L.ProbePlan(lengths=tuple(config.probe_lengths), probes_per_length=config.probes_per_length,
                           seed=config.split)  # a held-out split draws other keys and fillers
        plan = plan.capped(int(engine.max_model_len))
        paths.append(str(L.save(L.run_probes(engine, plan), plan, out / PROBES_FILE)))
    return paths


def compare(base_dir: Path, var_dir: Path, out: Path) -> tuple[dict[str, float], list[Path]]:
    """Variant against baseline from the files `measure` wrote in each model's measure directory."""
    metrics: dict[str, float] = {}
    report: dict = {}
    if (base_dir / FIDELITY_FILE).is_file() and (var_dir / FIDELITY_FILE).is_file():
        r = F.compare(F.load(base_dir / FIDELITY_FILE), F.load(var_dir / FIDELITY_FILE))
        metrics.update(fidelity_metrics(r))
        report["fidelity"] = asdict(r)
    if (base_dir / PROBES_FILE).is_file() and (var_dir / PROBES_FILE).is_file():
        rows = L.compare(L.load(base_dir / PROBES_FILE), L.load(var_dir / PROBES_FILE))
        for row in rows.values():
            metrics.update(long_context_metrics(row))
        report["long_context"] = {str(n): asdict(row) for n, row in rows.items()}
    if not report:
        return metrics, []
    out.mkdir(parents=True, exist_ok=True)
    path = out / REPORT_FILE
    path.write_text(json.dumps(report, indent=1))
    return metrics, [path]


def fidelity_metrics(r: Any) -> dict[str, float]:
    return {G.FIDELITY_KL: r.kl, G.ci_key(G.FIDELITY_KL, "low"): r.kl_ci_low,
            G.ci_key(G.FIDELITY_KL, "high"): r.kl_ci_high, G.FIDELITY_FLIP_RATE: r.flip_rate,
            G.ci_key(G.FIDELITY_FLIP_RATE, "low"): r.flip_ci_low, G.ci_key(G.FIDELITY_FLIP_RATE, "high"): r.flip_ci_high,
            G.FIDELITY_POSITIONS: float(r.positions), G.FIDELITY_TAIL_MASS: r.tail_mass}


def long_context_metrics(row: Any) -> dict[str, float]:
    values = {"baseline": row.baseline, "variant": row.variant, "delta": row.delta, "delta_ci_low": row.ci_low,
              "delta_ci_high": row.ci_high, "n": float(row.n)}
    return {G.long_context_key(row.length, f): float(v) for f, v in values.items()}
