"""Drive the Prefect and MLflow UIs in headless Chromium (Debian's, through Playwright) for a release that is
paused for approval: screenshot the paused run and its approval form, fill in and submit the form in the
browser (that resumes the flow), wait for the release to finish, then screenshot the MLflow pages a
release manager reads. Used by scripts/ui_screenshots.sh; PNGs go to --out (each kept well under 1 MB).

    python scripts/ui_screenshots.py --prefect http://127.0.0.1:4200 --mlflow http://127.0.0.1:5000 \
        --flow-run RUN_ID --out docs/img
"""

from __future__ import annotations

import argparse
import io
import json
import os
import re
import time
from pathlib import Path

from playwright.sync_api import Page, sync_playwright

MAX_PNG_BYTES = 600_000
VIEWPORT = {"width": 1280, "height": 800}
# The MLflow 3.17 UI picks an experiment's landing page from its global GenAI / Model-training switch
# (URL `workflowType`, else localStorage), not from the experiment's tag: links carry it explicitly.
ML_VIEW = "workflowType=machine_learning"
QUIET_MLFLOW = {"mlflow.assistant.panelOpen_v1": "false", "mlflow.assistant.fab.autoOpenedOnFirstLoad_v1": "true"}


def save(page: Page, out: Path, name: str, clip: dict | None = None) -> Path:
    """A PNG of the page, re-encoded with a 256-colour palette when it would be over MAX_PNG_BYTES."""
    from PIL import Image

    data = page.screenshot(clip=clip) if clip else page.screenshot()
    if len(data) > MAX_PNG_BYTES:
        image = Image.open(io.BytesIO(data)).convert("RGB").quantize(colors=256)
        buffer = io.BytesIO()
        image.save(buffer, format="PNG", optimize=True)
        data = buffer.getvalue()
    path = out / f"ui_{name}.png"
    path.write_bytes(data)
    print(f"{path} ({len(data) // 1024} KB)")
    return path


def prefect_approve(page: Page, prefect: str, run_id: str, out: Path, comment: str, by: str) -> None:
    """The paused run, its Resume form filled in, then submitted: all in the browser."""
    page.goto(f"{prefect}/runs/flow-run/{run_id}")
    page.get_by_text("Paused").first.wait_for(timeout=120_000)
    page.wait_for_timeout(2000)
    save(page, out, "prefect_paused")
    page.get_by_role("button", name="Resume").click()
    dialog = page.locator("[role=dialog]").first
    dialog.get_by_text("waits for a decision").wait_for(timeout=60_000)
    fields = dialog.locator("textarea")  # the form's order: comment, by, then one per variant
    fields.nth(0).fill(comment)
    fields.nth(1).fill(by)
    page.wait_for_timeout(500)
    save(page, out, "prefect_approval_form")
    dialog.get_by_role("button", name="Submit").click()
    page.locator("[role=dialog]").first.wait_for(state="hidden", timeout=60_000)


def wait_finished(prefect: str, run_id: str, timeout_s: float) -> str:
    import urllib.request

    deadline = time.monotonic() + timeout_s
    state = "?"
    while time.monotonic() < deadline:
        with urllib.request.urlopen(f"{prefect}/api/flow_runs/{run_id}", timeout=10) as response:  # noqa: S310
            state = json.load(response)["state"]["type"]
        if state in ("COMPLETED", "FAILED", "CRASHED", "CANCELLED"):
            return state
        time.sleep(2)
    raise TimeoutError(f"flow run {run_id} still {state} after {timeout_s:.0f} s")


def prefect_finished(page: Page, prefect: str, run_id: str, out: Path) -> None:
    page.goto(f"{prefect}/runs/flow-run/{run_id}")
    page.get_by_text("Completed").first.wait_for(timeout=60_000)
    page.wait_for_timeout(2000)
    save(page, out, "prefect_resumed_completed")


def mlflow_release(mlflow_uri: str, flow_run_id: str) -> dict:
    """The release the flow run recorded: experiment, release run, variant runs, registered model."""
    from mlflow import MlflowClient

    client = MlflowClient(tracking_uri=mlflow_uri, registry_uri=mlflow_uri)
    experiments = client.search_experiments(filter_string="name LIKE 'quantgate/%'")
    for experiment in experiments:
        runs = client.search_runs([experiment.experiment_id], filter_string="tags.`quantgate.kind` = 'release'",
                                  order_by=["attributes.start_time DESC"], max_results=20)
        for run in runs:
            if run.data.params.get("prefect_flow_run_id") == flow_run_id:  # the release's config, flattened
                children = client.search_runs([experiment.experiment_id], max_results=100,
                                              filter_string=f"tags.`quantgate.release_run_id` = '{run.info.run_id}'")
                return {"experiment": experiment.experiment_id, "release": run.info.run_id,
                        "model": run.data.tags["quantgate.model"],
                        "runs": {c.data.tags["quantgate.variant"]: c.info.run_id for c in children}}
    raise RuntimeError(f"no quantgate release run of flow run {flow_run_id} in {mlflow_uri}")


def _expand_first_release(page: Page) -> None:
    page.locator('button[data-component-id*="runnamecellrenderer"]').first.click()
    page.get_by_text("baseline").first.wait_for(timeout=30_000)


def _metrics_side_by_side(page: Page) -> None:
    page.get_by_text("Visualizations", exact=True).first.click()  # collapse the plots: the tables come up
    page.get_by_text("Show diff only").last.click()  # metrics that differ between the variants
    page.wait_for_timeout(1000)
    page.get_by_text(re.compile(r"^task/.+/score$")).first.scroll_into_view_if_needed()


def mlflow_pages(browser, mlflow: str, release: dict, out: Path) -> None:
    exp, runs = release["experiment"], release["runs"]
    variant = next(name for name in runs if name != "baseline")
    context = browser.new_context(viewport=VIEWPORT)
    context.add_init_script(
        f"for (const [k, v] of Object.entries({json.dumps(QUIET_MLFLOW)})) localStorage.setItem(k, v);")
    run_page = f"#/experiments/{exp}/runs/{runs[variant]}"
    compare = f"#/compare-runs?runs={json.dumps(list(runs.values()))}&experiments={json.dumps([exp])}&{ML_VIEW}"
    shots = [
        ("mlflow_runs", f"#/experiments/{exp}?{ML_VIEW}", "release-", _expand_first_release),
        ("mlflow_compare", compare, "Run details", _metrics_side_by_side),
        ("mlflow_gate_report", f"{run_page}/artifacts/gates/release/gates.md?{ML_VIEW}", "Gates (release)", None),
        ("mlflow_flips_table", f"{run_page}/artifacts/flips.json?{ML_VIEW}", "baseline_response", None),
        ("mlflow_plot", f"{run_page}/artifacts/evidence/scores.png?{ML_VIEW}", "scores.png", None),
        ("mlflow_run_datasets", f"{run_page}?{ML_VIEW}", "Datasets", None),
        ("mlflow_registry", f"#/models/{release['model']}-quantgate?{ML_VIEW}", "champion", None),
    ]
    for name, route, marker, prepare in shots:
        page = context.new_page()  # a fresh page: the SPA keeps an artifact selection across hash changes
        page.set_default_timeout(90_000)
        page.goto(f"{mlflow}/{route}")
        try:
            page.get_by_text(marker).first.wait_for(timeout=90_000)
            if prepare is not None:
                prepare(page)
        except Exception as exc:  # noqa: BLE001 - keep the other pages; say which one did not show its content
            print(f"{name}: {marker!r} did not appear or could not be arranged ({type(exc).__name__}); as it is")
        page.wait_for_timeout(3000)
        save(page, out, name)
        page.close()
    context.close()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prefect", required=True, help="Prefect server URL (without /api)")
    parser.add_argument("--mlflow", required=True, help="MLflow tracking server URL")
    parser.add_argument("--flow-run", required=True, help="id of the release flow run paused for approval")
    parser.add_argument("--out", default="docs/img")
    parser.add_argument("--by", default="release-manager")
    parser.add_argument("--comment", default="approved in the Prefect UI after reading the gate report")
    parser.add_argument("--timeout", type=float, default=900.0, help="seconds to wait for the release to finish")
    parser.add_argument("--chromium", default=os.environ.get("CHROMIUM", "/usr/bin/chromium"))
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=args.chromium, args=["--no-sandbox", "--headless=new"])
        page = browser.new_page(viewport=VIEWPORT)
        page.set_default_timeout(90_000)
        prefect_approve(page, args.prefect, args.flow_run, out, args.comment, args.by)
        state = wait_finished(args.prefect, args.flow_run, args.timeout)
        print(f"flow run {args.flow_run}: {state} after the form was submitted in the browser")
        if state == "COMPLETED":
            prefect_finished(page, args.prefect, args.flow_run, out)
        mlflow_pages(browser, args.mlflow, mlflow_release(args.mlflow, args.flow_run), out)
        browser.close()
    return 0 if state == "COMPLETED" else 1


if __name__ == "__main__":
    raise SystemExit(main())
