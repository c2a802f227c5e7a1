"""The release canary's two versions on a local Ray Serve fleet instead of two loopback servers.

Same surface as flows.canary_stage.Canary (`url`, `served_kv`, `decide`, a `with` block); the flow adds the
replay. One replica per version; the ingress's promote/rollback is the decision, and its history is
written to the decisions log as JSON lines.
"""

from __future__ import annotations

import json
import secrets
from pathlib import Path

from quantgate.ports import free_port

CHAMPION, CHALLENGER = "champion", "challenger"
APP = "canary"


class FleetCanary:
    def __init__(self, champion_dir: Path, challenger_dir: Path, share: float, decisions_log: Path,
                 kv_cache_dtypes: dict[str, str] | None = None, kv_cache_memory_gb: float = 0.25,
                 address: str | None = None, device: str = "cpu"):
        if not 0.0 < share < 1.0:
            raise ValueError(f"canary share must be between 0 and 1 (exclusive), got {share}")
        self.dirs = {CHAMPION: Path(champion_dir), CHALLENGER: Path(challenger_dir)}
        self.share = share
        self.kv_cache_dtypes = {v: (kv_cache_dtypes or {}).get(v, "auto") for v in self.dirs}
        self.kv_cache_memory_gb = kv_cache_memory_gb
        self.decisions_log = Path(decisions_log)
        self.address = address
        self.device = device
        self.admin_key = secrets.token_hex(16)
        self.served_kv: dict[str, str] = {}
        self.url = ""
        self._started_ray = False

    def config(self, port: int):
        from fleet.config import FleetConfig

        versions = [{"name": v, "model": str(path), "weight": self.share if v == CHALLENGER else 1.0 - self.share,
                     "num_replicas": 1, "kv_cache_memory_gb": self.kv_cache_memory_gb, "device": self.device,
                     "kv_cache_dtype": self.kv_cache_dtypes[v], "num_cpus": 0.5}
                    for v, path in self.dirs.items()]
        return FleetConfig.model_validate({"name": APP, "port": port, "champion": CHAMPION,
                                           "admin_key": self.admin_key, "versions": versions})

    def __enter__(self) -> FleetCanary:
        import ray

        from fleet import app as fleet_app

        self._started_ray = not ray.is_initialized() and self.address is None
        try:
            info = fleet_app.up(self.config(free_port()), address=self.address)
            self.url = info["url"]
            by_version = {r["version"]: r for r in fleet_app.live_replicas(APP)}
            self.served_kv = {v: by_version.get(v, {}).get("kv_cache_dtype", self.kv_cache_dtypes[v])
                              for v in self.dirs}
        except BaseException:
            self.__exit__()
            raise
        return self

    def __exit__(self, *exc) -> None:
        import ray
        from ray import serve

        try:
            if self._started_ray:
                serve.shutdown()
            elif ray.is_initialized():
                serve.delete(APP)
        finally:
            if self._started_ray:
                ray.shutdown()

    def decide(self, promote: bool, reason: str) -> dict:
        import httpx

        body = {"action": "promote", "version": CHALLENGER, "reason": reason} if promote else \
            {"action": "weights", "weights": {CHAMPION: 1.0, CHALLENGER: 0.0}, "reason": reason}
        resp = httpx.post(f"{self.url}/fleet/traffic", json=body,
                          headers={"Authorization": f"Bearer {self.admin_key}"}, timeout=10.0)
        resp.raise_for_status()
        state = resp.json()
        self.decisions_log.parent.mkdir(parents=True, exist_ok=True)
        self.decisions_log.write_text("".join(json.dumps(h) + "\n" for h in state["history"]))
        return {"action": "promote" if promote else "rollback", "reason": reason, "weights": state["weights"],
                "champion": state["champion"], "backend": "ray"}
