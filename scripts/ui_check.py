"""The release manager's view, checked in a real browser: start `mlflow ui` over a release's store, open the
release run, a refused variant's run, the release's comparison.md and the registered model in headless
Chromium (Debian's, driven by Playwright), save screenshots (PNG, each < 300 KB) and assert that the verdict,
the failing gate's figure and CI, and the champion alias are on the first screen, without scrolling.

    QUANTGATE_HOME=/tmp/release-home python scripts/ui_check.py --out docs/img   # the home of a release
    QUANTGATE_HOME=H python scripts/ui_check.py --release RUN_ID                 # a given release run

Needs `apt-get install -y chromium` and `pip install playwright==1.65.2` (no browser download: it drives
/usr/bin/chromium). Exit 0 when every check passed; each check is printed.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

MAX_PNG_BYTES = 300_000
VIEWPORT = {"width": 1440, "height": 900}
# MLflow 3.17 opens experiments in its GenAI view unless the URL (or localStorage) picks "machine_learning":
# the experiment's `mlflow.experimentKind` tag is read for the sidebar, not for the landing page.
ML_VIEW = "workflowType=machine_learning"
QUIET = {"mlflow.assistant.panelOpen_v1": "false", "mlflow.assistant.fab.autoOpenedOnFirstLoad_v1": "true",
         "mlflow.workflowType_v1": json.dumps("machine_learning")}


def start_ui(port: int) -> subprocess.Popen:
    from gates.records.tracking import ui_command, ui_env

    proc = subprocess.Popen(ui_command(port=port), env=ui_env(), stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, start_new_session=True)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2):  # noqa: S310
                return proc
        except OSError:
            if proc.poll() is not None:
                raise RuntimeError("mlflow ui exited while starting") from None
            time.sleep(1)
    proc.terminate()
    raise TimeoutError("mlflow ui not healthy after 120 s")


def find_release(release_id: str | None) -> dict:
    """The release run, its refused variant and failing gate, the champion: what the pages must show."""
    from gates.records.evaluation import read_evaluation
    from gates.records.run_notes import gate_ci, headline
    from gates.records.tracking import (
        TAG_VARIANT,
        get_client,
        get_run,
        registered_model_name,
        release_children,
    )

    client = get_client()
    if release_id is None:
        runs = client.search_runs([e.experiment_id for e in client.search_experiments()],
                                  filter_string="tags.`quantgate.kind` = 'release'",
                                  order_by=["attributes.start_time DESC"], max_results=1)
        if not runs:
            raise RuntimeError("no quantgate release run in this store")
        release_id = runs[0].info.run_id
    release = get_run(release_id, client)
    found = {"release": release_id, "experiment": release.info.experiment_id,
             "model": registered_model_name(release.data.tags["quantgate.model"]), "refused": None}
    for run in release_children(release_id, client):
        evaluation = read_evaluation(run.info.run_id, "release", client)
        failed = [r for r in evaluation.failed if r.verdict == "fail"] if evaluation else []
        if failed and found["refused"] is None:
            gate = failed[0]
            ci = gate_ci(gate.name, run.data.metrics)
            found["refused"] = {"run": run.info.run_id, "name": run.data.tags.get(TAG_VARIANT), "gate": gate.name,
                                "figure": f"{gate.observed:.4g}" if gate.observed is not None else "not measured",
                                "ci": f"CI {ci[0]:.4g} to {ci[1]:.4g}" if ci else None,
                                "ci_pair": f"[{ci[0]:.4g}, {ci[1]:.4g}]" if ci else None,
                                "headline": headline(evaluation),
                                "speed_plot": any(f.path.endswith("speed.png")
                                                  for f in client.list_artifacts(run.info.run_id, "gates/release"))}
    aliases = client.get_registered_model(found["model"]).aliases
    found["champion"] = str(aliases.get("champion")) if aliases.get("champion") else None
    return found


def save(page, out: Path, name: str) -> Path:
    """The first screen as PNG, re-encoded with a 256-colour palette when over MAX_PNG_BYTES."""
    from PIL import Image

    data = page.screenshot()
    if len(data) > MAX_PNG_BYTES:
        image = Image.open(io.BytesIO(data)).convert("RGB").quantize(colors=256)
        buffer = io.BytesIO()
        image.save(buffer, format="PNG", optimize=True)
        data = buffer.getvalue()
    path = out / f"ui_{name}.png"
    path.write_bytes(data)
    print(f"  saved {path} ({len(data) // 1024} KB)")
    return path


# Whether some element showing `t` (the deepest one holding all of it) lies inside the viewport, above the fade
# of a folded description ("Show more": the last lines above it are faded out), and is what the page shows at
# its point (a textless element on top is the fade's transparent overlay). Text laid out off screen (the UI keeps
# measuring copies there), clipped or covered by other content is not on the first screen.
_ON_FIRST_SCREEN = """t => {
  const norm = s => (s || '').replace(/\\s+/g, ' ');
  const more = [...document.querySelectorAll('button, a')].find(
    b => b.textContent.trim() === 'Show more' && b.getBoundingClientRect().height > 0);
  const holders = [...document.querySelectorAll('body *')].filter(
    e => norm(e.textContent).includes(t) && ![...e.children].some(c => norm(c.textContent).includes(t)));
  return holders.some(el => {
    const r = el.getBoundingClientRect();
    const folded = more && el.closest('div') && more.parentElement && more.parentElement.parentElement
      && more.parentElement.parentElement.contains(el);
    const limit = folded ? Math.min(innerHeight, more.getBoundingClientRect().top - 16) : innerHeight;
    const x = r.left + Math.min(r.width / 2, 24), y = r.top + Math.min(r.height / 2, 10);
    if (r.width === 0 || r.top < 0 || r.top + Math.min(r.height, 22) > limit || x < 0 || x > innerWidth) return false;
    const hit = document.elementFromPoint(x, y);
    return !!hit && (hit === el || el.contains(hit) || hit.contains(el) || !norm(hit.textContent).trim());
  });
}"""


def on_first_screen(page, text: str, wait_s: float = 15.0) -> bool:
    """`text` is shown, on top, inside the viewport as loaded (no scrolling, no click); the UI lays the page out
    in several passes, so it is asked again for a while."""
    deadline = time.monotonic() + wait_s
    while not page.evaluate(_ON_FIRST_SCREEN, text):
        if time.monotonic() > deadline:
            return False
        page.wait_for_timeout(500)
    return True


def check_page(context, base: str, route: str, wait_for: str, expect: list[str], out: Path, name: str,
               folded: tuple[str, ...] = ()) -> list[str]:
    page = context.new_page()
    page.set_default_timeout(90_000)
    page.goto(f"{base}/{route}")
    failures = []
    try:
        page.get_by_text(wait_for).first.wait_for(timeout=90_000)
    except Exception as exc:  # noqa: BLE001 - the screenshot shows what came up instead
        failures.append(f"{name}: {wait_for!r} never appeared ({type(exc).__name__})")
    page.wait_for_timeout(2500)
    save(page, out, name)
    for text in expect:
        ok = on_first_screen(page, text)
        print(f"  [{'ok' if ok else 'FAIL'}] {name}: {text!r} on the first screen")
        failures += [] if ok else [f"{name}: {text!r} not on the first screen"]
    for text in folded:  # the check itself can fail: a note's last line lies under the fold
        ok = not on_first_screen(page, text, wait_s=0)
        print(f"  [{'ok' if ok else 'FAIL'}] {name}: {text!r} under the fold (the check can tell)")
        failures += [] if ok else [f"{name}: {text!r} counted as on the first screen although folded"]
    page.close()
    return failures


def run_checks(base: str, found: dict, out: Path, chromium: str) -> list[str]:
    from playwright.sync_api import sync_playwright

    exp, refused = found["experiment"], found["refused"]
    failures = [] if refused else ["this release has no variant refused by a failed gate: nothing to check there"]
    failures += [] if found["champion"] else ["the registered model has no champion alias"]
    pages = [("mlflow_release_note", f"#/experiments/{exp}/runs/{found['release']}?{ML_VIEW}", "Release of",
              ["Release of", f"champion → v{found['champion']}"])]
    if refused:
        expect = [f"{refused['name']}: REFUSED", refused["gate"], refused["figure"], *([refused["ci"]] if refused["ci"] else [])]
        pages.append(("mlflow_refused_note", f"#/experiments/{exp}/runs/{refused['run']}?{ML_VIEW}", "REFUSED", expect,
                      ("evidence: Artifacts",)))
        if refused["speed_plot"]:
            pages.append(("mlflow_refused_speed", f"#/experiments/{exp}/runs/{refused['run']}/artifacts/gates/"
                          f"release/speed.png?{ML_VIEW}", "speed.png", []))
    if refused:  # the release's comparison: the refused variant's verdict and failing figure in its first table
        figure = "—" if refused["figure"] == "not measured" else refused["figure"]
        shown = f"{figure} {refused['ci_pair']}" if refused["ci_pair"] else figure
        expect = [refused["headline"], refused["gate"], shown]
        pages.append(("mlflow_comparison", f"#/experiments/{exp}/runs/{found['release']}/artifacts/comparison/"
                      f"comparison.md?{ML_VIEW}", "variants side by side", expect))
    pages.append(("mlflow_registry_versions", f"#/models/{found['model']}?{ML_VIEW}", "champion", ["champion"]))
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=chromium, args=["--no-sandbox", "--headless=new"])
        context = browser.new_context(viewport=VIEWPORT)
        context.add_init_script(f"for (const [k, v] of Object.entries({json.dumps(QUIET)})) localStorage.setItem(k, v);")
        for name, route, wait_for, expect, *folded in pages:
            print(f"{name}: {base}/{route}")
            failures += check_page(context, base, route, wait_for, expect, out, name, *folded)
        browser.close()
    return failures


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--release", help="release run id (default: the newest)")
    parser.add_argument("--out", default="docs/img")
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--chromium", default=os.environ.get("CHROMIUM", "/usr/bin/chromium"))
    args = parser.parse_args()  # the release's store: run with QUANTGATE_HOME (and no MLFLOW_TRACKING_URI) set
    from quantgate.ports import free_port

    port = args.port or free_port()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    found = find_release(args.release)
    print(json.dumps(found, indent=2))
    proc = start_ui(port)
    try:
        failures = run_checks(f"http://127.0.0.1:{port}", found, out, args.chromium)
    finally:
        os.killpg(proc.pid, 15)
        proc.wait(timeout=30)
    for failure in failures:
        print(f"FAILED: {failure}")
    print("browser check:", "passed" if not failures else f"{len(failures)} failed")
    return 1 if failures else 0


if __name__ == "__main__":
    raise SystemExit(main())
