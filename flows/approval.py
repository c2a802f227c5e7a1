"""Release-manager approval: the flow pauses showing the gate report; a person resumes it with a decision.

In the flow: `wait_for_decision(report, candidates, offered=...)` pauses with `pause_flow_run(wait_for_input=...)`.
`offered` are variants stopped only by `uninformative` gates (`offers`): never auto-approved, shown first in
the form with each blind gate's reason, approved only when the release manager names them.
From anywhere that reaches the same Prefect API: the Prefect UI's resume form, or
`quantgate approve RUN_ID [--reject] --comment ...` which calls `submit_decision`. The flow records the
decision in MLflow (`gates.records.registry.record_approval`) once it resumes, whichever way it was resumed.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any
from uuid import UUID

from prefect import get_client, pause_flow_run
from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterState, FlowRunFilterStateType
from prefect.client.schemas.objects import StateType
from prefect.client.schemas.sorting import FlowRunSort
from prefect.exceptions import ObjectNotFound
from prefect.flow_runs import resume_flow_run
from prefect.input import RunInput

from gates.judging.verdicts import UNINFORMATIVE
from quantgate import settings

AUTO_APPROVER = "quantgate-auto"
APPROVE_MODES = ("auto", "manual")


class ApprovalInput(RunInput):
    """What the release manager fills in (the Prefect UI renders this as a form)."""

    approve: bool = True
    comment: str = ""
    by: str = ""
    variants: list[str] = []  # empty: the decision covers every candidate


@dataclass(frozen=True)
class Decision:
    approved: dict[str, bool]  # candidate variant -> approved?
    by: str
    comment: str


@dataclass(frozen=True)
class Offer:
    """A variant stopped only by `uninformative` gates: never auto-approved, offered to a person."""

    variant: str
    gates: dict[str, str] = field(default_factory=dict)  # blocking blind gate -> why it could not have failed


NOT_ELIGIBLE = "not eligible (gates failed)"


def blind_blockers(row: Any) -> list[str]:
    """The gates stopping a variant when every one of them is uninformative (else [])."""
    failed = list(getattr(row, "gates_failed", None) or [])
    blind = set(getattr(row, "gates_uninformative", None) or [])
    if getattr(row, "gates_passed", None) is not False or not failed or not set(failed) <= blind:
        return []
    return failed


def recorded_reasons(run_id: str) -> dict[str, str]:
    """Each gate's recorded reason on a variant's MLflow run (what `gates.md` shows). MLflow is imported here,
    late: `quantgate approve`, `notify` and `watch` import this module and never need it."""
    from gates.records.evaluation import read_evaluation

    evaluation = read_evaluation(run_id, "release")
    return {} if evaluation is None else {r.name: r.reason for r in evaluation.results}


def offers(rows: Iterable[Any], reasons: Callable[[str], dict[str, str]] = recorded_reasons) -> list[Offer]:
    """The variants a release manager may still approve although their gates did not all pass."""
    out = []
    for row in rows:
        gates = blind_blockers(row)
        if gates:
            why = reasons(row.run_id)
            out.append(Offer(row.name, {g: why.get(g, "could not have failed at this baseline and n") for g in gates}))
    return out


def undecided(row: Any) -> str:
    """The decision text of a variant nobody approved: failed, or blind and waiting for a person."""
    gates = blind_blockers(row)
    if not gates:
        return NOT_ELIGIBLE
    return (f"not auto-approved: blocked only by uninformative {', '.join(gates)}; a person decides "
            "(--approve manual offers it) or a rerun with more items")


def offer_section(offered: Sequence[Offer]) -> str:
    """The form's lead when some variant is offered although blind gates stopped it."""
    if not offered:
        return ""
    lines = ["> **Offered for a decision although gates stopped them**: each of these was blocked only by gates",
             "> that could not have failed (`uninformative`), so nothing was measured against it. Approving one",
             "> waives those gates on your judgement (recorded with your name); it is approved only if you",
             "> name it in `variants` (`quantgate approve RUN_ID --variant NAME --comment ...`).", ">"]
    for o in offered:
        lines.append(f"> - `{o.variant}`:")
        lines += [f">   - `{gate}`: {why}" for gate, why in o.gates.items()]
    return "\n".join(lines) + "\n\n"


def current_user() -> str:
    return settings.user()


def auto_decision(candidates: list[str], blind: Mapping[str, Sequence[str]] | None = None) -> Decision:
    """`--approve auto`: every variant whose gates all passed is approved, nothing else. `blind`: each
    candidate's uninformative gates (reported, not blocking): the rule is unchanged, but the words say that
    those gates passed only because they could not have failed, and that a person must judge them."""
    return Decision({v: True for v in candidates}, AUTO_APPROVER, auto_comment(candidates, blind or {}))


def auto_comment(candidates: Sequence[str], blind: Mapping[str, Sequence[str]]) -> str:
    unjudged = {v: list(blind.get(v) or []) for v in candidates if blind.get(v)}
    if not unjudged:
        return "auto-approved: every release gate passed"
    count = sum(len(g) for g in unjudged.values())
    which = "; ".join(f"{v}: {', '.join(g)}" for v, g in unjudged.items())
    return (f"auto-approved: gates passed, with {count} uninformative gate{'s' if count > 1 else ''} a person "
            f"must judge ({which})")


def decide(candidates: list[str], answer: ApprovalInput, offered: Sequence[Offer] = ()) -> Decision:
    """Turn the resume form into a per-candidate decision; naming a non-candidate is an error.

    A variant offered only because its blocking gates were blind (`offered`) is approved only when the
    form names it: a blanket "approve" never waives a gate that saw nothing."""
    blind = [o.variant for o in offered]
    everyone = [*candidates, *(v for v in blind if v not in candidates)]
    unknown = sorted(set(answer.variants) - set(everyone))
    if unknown:
        raise ValueError(
            f"cannot decide on {', '.join(unknown)}: not a candidate (candidates: {', '.join(everyone) or 'none'})"
        )
    chosen = set(answer.variants or candidates)
    candidates = everyone
    by = answer.by.strip() or "unknown (resumed without a name)"
    return Decision({v: answer.approve and v in chosen for v in candidates}, by, answer.comment)


UNINFORMATIVE_BANNER = ("> **Some gates could not have failed** at this baseline and sample size (`uninformative` "
                        "below): they are no evidence either way. Judge those yourself before approving.\n\n")


def form_description(report_markdown: str) -> str:
    """The resume form's text: the gate report, led by a warning when any gate was uninformative."""
    if f"**{UNINFORMATIVE.upper()}**" in report_markdown or f"{UNINFORMATIVE} (reported)" in report_markdown:
        return UNINFORMATIVE_BANNER + report_markdown
    return report_markdown


def approval_form(report_markdown: str, candidates: list[str], offered: Sequence[Offer] = ()):
    """The resume form: offered variants and blind gates first, then the gate report."""
    return ApprovalInput.with_initial_data(description=offer_section(offered) + form_description(report_markdown),
                                           approve=True, variants=list(candidates))


def wait_for_decision(report_markdown: str, candidates: list[str], timeout_s: int, poll_interval_s: int = 2,
                      offered: Sequence[Offer] = ()) -> Decision:
    """Pause the running flow until someone approves or rejects; FlowPauseTimeout when nobody does.
    The form is prefilled with the clean candidates only; an offered variant must be added by name."""
    form = approval_form(report_markdown, candidates, offered)
    answer = pause_flow_run(wait_for_input=form, timeout=timeout_s, poll_interval=poll_interval_s)
    return decide(candidates, answer, offered)


def _parse_run_id(run_id: str) -> UUID:
    try:
        return UUID(str(run_id).strip())
    except ValueError:
        raise ValueError(f"{run_id!r} is not a Prefect flow run id (a UUID, printed when the release paused)") from None


def paused_runs() -> list:
    """Flow runs of the release flow that wait for a decision (newest first)."""
    with get_client(sync_client=True) as client:
        state = FlowRunFilterState(type=FlowRunFilterStateType(any_=[StateType.PAUSED]))
        return client.read_flow_runs(flow_run_filter=FlowRunFilter(state=state), sort=FlowRunSort.START_TIME_DESC)


def submit_decision(run_id: str, approve: bool, comment: str, by: str | None = None,
                    variants: list[str] | None = None, wait_s: float = 0.0) -> str:
    """Resume a paused release with a decision; returns the run's state name after `wait_s` seconds."""
    flow_run_id = _parse_run_id(run_id)
    if not comment.strip():
        raise ValueError("a decision needs a --comment (it is recorded in MLflow beside who and when)")
    with get_client(sync_client=True) as client:
        try:
            run = client.read_flow_run(flow_run_id)
        except ObjectNotFound:
            raise ValueError(f"no flow run {flow_run_id} in this Prefect API ({os.environ.get('PREFECT_API_URL') or 'local'})") from None
        if run.state is None or not run.state.is_paused():
            state = run.state.name if run.state else "no state"
            raise ValueError(f"flow run {flow_run_id} ({run.name}) is {state}, not paused for approval")
    answer = {"approve": approve, "comment": comment, "by": by or current_user(), "variants": list(variants or [])}
    resume_flow_run(flow_run_id, run_input=answer)
    deadline = time.monotonic() + wait_s
    with get_client(sync_client=True) as client:
        state = client.read_flow_run(flow_run_id).state
        while time.monotonic() < deadline and not (state and state.is_final()):
            time.sleep(1.0)
            state = client.read_flow_run(flow_run_id).state
    return state.name if state else "unknown"
