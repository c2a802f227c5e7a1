"""The release's decision: the variants approved (automatically, or by a person through the paused flow),
recorded per variant, and the one the canary then tries."""

from __future__ import annotations

from flows import records
from flows.approval import Decision, auto_decision, offers, undecided, wait_for_decision
from flows.data import ReleaseSummary, VariantResult
from flows.progress import note, stage
from gates.records.registry import record_approval


def approve_variants(summary: ReleaseSummary, candidates: list[str], mode: str, timeout_s: int) -> Decision:
    """The approval of `candidates` (auto: all of them; manual: a person, through the paused flow), recorded in
    MLflow per variant, with every row's decision filled in."""
    rows = {r.name: r for r in summary.rows}
    offered = offers(summary.rows[1:]) if mode == "manual" else []  # blocked only by blind gates: a person decides
    if not candidates and not offered:
        for r in summary.rows[1:]:
            r.decision = undecided(r)
        return Decision({}, "", "")
    if mode == "auto":
        decision = auto_decision(candidates, {r.name: r.gates_uninformative for r in summary.rows[1:]})
    else:
        with stage(f"waiting for approval of {', '.join(candidates + [o.variant for o in offered])}"):
            report = records.approval_report(summary)
            note(f"paused for approval: quantgate approve {summary.flow_run_id} [--reject] --comment '...'")
            decision = wait_for_decision(report, candidates, timeout_s, offered=offered)
    for name, approved in decision.approved.items():
        verdict = "approved" if approved else "rejected"
        record_approval(summary.model, rows[name].version, by=decision.by, decision=verdict, comment=decision.comment)
        rows[name].decision = f"{verdict} by {decision.by}"
    for r in summary.rows[1:]:
        if not r.decision:
            r.decision = undecided(r)
    records.tag_release(summary.release_run_id, {"approval.mode": mode, "approval.by": decision.by,
                                                "approval.comment": decision.comment[:5000]})
    return decision


def choose(summary: ReleaseSummary, decision: Decision) -> VariantResult | None:
    """The approved variant the canary tries: the smallest in weight bytes (then by name)."""
    approved = [r for r in summary.rows if decision.approved.get(r.name)]
    if not approved:
        return None
    return min(approved, key=lambda r: (r.weight_bytes if r.weight_bytes is not None else float("inf"), r.name))
