"""`quantgate tune MODEL --policy P`: the smallest (or fastest) recipe that passes every gate of the policy.

Candidates (`flows.recipes`: int4 groups 128/64/32 x RTN/AWQ/GPTQ, int8wo, each with and without an 8-bit
KV cache) are tried smallest first (`--objective fastest`: fastest layout first, by paired speed rounds).
A group size that does not divide the model is refused with its reason before anything is built. Each
candidate goes through the release's own stages (`flows.release`: quantize, measure, measure-speed, record,
evaluate-gates), cached the same way by content hash, so a second run quantizes and measures nothing.

The first candidate that passes every gate on the search split is confirmed on held-out items (the next
`limit` items of every task, the next windows of the fidelity text, other long-context keys, fresh speed
rounds) before it is reported as chosen: picking the first of many candidates that pass on the same items
favours lucky ones. If the confirmation fails, the search goes on with the next candidate, and its
confirmation takes a split no earlier confirmation used (split k: items k*limit .. (k+1)*limit - 1):
re-using a split that has already turned a candidate away would let the search pick, among many tries,
one that happens to pass those items. The tasks' items allow at most floor(items / limit) - 1
confirmations (items: the smallest task of the suites; the fidelity text's windows bound them too); a
candidate that passes the search split once they are used up is reported `unconfirmed` and never chosen.

MLflow: one parent run (tag `quantgate.tune=search`) with the baseline and a child per candidate carrying
its gate verdicts; the held-out measurements under a second parent nested in it (`quantgate.tune=held-out`).
"""

from __future__ import annotations

import json
import math
import time
from dataclasses import replace
from pathlib import Path
from typing import Literal

from prefect import flow
from prefect.runtime import flow_run
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from flows import fidelity_stage, measuring, recipes, records
from flows import release as R
from flows import tune_report as T
from flows.data import BASELINE, MeasureConfig, Measured, Source, SpeedPlan, Variant
from flows.machine import resolve_device
from flows.progress import note
from flows.speed_rounds import point_key
from gates import metric_names as M
from gates.judging.policy import Policy
from gates.records.tracking import end_release, get_client, tracking_uri
from quantgate.models import DEFAULT_MODEL
from quantize.capacity import split_variant, variant_label

FLOW_NAME = "quantgate-tune"
MAX_SPLIT_LIMIT = 75  # our own tasks hold 151-235 items: two disjoint splits of at most 75
TUNE_TAG = "quantgate.tune"


class TuneOptions(BaseModel):
    """What a tune run is asked, checked before anything runs."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    candidates: list[str] | None = None  # recipe names (flows.recipes); None: recipes.default_names()
    objective: Literal["smallest", "fastest"] = "smallest"
    limit: int = Field(40, ge=2, le=MAX_SPLIT_LIMIT)  # items per task in each split
    suites: list[str] | None = None


def check_options(candidates: list[str] | None, objective: str, limit: int, policy: str | None,
                  suites: list[str] | None) -> tuple[TuneOptions, Policy]:
    """Bad input fails before anything runs (the release's checks on the candidates, policy and suites);
    returns the options and the parsed policy."""
    try:
        opts = TuneOptions(candidates=candidates, objective=objective, limit=limit, suites=suites)
    except ValidationError as exc:
        raise ValueError(f"tune: {exc.errors()[0]['loc'][0]}: {exc.errors()[0]['msg']}") from None
    if opts.candidates is not None and not opts.candidates:
        raise ValueError("tune: the candidate list is empty")
    pol = R.check_options(opts.candidates or recipes.default_names(), "auto", opts.limit, policy, opts.suites)
    return opts, pol


def _speed_score(metrics: dict[str, float], plan: SpeedPlan) -> float:
    """Geometric mean of a model's speed ratios over every timed point (prefill, each decode batch)."""
    ratios = [metrics[point_key(p)] for p in plan.points() if metrics.get(point_key(p), 0) > 0]
    return math.exp(sum(math.log(r) for r in ratios) / len(ratios)) if ratios else 0.0


def _variant(source: Source, name: str, fresh: bool) -> Variant:
    """The release's quantize stage for one recipe (cached by source hash and recipe name)."""
    weights, kv = split_variant(name)
    v = R.quantize_method.with_options(refresh_cache=fresh)(source, weights)
    if not measuring.variant_intact(Path(v.path)):
        note(f"cached variant {v.name} at {v.path} is gone or damaged: quantizing again")
        v = R.quantize_method.with_options(refresh_cache=True)(source, weights)
    label = variant_label(name)
    return Variant(label, label, v.path, v.content_hash, v.manifest, kv_cache_dtype=kv)


def _baseline(source: Source) -> Variant:
    return Variant(BASELINE, None, source.path, source.content_hash, None)


def _order(source: Source, cands: list[recipes.Candidate], rows: dict[str, T.CandidateRow], objective: str,
           plan: SpeedPlan, fresh: bool) -> list[recipes.Candidate]:
    """Smallest first; fastest: each distinct layout (RTN at its group and KV cache, int8wo) timed against
    the baseline, fastest first, ties smallest first."""
    if objective == "smallest":
        return cands
    scores: dict[str, float] = {}
    for name in dict.fromkeys(recipes.layout_name(c) for c in cands):
        v = _variant(source, name, fresh)
        speed = R.measure_speed.with_options(refresh_cache=fresh)([_baseline(source), v], plan)
        scores[name] = _speed_score(speed.metrics.get(v.name, {}), plan)
        note(f"layout {name}: speed {scores[name]:.3f}x the baseline (geometric mean over {', '.join(plan.points())})")
    for c in cands:
        rows[c.name].speed_score = scores[recipes.layout_name(c)]
    return sorted(cands, key=lambda c: (-scores[recipes.layout_name(c)], c.sort_key()))


def _judge(parent: str, source: Source, v: Variant, base: Measured, config: MeasureConfig, plan: SpeedPlan,
           policy: Policy, fresh: bool) -> tuple[str, int, dict[str, str], float | None]:
    """Measure, time and record `v` under `parent`, judge the policy's gates: (run id, gates, failed, bytes)."""
    measured = R._measure(v, config, fresh)
    speed = R.measure_speed.with_options(refresh_cache=fresh)([_baseline(source), v], plan)
    run_id, _ = R.record(parent, measured, base, speed, register=False)
    ev = R.evaluate_gates(run_id, policy)
    return run_id, len(ev.results), {r.name: r.reason for r in ev.failed}, measured.metrics.get(M.WEIGHTS_BYTES)


def max_confirmations(items: int | None, limit: int) -> int:
    """Held-out splits a tune may confirm on: floor(items / limit) - 1 (split 0 is the search's); items None
    (a task whose items cannot be counted): the one held-out split every task with 2 * limit items has."""
    return 1 if items is None else max(items // limit - 1, 0)


def split_items(suites: list[str]) -> int | None:
    """The items of the smallest task of the suites (None: none could be counted)."""
    from evals.tasks import available_items, resolve_tasks

    counts = [c for c in (available_items(spec) for spec in resolve_tasks(suites)) if c is not None]
    return min(counts) if counts else None


def fidelity_splits(model_path: str, config: MeasureConfig) -> int | None:
    """Held-out splits the fidelity text allows beside the search's: each split takes the next `chunks` windows
    (None: no fidelity gate, or the text cannot be counted here)."""
    if not config.fidelity_chunks:
        return None
    try:
        from transformers import AutoTokenizer

        from evals.fidelity import held_text

        ids = AutoTokenizer.from_pretrained(model_path)(held_text(), add_special_tokens=False).input_ids
    except (OSError, ValueError):
        return None
    return len(ids) // (config.fidelity_chunks * (config.fidelity_chunk_tokens - 1)) - 1


def confirmations(model_path: str, config: MeasureConfig, limit: int) -> int:
    """The held-out splits this tune can confirm on: the tasks' items and the fidelity text both bound them."""
    bound = max_confirmations(split_items(list(config.suites)), limit)
    text = fidelity_splits(model_path, config)
    return bound if text is None else max(min(bound, text), 0)


class _HeldOut:
    """The held-out splits, each with its own parent run and baseline, opened when a confirmation takes it;
    `take` hands out each split once (1, 2, ... up to `available`), then None."""

    def __init__(self, tune_id: str, source: Source, config: MeasureConfig, run_config: dict, fresh: bool,
                 available: int) -> None:
        self.tune_id, self.source, self.config, self.run_config, self.fresh = tune_id, source, config, run_config, fresh
        self.available = available
        self.run_ids: list[str] = []  # one per split taken, in order

    @property
    def run_id(self) -> str:
        return self.run_ids[0] if self.run_ids else ""

    def take(self) -> tuple[int, str, Measured, MeasureConfig] | None:
        split = len(self.run_ids) + 1
        if split > self.available:
            return None
        config = replace(self.config, split=split)
        run_id = R.start_release(self.source, {**self.run_config, "split": split})
        self.run_ids.append(run_id)
        records.tag_release(run_id, {TUNE_TAG: "held-out", "mlflow.parentRunId": self.tune_id,
                                     "mlflow.runName": f"tune-held-out-{split}-{time.strftime('%Y%m%d-%H%M%S')}"})
        base = R._measure(_baseline(self.source), config, self.fresh)
        R.record(run_id, base, None)
        return split, run_id, base, config


def _search(source: Source, order: list[recipes.Candidate], rows: dict[str, T.CandidateRow], ctx: dict) -> str | None:
    """Each candidate in turn on the search split; the first that passes, confirmed on the held-out split."""
    plan, policy, fresh, held = ctx["plan"], ctx["policy"], ctx["fresh"], ctx["held"]
    for i, cand in enumerate(order, 1):
        row = rows[cand.name]
        note(f"candidate {i}/{len(order)}: {cand.name} ({cand.weight_bytes / 1e6:.2f} MB estimated)")
        try:
            v = _variant(source, cand.name, fresh)
        except ValueError as exc:  # the method refused this model (e.g. AWQ on a norm it cannot fold into)
            row.status, row.reason = T.REFUSED, str(exc).splitlines()[0][:500]
            note(f"{cand.name}: refused: {row.reason}")
            continue
        row.run_id, row.gates_total, row.gates_failed, row.weight_bytes = _judge(
            ctx["tune_id"], source, v, ctx["base"], ctx["config"], plan, policy, fresh)
        if row.gates_failed:
            row.status = T.FAILED
            note(f"{cand.name}: failed {', '.join(row.gates_failed)}")
            continue
        taken = held.take()
        if taken is None:
            row.status = T.UNCONFIRMED
            row.reason = (f"passed on the search items, but all {held.available} held-out split(s) the tasks' items "
                          "allow are used by earlier confirmations: not chosen")
            note(f"{cand.name}: {row.reason}")
            continue
        split, held_id, held_base, held_config = taken
        note(f"{cand.name}: passed all {row.gates_total} gates on the search items; confirming on held-out split "
             f"{split} of {held.available}")
        row.held_out_split = split
        row.held_out_run_id, _, row.held_out_gates_failed, _ = _judge(
            held_id, source, v, held_base, held_config, replace(plan, seed=plan.seed + split), policy, fresh)
        if row.held_out_gates_failed:
            row.status = T.HELD_OUT_FAILED
            note(f"{cand.name}: the held-out items failed {', '.join(row.held_out_gates_failed)}: "
                 "not confirmed, trying the next candidate")
            continue
        row.status = T.CHOSEN
        return cand.name
    return None


@flow(name=FLOW_NAME, log_prints=True, validate_parameters=True)
def tune_flow(
    model: str = DEFAULT_MODEL,
    policy: str | None = None,
    candidates: list[str] | None = None,
    objective: str = "smallest",
    limit: int = 40,
    suites: list[str] | None = None,
    fresh: bool = False,
    result_file: str | None = None,
    device: str | None = None,
) -> dict:
    """Try `candidates` (default: every recipe) in order of size; stop at the first that passes every gate
    of `policy` on the search split and again on the held-out split. `device` as the release's."""
    opts, pol = check_options(candidates, objective, limit, policy, suites)
    source = R.resolve_source(model)
    cfg = json.loads((Path(source.path) / "config.json").read_text())
    cands, refused = recipes.candidates(cfg, opts.candidates)
    names = [c.name for c in cands]
    device = resolve_device(device)
    config = replace(fidelity_stage.measure_config(pol, names, opts.suites, opts.limit), device=device)
    plan = SpeedPlan.from_policy(pol, device)
    run_config = {"tune": True, "objective": opts.objective, "candidates": names, "policy": pol.source,
                  "limit": opts.limit, "prefect_flow_run_id": str(flow_run.id)}
    tune_id = R.start_release(source, run_config)
    records.tag_release(tune_id, {TUNE_TAG: "search", "mlflow.runName": f"tune-{time.strftime('%Y%m%d-%H%M%S')}"})
    result = T.TuneResult(source.name, model, source.content_hash, opts.objective, pol.source,
                          opts.limit, list(config.suites), tune_id, tracking_uri=tracking_uri())
    rows = {c.name: T.CandidateRow(c.name, _describe(c.recipe), c.kv_cache_dtype, c.weight_bytes) for c in cands}
    held = _HeldOut(tune_id, source, config, run_config, fresh, confirmations(source.path, config, opts.limit))
    note(f"MLflow tune run {tune_id}: {len(cands)} candidates, {len(refused)} refused before building; "
         f"{held.available} held-out split(s) for confirmations")
    try:
        for r in refused:
            note(f"{r.name}: refused: {r.reason}")
        order = _order(source, cands, rows, opts.objective, plan, fresh)
        base = R._measure(_baseline(source), config, fresh)
        R.record(tune_id, base, None)
        ctx = {"tune_id": tune_id, "base": base, "config": config, "plan": plan, "policy": pol, "fresh": fresh,
               "held": held}
        result.chosen = _search(source, order, rows, ctx)
        result.rows = [rows[c.name] for c in order] + [
            T.CandidateRow(r.name, _describe(recipes.parse(split_variant(r.name)[0])),
                           split_variant(r.name)[1], 0, T.REFUSED, r.reason) for r in refused]
        result.held_out_run_id, result.held_out_run_ids = held.run_id, list(held.run_ids)
        result.outcome = _outcome(result)
        result.file = str(T.write(result, T.default_file(source.name, source.content_hash)))
        if result_file:
            T.write(result, Path(result_file))
        _log(tune_id, result)
        for run_id in held.run_ids:
            end_release(run_id)
        end_release(tune_id)
    except BaseException:
        for run_id in held.run_ids:
            end_release(run_id, status="FAILED")
        end_release(tune_id, status="FAILED")
        raise
    note(result.outcome)
    return result.as_dict()


def _describe(recipe: recipes.Recipe) -> str:
    return " ".join([recipe.method, *(f"{k}={v}" for k, v in recipe.options.items())])


def _outcome(result: T.TuneResult) -> str:
    tried = [r for r in result.rows if r.status not in (T.NOT_TRIED, T.REFUSED)]
    if result.chosen:
        return (f"chosen: {result.chosen} ({result.objective} of the candidates that pass every gate, confirmed on "
                f"held-out items) after {len(tried)} candidate(s) measured")
    unconfirmed = [r.name for r in result.rows if r.status == T.UNCONFIRMED]
    extra = f"; unconfirmed (no unused held-out split left): {', '.join(unconfirmed)}" if unconfirmed else ""
    return f"no candidate passed every gate and its held-out confirmation ({len(tried)} measured){extra}"


def _log(tune_id: str, result: T.TuneResult) -> None:
    tags = {"tune.objective": result.objective, "tune.chosen": result.chosen or "none", "tune.outcome": result.outcome[:5000]}
    for r in result.rows:
        tags[f"tune/{variant_label(r.name)}/status"] = r.status
    records.tag_release(tune_id, tags)
    get_client().log_dict(tune_id, result.as_dict(), "tune.json")
