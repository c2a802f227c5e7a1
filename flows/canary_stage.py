"""The canary stage: the champion and the challenger behind our router, a replayed traffic sample.

Both versions are served by `serving.http.server` on loopback ports, the router (`serving.routing.router`) in front
sends each request to a version by weight, sticky per `user`. The replay streams every request through
the router; the router names the version that answered (`X-Quantgate-Version`). Per version: requests,
errors (non-200, or an error inside the stream), error rate, TTFT and TPOT quantiles. The flow logs the
numbers, judges the challenger's with the policy's canary gates, then tells the router to promote or to
roll back (recorded in the router's decision history, which is kept as an artifact).

The challenger is compared with the champion, not only with an absolute limit: the replay (in submission
order, `REPLAY_CONCURRENCY` requests in flight) is cut into `SPEED_WINDOWS` windows of consecutive
requests; both versions answer within a window in the same minutes of the machine, so each window's
ratio champion TPOT / challenger TPOT is paired, and the windows' ratios give a CI
(`gates.judging.speed_verdicts.ratio_ci`) that the canary's speed gate judges with three outcomes.
"""

from __future__ import annotations

import json
import secrets
import statistics
import time
from collections.abc import Callable
from contextlib import ExitStack
from pathlib import Path

import httpx

from flows.machine import engine_placement
from gates.judging.speed_verdicts import ratio_ci
from serving import LLMEngine
from serving.http.server import build_app
from serving.http.server_thread import ServerThread
from serving.loadgen.replay import replay, traffic
from serving.loadgen.stats import percentile
from serving.routing.router import build_router_app, parse_router_config

CHAMPION, CHALLENGER = "champion", "challenger"
CANARY_KV_GB = 0.25
REPLAY_CONCURRENCY = 4
MAX_TOKENS = 16
SPEED_WINDOWS = 6
STAGE_PARTS = ("up", "replay", "judge", "down")  # canary.json's "seconds": both versions loaded and
# served, the replay, the gates judged in MLflow, the router told and both servers stopped


def version_stats(records: list[dict]) -> dict:
    tpot = [r["tpot_s"] for r in records if r.get("tpot_s") is not None]
    ttft = [r["ttft_s"] for r in records if r.get("ttft_s") is not None]
    errors = sum(1 for r in records if r["error"])
    return {
        "requests": len(records),
        "errors": errors,
        "error_rate": errors / len(records) if records else 1.0,
        "tpot_p50_s": percentile(tpot, 50),
        "tpot_p99_s": percentile(tpot, 99),
        "ttft_p99_s": percentile(ttft, 99),
    }


def paired_windows(records: list[dict], windows: int = SPEED_WINDOWS) -> list[float]:
    """Champion TPOT / challenger TPOT (mean of each) per window of consecutive requests, for every window
    in which both versions streamed tokens."""
    ordered = sorted(records, key=lambda r: r["id"])
    size = max(2, -(-len(ordered) // windows))
    ratios = []
    for i in range(0, len(ordered), size):
        tpot = {v: [r["tpot_s"] for r in ordered[i:i + size] if r["version"] == v and r.get("tpot_s")]
                for v in (CHAMPION, CHALLENGER)}
        if tpot[CHAMPION] and tpot[CHALLENGER]:
            ratios.append(statistics.fmean(tpot[CHAMPION]) / statistics.fmean(tpot[CHALLENGER]))
    return ratios


def speed_comparison(records: list[dict], windows: int = SPEED_WINDOWS) -> dict:
    """The challenger's speedup over the champion: windows, per-window ratios, estimate and CI (>= 2)."""
    ratios = paired_windows(records, windows)
    out: dict = {"windows": len(ratios), "ratios": ratios}
    if len(ratios) >= 2:
        ci = ratio_ci(ratios)
        out.update(estimate=ci.estimate, ci_low=ci.low, ci_high=ci.high)
    elif ratios:
        out["estimate"] = ratios[0]
    return out


class Canary:
    """Champion and challenger servers plus the router, up for the duration of a `with` block."""
    def __init__(self, champion_dir: Path, challenger_dir: Path, share: float, decisions_log: Path,
                 kv_cache_dtypes: dict[str, str] | None = None, device: str = "cpu"):
        if not 0.0 < share < 1.0:
            raise ValueError(f"canary share must be between 0 and 1 (exclusive), got {share}")
        self.dirs = {CHAMPION: Path(champion_dir), CHALLENGER: Path(challenger_dir)}
        self.share = share
        self.kv_cache_dtypes = {v: (kv_cache_dtypes or {}).get(v, "auto") for v in self.dirs}
        self.served_kv: dict[str, str] = {}  # what each engine really allocated
        self.load_s: dict[str, float] = {}  # each engine's load
        self.device = device  # the release's (flows.machine.resolve_device)
        self.decisions_log = decisions_log
        self.admin_key = secrets.token_hex(16)
        self._stack = ExitStack()
        self.url = ""

    def __enter__(self) -> Canary:
        try:
            backends = {}
            for version, path in self.dirs.items():
                start = time.perf_counter()
                engine = LLMEngine.from_pretrained(str(path), **engine_placement(self.device),
                                                   kv_cache_memory_gb=CANARY_KV_GB,
                                                   kv_cache_dtype=self.kv_cache_dtypes[version])
                self.served_kv[version] = engine.kv_cache_dtype
                self.load_s[version] = time.perf_counter() - start
                server = self._stack.enter_context(ServerThread(build_app(engine, served_model_name=version,
                                                                          version=version)))
                backends[version] = server.url
            config = parse_router_config({
                "versions": {CHAMPION: {"weight": 1.0 - self.share, "backends": [backends[CHAMPION]]},
                             CHALLENGER: {"weight": self.share, "backends": [backends[CHALLENGER]]}},
                "canary": CHALLENGER,
                "admin_key": self.admin_key,
                "decisions_log": str(self.decisions_log),
            }, source="canary router")
            self.url = self._stack.enter_context(ServerThread(build_router_app(config))).url
        except BaseException:
            self._stack.close()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self._stack.close()

    def replay(self, sample: list[dict], advance: Callable[[int], None]) -> list[dict]:
        return replay(self.url, sample, REPLAY_CONCURRENCY, MAX_TOKENS, advance)

    def decide(self, promote: bool, reason: str) -> dict:
        action = "promote" if promote else "rollback"
        resp = httpx.post(f"{self.url}/admin/{action}", json={"reason": reason},
                          headers={"Authorization": f"Bearer {self.admin_key}"}, timeout=10.0)
        resp.raise_for_status()
        return resp.json()


def canary_class(backend: str = "local") -> type:
    """`Canary`, or for backend "ray" (`quantgate release --canary-backend ray`) the same two versions on a
    local Ray Serve fleet (fleet.canary.FleetCanary), replayed and judged the same way."""
    if backend == "local":
        return Canary
    if backend != "ray":
        raise ValueError(f"the canary backend must be local or ray, got {backend!r}")
    from fleet.canary import FleetCanary  # late: the Ray Serve fleet, an optional backend

    class RayCanary(FleetCanary):
        replay = Canary.replay

        def __init__(self, *args, device: str = "cpu", **kwargs):
            super().__init__(*args, device=engine_placement(device)["device"], **kwargs)

    return RayCanary


def run_canary(champion_dir: Path, challenger_dir: Path, n: int, share: float, out: Path,
               advance: Callable[[int], None], judge: Callable[[dict], tuple[bool, str]],
               kv_cache_dtypes: dict[str, str] | None = None, backend: str = "local", device: str = "cpu") -> dict:
    """Serve both, replay `n` requests through the router, judge, tell the router; returns the numbers."""
    if n < 2:
        raise ValueError(f"a canary needs at least 2 requests, got {n}")
    out.mkdir(parents=True, exist_ok=True)
    decisions = out / "router_decisions.jsonl"
    clock = [time.perf_counter()]  # where the stage's time goes: both versions up, the replay, the gates, down
    with canary_class(backend)(champion_dir, challenger_dir, share, decisions, kv_cache_dtypes,
                               device=device) as canary:
        clock.append(time.perf_counter())
        records = canary.replay(traffic(n), advance)
        clock.append(time.perf_counter())
        unrouted = [r for r in records if r["version"] not in (CHAMPION, CHALLENGER)]
        result: dict = {v: version_stats([r for r in records if r["version"] == v]) for v in (CHAMPION, CHALLENGER)}
        for v in (CHAMPION, CHALLENGER):
            result[v]["kv_cache_dtype"] = canary.served_kv[v]
            if v in getattr(canary, "load_s", {}):  # the Ray fleet's replicas load elsewhere
                result[v]["load_s"] = round(canary.load_s[v], 3)
        if unrouted:
            result["unrouted"] = len(unrouted)
        if result[CHALLENGER]["requests"] == 0:
            raise RuntimeError(f"no request of the {n}-request sample reached the challenger at share {share}")
        result["speed"] = speed_comparison(records)
        passed, reason = judge(result)
        clock.append(time.perf_counter())
        result["router"] = canary.decide(passed, reason)
    clock.append(time.perf_counter())
    result["seconds"] = {part: round(b - a, 3) for part, a, b in zip(STAGE_PARTS, clock[:-1], clock[1:], strict=True)}
    trace = out / "canary_trace.jsonl"
    trace.write_text("".join(json.dumps(r) + "\n" for r in records))
    (out / "canary.json").write_text(json.dumps(result, indent=2))
    result["artifacts"] = [str(trace), str(out / "canary.json")] + ([str(decisions)] if decisions.exists() else [])
    result["summary"] = {
        "requests": len(records),
        "challenger_requests": result[CHALLENGER]["requests"],
        "challenger_error_rate": result[CHALLENGER]["error_rate"],
        "challenger_tpot_p99_s": result[CHALLENGER]["tpot_p99_s"],
        "champion_tpot_p99_s": result[CHAMPION]["tpot_p99_s"],
        **{f"tpot_speedup_{k}" if k != "estimate" else "tpot_speedup": v for k, v in result["speed"].items()
           if k != "ratios"},
        "challenger_kv_cache_dtype": result[CHALLENGER]["kv_cache_dtype"],
        "champion_kv_cache_dtype": result[CHAMPION]["kv_cache_dtype"],
    }
    return result
