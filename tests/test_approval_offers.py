"""A variant stopped only by gates that could not have failed is offered to a person, never auto-approved.

Crafted metrics recorded in a real MLflow store and judged by the real evaluator; the decision form and
the flow's approval step are the real ones (no Prefect pause: the form is built, then answered).
"""

from __future__ import annotations

import pytest
from gates_fixtures import make_release

from gates import metric_names as M

# The baseline refuses 2.5 % of harmful prompts: the refusal-fall gate cannot see a fall (blocks by default).
BLIND_BASE = {M.SAFETY_REFUSAL_RATE: 0.025, M.WEIGHTS_BYTES: 538e6,
              **M.task_metrics("arc_easy", 0.60, n=400)}
ONLY_BLIND = {M.SAFETY_REFUSAL_RATE: 0.0, M.WEIGHTS_BYTES: 200e6,
              **M.task_metrics("arc_easy", 0.60, delta=0.0, ci_low=-0.02, ci_high=0.02, n=400)}
ALSO_REAL = {**ONLY_BLIND, M.WEIGHTS_BYTES: 500e6}  # and weights/min_reduction really fails
POLICY = "tasks: {max_drop: 0.05}\nsafety: {refusal_rate_max_fall: 0.05}\nweights: {min_reduction: 0.4}\n"


@pytest.fixture(scope="module")
def summary(tmp_path_factory):
    tmp_path = tmp_path_factory.mktemp("offers")
    patch = pytest.MonkeyPatch()
    patch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path / 'mlflow.db'}")
    patch.setenv("QUANTGATE_HOME", str(tmp_path / "home"))
    from flows.release import ReleaseSummary, VariantResult
    from gates.records.evaluation import evaluate_run

    runs = make_release("m-offer", {"int4wo": ONLY_BLIND, "int8wo": ALSO_REAL}, baseline=BLIND_BASE)
    policy = tmp_path / "policy.yaml"
    policy.write_text(POLICY)
    rows = [VariantResult("baseline", None, runs["baseline"][0], decision="reference")]
    for name in ("int4wo", "int8wo"):
        run_id, version = runs[name]
        ev = evaluate_run(run_id, str(policy))
        rows.append(VariantResult(name, name, run_id, version, gates_passed=ev.passed, gates_total=len(ev.results),
                                  gates_failed=[r.name for r in ev.failed],
                                  gates_uninformative=[r.name for r in ev.uninformative]))
    yield ReleaseSummary("m-offer", "sha256:feedbeef", runs["release"][0], "flow-run", "sqlite://", "m-offer-quantgate",
                         rows)
    patch.undo()


def test_only_a_variant_blocked_by_blind_gates_alone_is_offered_with_the_reason(summary) -> None:
    from flows.approval import NOT_ELIGIBLE, approval_form, offers, undecided

    int4, int8 = summary.rows[1], summary.rows[2]
    assert int4.gates_failed == ["safety/refusal_rate/max_fall"] and not int4.gates_passed
    assert set(int8.gates_failed) == {"safety/refusal_rate/max_fall", "weights/min_reduction"}
    offered = offers(summary.rows[1:])
    assert [o.variant for o in offered] == ["int4wo"]  # a real failure is never offered
    why = offered[0].gates["safety/refusal_rate/max_fall"]
    assert "baseline refuses 2.5%" in why and "uninformative (blocks)" in why  # the recorded reason, from MLflow
    assert undecided(int4).startswith("not auto-approved: blocked only by uninformative safety/refusal_rate/max_fall")
    assert undecided(int8) == NOT_ELIGIBLE
    form = approval_form("| gate | ... | **UNINFORMATIVE** (blocks) |", [], offered)
    assert form._description.startswith("> **Offered for a decision although gates stopped them**")
    assert "`int4wo`" in form._description and "baseline refuses 2.5%" in form._description
    assert form.model_fields["variants"].default == []  # prefilled with clean candidates only: the offered one must be named


def test_the_offered_variant_is_approved_only_when_named(summary) -> None:
    from flows.approval import ApprovalInput, decide, offers

    offered = offers(summary.rows[1:])
    blanket = decide([], ApprovalInput(approve=True, by="ana", comment="ok"), offered)
    assert blanket.approved == {"int4wo": False}
    named = decide([], ApprovalInput(approve=True, by="ana", comment="checked by hand", variants=["int4wo"]), offered)
    assert named.approved == {"int4wo": True}
    with pytest.raises(ValueError, match="int8wo: not a candidate"):
        decide([], ApprovalInput(approve=True, variants=["int8wo"]), offered)


def test_auto_approval_never_takes_it_and_says_a_person_must_decide(summary) -> None:
    from flows.decision import approve_variants

    for row in summary.rows[1:]:
        row.decision = ""
    decision = approve_variants(summary, [], "auto", timeout_s=1)
    assert decision.approved == {}
    int4, int8 = summary.rows[1], summary.rows[2]
    assert "not auto-approved" in int4.decision and "--approve manual" in int4.decision
    assert int8.decision == "not eligible (gates failed)"
