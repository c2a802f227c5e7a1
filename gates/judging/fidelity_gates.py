"""The fidelity and long-context gates (called from `gates.judging.judge.judge`), and their metric keys.

Fidelity, non-inferiority on the CI's high end: `fidelity/kl_ci_high <= max_kl` and
`fidelity/flip_rate_ci_high <= max_flip_rate` (the variant must show its divergence from the baseline
is at most the threshold; a point estimate under it with a CI above it fails).

Long context, per probed length L, on the paired retrieval-accuracy delta (variant - baseline):
`long_context/L/delta_ci_low >= -max_drop`. It is `uninformative` where the baseline itself fails the
probe (accuracy below `min_baseline_accuracy`, or within `max_drop` of 0: a variant retrieving nothing
would pass), acted on as the policy's `sensitivity.tasks` says; a CI wider than `max_drop` that turns a
point delta within it into a failure fails, its reason saying so (measure more probes). A gate exists
for every length the variant recorded: the flow probes the variants the policy names
(`long_context.variants`).

The verdicts are `gates.judging.speed_verdicts`'s three-outcome records; `gates.records.evaluation` turns them into gate results.
"""

from __future__ import annotations

import re
from collections.abc import Mapping

from gates.judging.policy import Policy
from gates.judging.speed_verdicts import FAIL, PASS, UNINFORMATIVE, SpeedVerdict

FIDELITY_KL = "fidelity/kl"
FIDELITY_FLIP_RATE = "fidelity/flip_rate"
FIDELITY_POSITIONS = "fidelity/positions"
FIDELITY_TAIL_MASS = "fidelity/tail_mass"  # baseline mass outside the partition the KL sees
LONG_CONTEXT_FIELDS = ("baseline", "variant", "delta", "delta_ci_low", "delta_ci_high", "n")
_LC_RE = re.compile(r"^long_context/(\d+)/delta_ci_low$")
_EPS = 1e-9


def ci_key(key: str, bound: str) -> str:
    return f"{key}_ci_{bound}"


def long_context_key(length: int, field: str) -> str:
    if field not in LONG_CONTEXT_FIELDS:
        raise ValueError(f"unknown long-context field {field!r} (known: {', '.join(LONG_CONTEXT_FIELDS)})")
    return f"long_context/{int(length)}/{field}"


def probed_lengths(metrics: Mapping[str, float]) -> list[int]:
    return sorted(int(m.group(1)) for key in metrics if (m := _LC_RE.match(key)))


def verdicts(policy: Policy, variant: Mapping[str, float]) -> list[tuple[SpeedVerdict, str]]:
    """Each gate's three-outcome verdict (`gates.records.evaluation` turns them into gate results) and the
    sensitivity family whose policy action an `uninformative` one takes."""
    return [(v, "tasks") for v in fidelity_verdicts(policy, variant) + long_context_verdicts(policy, variant)]


def _at_most(name: str, rule: str, observed: float, limit: float, detail: str) -> SpeedVerdict:
    ok = observed <= limit + _EPS
    return SpeedVerdict(name, rule, limit, observed, PASS if ok else FAIL,
                        f"{observed:+.4g} {'<=' if ok else '>'} {limit:+.4g}{detail}")


def fidelity_verdicts(policy: Policy, variant: Mapping[str, float]) -> list[SpeedVerdict]:
    out = []
    gate = policy.fidelity
    for key, limit, name, what in ((FIDELITY_KL, gate.max_kl, "fidelity/kl/max", "KL(baseline || variant)"),
                                   (FIDELITY_FLIP_RATE, gate.max_flip_rate, "fidelity/flip_rate/max",
                                    "top-1 flip rate")):
        if limit is None:
            continue
        rule, high = f"{what} CI high <= max", ci_key(key, "high")
        if high not in variant:
            out.append(SpeedVerdict(name, rule, limit, None, "", f"not measured: {high} (variant) not recorded"))
            continue
        detail = f" (point {variant.get(key, float('nan')):.4g}"
        if FIDELITY_POSITIONS in variant:
            detail += f", {int(variant[FIDELITY_POSITIONS])} positions"
        out.append(_at_most(name, rule, variant[high], limit, detail + ")"))
    return out


def long_context_verdicts(policy: Policy, variant: Mapping[str, float]) -> list[SpeedVerdict]:
    gate = policy.long_context
    if gate.max_drop is None:
        return []
    out = []
    for length in probed_lengths(variant):
        name, rule = f"long_context/{length}/max_drop", "retrieval delta CI low >= -max_drop"
        get = {f: variant.get(long_context_key(length, f)) for f in LONG_CONTEXT_FIELDS}
        low, threshold = get["delta_ci_low"], -gate.max_drop
        ok = low >= threshold - _EPS
        reason = f"{low:+.4g} {'>=' if ok else '<'} {threshold:+.4g}"
        if get["baseline"] is not None:
            reason += (f" (baseline {get['baseline']:.3g}, variant {get['variant'] or 0.0:.3g}, "
                       f"n={int(get['n'] or 0)})")
        verdict = PASS if ok else FAIL
        why = _blind(gate, get, length)
        if why and ok:
            verdict, reason = UNINFORMATIVE, f"{why}; measured {reason}"
        elif not ok and get["delta"] is not None and get["delta"] >= threshold and get["delta_ci_high"] is not None \
                and (get["delta_ci_high"] - low) / 2 > gate.max_drop:
            reason += (f"; the paired CI half-width {(get['delta_ci_high'] - low) / 2:.3g} is wider than max_drop: "
                       "it cannot pass a good variant at this n (measure more probes)")
        out.append(SpeedVerdict(name, rule, threshold, low, verdict, reason))
    return out


def _blind(gate, get: Mapping[str, float | None], length: int) -> str:
    """Why the gate could not have failed: the baseline itself does not retrieve ('' if it does)."""
    base_acc = get["baseline"]
    floor = max(gate.min_baseline_accuracy, gate.max_drop + 1e-9)
    if base_acc is None or base_acc >= floor:
        return ""
    return (f"the baseline retrieves {base_acc:.0%} of pass keys at {length} tokens (< {floor:.0%}): "
            "a variant retrieving none would not be refused")
