"""`quantgate tune`'s records: one row per candidate, the result, its file, and the report printed at the end.

The result file (`tune.json`: `QUANTGATE_HOME/flows/tune/<model>-<source hash[:12]>.json`, and `--json`)
names the chosen recipe; `quantgate release --recipe-from-tune FILE` releases exactly that recipe.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

# A candidate's status, in the order the search can leave it
REFUSED = "refused"  # not built: its group size does not divide the model, or the method refused it
FAILED = "failed"  # built, measured, judged on the search split: a gate stopped it
HELD_OUT_FAILED = "held-out failed"  # passed the search split, failed on the held-out items
CHOSEN = "chosen"  # passed every gate on the search split and again on the held-out items
UNCONFIRMED = "unconfirmed"  # passed the search split, but every held-out split was used: never chosen
NOT_TRIED = "not tried"  # after the chosen one


@dataclass
class CandidateRow:
    name: str  # recipe as a release method: "int4_awq_g64+kv8"
    method: str  # quantize method and options: "int4-awq group_size=64"
    kv_cache_dtype: str
    estimated_weight_bytes: int
    status: str = NOT_TRIED
    reason: str = ""  # a refusal's reason
    weight_bytes: float | None = None  # as served (measured)
    run_id: str = ""  # the MLflow child run of the search split (its gate verdicts)
    gates_total: int = 0
    gates_failed: dict[str, str] = field(default_factory=dict)  # gate -> reason (search split)
    held_out_run_id: str = ""
    held_out_gates_failed: dict[str, str] | None = None  # None: not confirmed (yet)
    held_out_split: int | None = None  # the held-out split its confirmation took (each split once)
    speed_score: float | None = None  # objective fastest: geometric mean speed ratio of its layout


@dataclass
class TuneResult:
    model: str
    model_ref: str
    source_hash: str
    objective: str
    policy: str
    limit: int
    suites: list[str]
    tune_run_id: str
    held_out_run_id: str = ""  # the first held-out split's parent run
    held_out_run_ids: list[str] = field(default_factory=list)  # one parent run per held-out split, in order
    tracking_uri: str = ""
    rows: list[CandidateRow] = field(default_factory=list)
    chosen: str | None = None
    outcome: str = ""
    file: str = ""

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def default_file(model: str, source_hash: str) -> Path:
    from flows.runtime import work_dir

    return work_dir("tune") / f"{model}-{source_hash[:12]}.json"


def write(result: TuneResult, path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(result.as_dict(), indent=2, default=str))
    tmp.replace(path)
    return path


@dataclass(frozen=True)
class TunedRecipe:
    """What `quantgate release --recipe-from-tune FILE` takes from a tune result."""

    recipe: str  # as a release method: "int4_awq_g64+kv8"
    model_ref: str
    source_hash: str
    suites: list[str]  # the release gates the recipe again on the items the search judged it on
    limit: int
    policy: str


def chosen_recipe(path: str | Path) -> TunedRecipe:
    """The recipe a tune result file chose, with the suites, items per task and policy it was judged on;
    refuses a file that is not a tune result, or one that chose nothing."""
    p = Path(path).expanduser()
    if not p.is_file():
        raise ValueError(f"tune result file not found: {p}")
    try:
        data = json.loads(p.read_text())
        tuned = TunedRecipe(recipe=data["chosen"], model_ref=data["model_ref"], source_hash=data["source_hash"],
                            suites=list(data["suites"]), limit=int(data["limit"]), policy=str(data["policy"]))
    except (ValueError, KeyError, TypeError) as exc:
        raise ValueError(f"{p} is not a quantgate tune result ({exc!r})") from None
    if not tuned.recipe:
        raise ValueError(f"{p}: the tune run chose nothing ({data.get('outcome', '')}); nothing to release")
    if not tuned.suites or not all(isinstance(s, str) and s for s in tuned.suites) or tuned.limit < 1:
        raise ValueError(f"{p}: suites {tuned.suites!r} and items per task {tuned.limit!r} are not a tune's")
    return tuned


def render(result: dict[str, Any]) -> str:
    """Plain text: every candidate, what happened to it and why, then the outcome."""
    lines = [f"quantgate tune {result['model']} (objective {result['objective']}, policy {result['policy']}, "
             f"{result['limit']} items per task per split)", ""]
    width = max([len(r["name"]) for r in result["rows"]] + [9])
    lines.append(f"{'candidate':<{width}}  {'est. MB':>8}  status")
    for r in result["rows"]:
        lines.append(f"{r['name']:<{width}}  {r['estimated_weight_bytes'] / 1e6:>8.2f}  {_status(r)}")
    lines += ["", result["outcome"], f"MLflow tune run {result['tune_run_id']} ({result['tracking_uri']})",
              f"result file: {result['file']}"]
    if result["chosen"]:
        lines.append(f"release it: quantgate release --recipe-from-tune {result['file']}")
    return "\n".join(lines) + "\n"


def _status(r: dict[str, Any]) -> str:
    if r["status"] == REFUSED:
        return f"refused: {r['reason']}"
    if r["status"] == FAILED:
        return f"failed {len(r['gates_failed'])}/{r['gates_total']} gates: " + _gates(r["gates_failed"])
    if r["status"] == HELD_OUT_FAILED:
        return (f"passed {r['gates_total']} gates on the search items, failed on the held-out items: "
                + _gates(r["held_out_gates_failed"] or {}))
    if r["status"] == UNCONFIRMED:
        return f"UNCONFIRMED: {r['reason']}"
    if r["status"] == CHOSEN:
        return f"CHOSEN: passed all {r['gates_total']} gates on the search items and again on the held-out items"
    return r["status"]


def _gates(failed: dict[str, str]) -> str:
    return "; ".join(f"{name} ({reason})" for name, reason in failed.items())
