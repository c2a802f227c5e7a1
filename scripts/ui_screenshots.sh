#!/usr/bin/env bash
# The release managers' browser check: a release paused for approval on the team services, approved in the
# Prefect UI's form (in headless Chromium), then the MLflow pages of that release; PNGs into docs/img/.
#
#   scripts/ui_screenshots.sh                      # the embedded SmolLM2-135M, a small release
#   MODEL=/path/to/hf-dir LIMIT=8 scripts/ui_screenshots.sh
#
# Needs Debian's chromium and postgresql (apt-get install chromium postgresql) and, once, Playwright's
# Python driver (installed into the venv here when missing; it drives the system chromium, no browser
# download). Uses the services of `quantgate services up` (started here and stopped again when they were
# not running already) and a process worker of its own on the pool ui-check.
set -euo pipefail
cd "$(dirname "$0")/.."
BIN=${BIN:-.venv/bin}
OUT=${OUT:-docs/img}
MODEL=${MODEL:-smollm2-135m}
METHODS=${METHODS:-int8wo,int4wo}
LIMIT=${LIMIT:-20}
SUITES=${SUITES:-facts_mc,cloze,perplexity}
POLICY=${POLICY:-scripts/ui_policy.yaml}  # a variant must pass its gates for the release to ask for approval
POOL=ui-check
command -v chromium >/dev/null || { echo "install Debian's chromium first: apt-get install -y chromium" >&2; exit 2; }
"$BIN/python" -c "import playwright" 2>/dev/null || "$BIN/pip" install -q playwright==1.65.2

started_services=0
if ! "$BIN/quantgate" services status >/dev/null 2>&1; then
  "$BIN/quantgate" services up
  started_services=1
fi
eval "$("$BIN/quantgate" services up --json | "$BIN/python" -c \
  'import json,sys; [print(f"export {k}={v}") for k, v in json.load(sys.stdin)["env"].items()]')"
PREFECT_URL=${PREFECT_API_URL%/api}
worker_pid=
cleanup() {
  if [ -n "$worker_pid" ]; then kill -TERM -- "-$worker_pid" 2>/dev/null || true; sleep 5; kill -KILL -- "-$worker_pid" 2>/dev/null || true; fi
  if [ "$started_services" = 1 ]; then "$BIN/quantgate" services down; fi
}
trap cleanup EXIT

"$BIN/quantgate" deploy --work-pool "$POOL"
PREFECT_WORKER_QUERY_SECONDS=2 setsid "$BIN/prefect" worker start --pool "$POOL" >"${TMPDIR:-/tmp}/quantgate-ui-worker.log" 2>&1 &
worker_pid=$!
run_id=$("$BIN/quantgate" notify "$MODEL" --methods "$METHODS" --limit "$LIMIT" --suites "$SUITES" --approve manual --policy "$POLICY" \
         | sed -n 's/.*flow run .* (\([0-9a-f-]\{36\}\)).*/\1/p')
[ -n "$run_id" ] || { echo "the event triggered no run" >&2; exit 1; }
echo "release flow run $run_id: waiting for it to pause for approval (worker log: ${TMPDIR:-/tmp}/quantgate-ui-worker.log)"
state() { "$BIN/python" -c 'import json,sys,urllib.request as u; print(json.load(u.urlopen(sys.argv[1]))["state"]["type"])' \
          "$PREFECT_API_URL/flow_runs/$run_id"; }
until [ "$(state)" = PAUSED ]; do
  case "$(state)" in COMPLETED|FAILED|CRASHED|CANCELLED)
    echo "the release ended ($(state)) without asking for approval: no variant passed its gates (see the run)" >&2; exit 1;;
  esac
  kill -0 "$worker_pid" 2>/dev/null || { echo "the worker died" >&2; exit 1; }
  sleep 5
done
"$BIN/python" scripts/ui_screenshots.py --prefect "$PREFECT_URL" --mlflow "$MLFLOW_TRACKING_URI" --flow-run "$run_id" --out "$OUT"
