"""The release as the time plan costs it (gates/time_plan.py ReleaseShape): its models, what each measure stage
runs, each weight method's build and the canary's replay, from the same inputs the flow reads."""

from __future__ import annotations

from flows.data import BASELINE
from flows.fidelity_stage import measure_config
from flows.recipes import parse
from gates.judging.policy import Policy
from gates.time_plan import CanaryShape, ReleaseShape
from quantize.capacity import split_variant, variant_label


def release_shape(policy: Policy, methods: list[str], suites: list[str] | None, limit: int | None,
                  canary_requests: int = 24, snapshot: bool = False) -> ReleaseShape:
    """Each weight method is built once (int4wo and int4wo+kv8 share it: flows.release._quantize_all)."""
    from flows.canary_stage import MAX_TOKENS, REPLAY_CONCURRENCY

    weights = [m for m in dict.fromkeys(split_variant(m)[0] for m in methods) if m != BASELINE]
    recipes = [(m, parse(m)) for m in weights]
    return ReleaseShape(models=[BASELINE, *map(variant_label, methods)],
                        measure=measure_config(policy, methods, suites, limit).time_shape(), limit=limit,
                        quantize=tuple((m, r.method, dict(r.options)) for m, r in recipes),
                        canary=CanaryShape(canary_requests, REPLAY_CONCURRENCY, MAX_TOKENS),
                        weights={variant_label(m): split_variant(m)[0] for m in methods
                                 if split_variant(m)[0] != BASELINE},
                        snapshot=snapshot)


def first_release_snapshot(model: str) -> bool:
    """Whether a release of `model` in this home copies it for the registry first: no champion yet, and a
    source outside the home (flows.records.snapshot_first_release)."""
    from flows.records import first_release_copies
    from flows.release import model_name
    from quantgate.models import resolve_model

    path = resolve_model(model)
    return first_release_copies(path, model_name(model, path))
