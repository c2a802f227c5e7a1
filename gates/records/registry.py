"""Promotion by registered-model alias: `champion` is in production, `challenger` is under review.

`promote` refuses unless the version's recorded release gates all passed (and any recorded canary gates
passed) and an approval was recorded after the latest gate evaluation. Every alias move is written as
a registered-model tag `alias_history/<seq>` (JSON: alias, version, previous, kind, at, by, reason), so
the history can be read back and `rollback` can walk the champion lineage.
"""

from __future__ import annotations

import datetime as dt
import json
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING

from gates.records.evaluation import read_evaluation
from gates.records.tracking import get_client, registered_model_name
from quantgate import settings

if TYPE_CHECKING:
    from mlflow import MlflowClient
    from mlflow.entities.model_registry import ModelVersion

CHAMPION = "champion"
CHALLENGER = "challenger"
HISTORY_PREFIX = "alias_history/"
APPROVAL_TAGS = ("decision", "by", "at", "comment")
DECISIONS = ("approved", "rejected")


class PromotionRefused(ValueError):
    def __init__(self, model: str, version: str, reasons: list[str]):
        self.reasons = reasons
        super().__init__(f"promotion of {model} v{version} refused: " + "; ".join(reasons))


@dataclass(frozen=True)
class Approval:
    decision: str
    by: str
    at: str
    comment: str


@dataclass(frozen=True)
class AliasMove:
    seq: int
    alias: str
    version: str | None  # None: the alias was removed
    previous: str | None
    kind: str  # "initial" | "promote" | "rollback" | "challenger" | "clear"
    at: str
    by: str
    reason: str


def _now() -> str:
    return dt.datetime.now(dt.UTC).isoformat(timespec="milliseconds")


def _user(by: str | None) -> str:
    return by or settings.user()


def resolve_registered_model(model: str, client: MlflowClient | None = None) -> str:
    """Accept the registered name (`smollm2-135m-quantgate`) or the source model name (`smollm2-135m`)."""
    from mlflow.exceptions import MlflowException

    client = client or get_client()
    for name in (model, registered_model_name(model)):
        try:
            client.get_registered_model(name)
            return name
        except MlflowException as exc:
            if exc.error_code != "RESOURCE_DOES_NOT_EXIST":  # the store failed: say so, don't blame the name
                where = getattr(client, "_registry_uri", "?")
                raise ConnectionError(f"could not read the MLflow registry at {where}: {exc.message}") from exc
    raise ValueError(f"no registered model {model!r} (nor {registered_model_name(model)!r}) in the MLflow registry")


def _version(client: MlflowClient, name: str, version: str | int) -> ModelVersion:
    from mlflow.exceptions import MlflowException

    try:
        return client.get_model_version(name, str(version))
    except MlflowException:
        raise ValueError(f"registered model {name!r} has no version {version!r}") from None


def _aliases(client: MlflowClient, name: str) -> dict[str, str]:
    return {k: str(v) for k, v in (client.get_registered_model(name).aliases or {}).items()}


def record_approval(
    model: str, version: str | int, by: str, decision: str = "approved", comment: str = ""
) -> Approval:
    """Record a release manager's decision on a version (and mirror it on the version's run)."""
    if decision not in DECISIONS:
        raise ValueError(f"decision must be one of {', '.join(DECISIONS)}, not {decision!r}")
    if not by or not by.strip():
        raise ValueError("an approval needs the approver's name (by)")
    client = get_client()
    name = resolve_registered_model(model, client)
    mv = _version(client, name, version)
    approval = Approval(decision=decision, by=by.strip(), at=_now(), comment=comment)
    for f in APPROVAL_TAGS:
        client.set_model_version_tag(name, mv.version, f"approval.{f}", getattr(approval, f))
        if mv.run_id:
            client.set_tag(mv.run_id, f"approval.{f}", getattr(approval, f))
    return approval


def read_approval(model: str, version: str | int) -> Approval | None:
    client = get_client()
    name = resolve_registered_model(model, client)
    tags = _version(client, name, version).tags
    if "approval.decision" not in tags:
        return None
    return Approval(**{f: tags.get(f"approval.{f}", "") for f in APPROVAL_TAGS})


def alias_history(model: str) -> list[AliasMove]:
    client = get_client()
    name = resolve_registered_model(model, client)
    tags = client.get_registered_model(name).tags
    moves = [AliasMove(**json.loads(v)) for k, v in tags.items() if k.startswith(HISTORY_PREFIX)]
    return sorted(moves, key=lambda m: m.seq)


def _move(client: MlflowClient, name: str, alias: str, version: str | None, kind: str, reason: str, by: str | None) -> AliasMove:
    current = _aliases(client, name).get(alias)
    seq = 1 + sum(1 for k in client.get_registered_model(name).tags if k.startswith(HISTORY_PREFIX))
    move = AliasMove(
        seq=seq,
        alias=alias,
        version=version,
        previous=current,
        kind=kind,
        at=_now(),
        by=_user(by),
        reason=reason[:2000],
    )
    if version is None:
        client.delete_registered_model_alias(name, alias)
    else:
        client.set_registered_model_alias(name, alias, version)
    client.set_registered_model_tag(name, f"{HISTORY_PREFIX}{seq:05d}", json.dumps(asdict(move)))
    return move


def check_promotable(model: str, version: str | int) -> list[str]:
    """Why this version may not become champion (empty when it may), from what MLflow recorded."""
    client = get_client()
    name = resolve_registered_model(model, client)
    mv = _version(client, name, version)
    reasons: list[str] = []
    if _aliases(client, name).get(CHAMPION) == str(mv.version):
        reasons.append(f"v{mv.version} is already the champion")
    if not mv.run_id:
        return reasons + ["the version is not linked to a run, so no gates were recorded"]
    release = read_evaluation(mv.run_id, "release", client)
    if release is None:
        reasons.append("no gate evaluation recorded (run `quantgate gates evaluate` first)")
    elif release.extra.get("verdict") != "pass" or not release.passed or not release.results:
        if release.extra.get("verdict") == "pending":
            reasons.append("the gate evaluation was not completed")
        for r in release.failed:
            reasons.append(f"gate {r.name} failed: {r.reason}")
    canary = read_evaluation(mv.run_id, "canary", client)
    if canary is not None and (canary.extra.get("verdict") != "pass" or not canary.passed):
        reasons += [f"canary gate {r.name} failed: {r.reason}" for r in canary.failed] or ["canary gates not passed"]
    approval = read_approval(name, mv.version)
    if approval is None:
        reasons.append("no approval recorded (who, when, comment)")
    elif approval.decision != "approved":
        reasons.append(f"approval decision is {approval.decision!r} by {approval.by} at {approval.at}: {approval.comment}")
    elif release is not None and approval.at < release.evaluated_at:
        reasons.append(f"the approval ({approval.at}) predates the latest gate evaluation ({release.evaluated_at})")
    return reasons


def set_challenger(model: str, version: str | int, reason: str = "", by: str | None = None) -> AliasMove:
    client = get_client()
    name = resolve_registered_model(model, client)
    mv = _version(client, name, version)
    return _move(client, name, CHALLENGER, str(mv.version), "challenger", reason or "candidate under review", by)


def promote(model: str, version: str | int, reason: str = "", by: str | None = None) -> AliasMove:
    """Make `version` the champion, or raise PromotionRefused naming every reason."""
    client = get_client()
    name = resolve_registered_model(model, client)
    mv = _version(client, name, version)
    reasons = check_promotable(name, mv.version)
    if reasons:
        raise PromotionRefused(name, str(mv.version), reasons)
    approval = read_approval(name, mv.version)
    why = reason or f"gates passed; approved by {approval.by} at {approval.at}"
    move = _move(client, name, CHAMPION, str(mv.version), "promote", why, by)
    if _aliases(client, name).get(CHALLENGER) == str(mv.version):
        _move(client, name, CHALLENGER, None, "clear", f"v{mv.version} promoted to champion", by)
    return move


def set_initial_champion(model: str, version: str | int, reason: str = "", by: str | None = None) -> AliasMove:
    """The first champion of a model: a registered baseline (the reference, which has no gates of its own).

    Refused once any champion exists; from then on only `promote` (gates + approval) and `rollback` move it.
    """
    client = get_client()
    name = resolve_registered_model(model, client)
    mv = _version(client, name, version)
    current = _aliases(client, name).get(CHAMPION)
    if current is not None:
        raise ValueError(f"{name} already has a champion (v{current}); use promote")
    if mv.tags.get("role") != "baseline":
        raise ValueError(f"{name} v{mv.version} is not a baseline version; a variant becomes champion via promote")
    return _move(client, name, CHAMPION, str(mv.version), "initial", reason or "initial champion: the baseline", by)


def clear_challenger(
    model: str, reason: str = "", version: str | int | None = None, by: str | None = None
) -> AliasMove | None:
    """Remove the `challenger` alias (only if it points at `version`, when given); None when nothing moved.

    The version that was challenger gets the tag `challenger_cleared` with the reason (e.g. a failed canary).
    """
    client = get_client()
    name = resolve_registered_model(model, client)
    current = _aliases(client, name).get(CHALLENGER)
    if current is None or (version is not None and str(version) != current):
        return None
    move = _move(client, name, CHALLENGER, None, "clear", reason or "challenger withdrawn", by)
    client.set_model_version_tag(name, current, "challenger_cleared", f"{move.at}: {move.reason}"[:5000])
    return move


def champion_lineage(history: list[AliasMove]) -> list[str]:
    """The stack of champions: promotions push, rollbacks pop."""
    stack: list[str] = []
    for move in history:
        if move.alias != CHAMPION or move.version is None:
            continue
        if move.kind == "rollback":
            stack.pop()
        else:
            stack.append(move.version)
    return stack


def rollback(model: str, reason: str = "", by: str | None = None) -> AliasMove:
    """Move `champion` back to the champion before the current one."""
    client = get_client()
    name = resolve_registered_model(model, client)
    current = _aliases(client, name).get(CHAMPION)
    if current is None:
        raise ValueError(f"{name} has no champion to roll back")
    lineage = champion_lineage(alias_history(name))
    if not lineage or lineage[-1] != current:
        raise ValueError(
            f"{name}@champion is v{current} but the recorded alias history says "
            f"{'v' + lineage[-1] if lineage else 'nothing'}; the alias was moved outside quantgate"
        )
    if len(lineage) < 2:
        raise ValueError(f"{name}@champion v{current} has no previous champion to roll back to")
    target = lineage[-2]
    move = _move(client, name, CHAMPION, target, "rollback", reason or f"rollback from v{current}", by)
    client.set_model_version_tag(name, current, "rolled_back_at", move.at)
    client.set_model_version_tag(name, current, "rolled_back_reason", move.reason)
    return move


def alias_history_markdown(model: str) -> str:
    """The alias moves as a table a person reads (the `alias_history/<seq>` tags are JSON, one per move)."""
    name = resolve_registered_model(model)
    current = aliases(name)
    lines = [f"# Alias history of `{name}`", "",
             "Now: " + (", ".join(f"**@{a}** → v{v}" for a, v in sorted(current.items())) or "no aliases"), "",
             "| # | when (UTC) | alias | move | from | to | by | reason |",
             "| ---: | --- | --- | --- | --- | --- | --- | --- |"]
    for m in alias_history(name):
        reason = m.reason.replace("|", "\\|").replace("\n", " ")
        lines.append(f"| {m.seq} | {m.at[:19].replace('T', ' ')} | @{m.alias} | {m.kind} | "
                     f"{'v' + m.previous if m.previous else '—'} | {'v' + m.version if m.version else 'removed'} | "
                     f"{m.by} | {reason} |")
    return "\n".join(lines) + "\n"


def aliases(model: str) -> dict[str, str]:
    client = get_client()
    return _aliases(client, resolve_registered_model(model, client))


__all__ = [
    "CHAMPION",
    "CHALLENGER",
    "Approval",
    "AliasMove",
    "PromotionRefused",
    "alias_history",
    "alias_history_markdown",
    "aliases",
    "check_promotable",
    "champion_lineage",
    "clear_challenger",
    "promote",
    "read_approval",
    "record_approval",
    "resolve_registered_model",
    "rollback",
    "set_challenger",
    "set_initial_champion",
]
