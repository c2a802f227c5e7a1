"""One version's replica: one LLMEngine behind `quantgate serve`'s own app, called in-process.

Ray Serve makes a deployment of this class per version (fleet.app). The ingress calls `handle`
(streamed); the KV-aware router reads `record_routing_stats`; `info` tells the cold-start phases.
"""

from __future__ import annotations

import logging
import os
import time

from fleet.asgi import Head, call_asgi
from fleet.coldstart import load_engine, replica_dir
from fleet.config import VersionSpec

log = logging.getLogger("quantgate.fleet")


class VersionReplica:
    def __init__(self, spec: dict, model_name: str):
        self.spec = VersionSpec.model_validate(spec)
        self.started = time.time()
        if self.spec.threads:
            import torch

            torch.set_num_threads(self.spec.threads)
        kwargs = {"max_num_seqs": self.spec.max_num_seqs, "kv_cache_dtype": self.spec.kv_cache_dtype,
                  "num_kv_blocks": self.spec.num_kv_blocks, "kv_cache_memory_gb": self.spec.kv_cache_memory_gb}
        engine, self.cold_start = load_engine(self.spec.model, device=self.spec.device, dtype=self.spec.dtype,
                                              **kwargs)
        from serving.http.server import build_app

        self.engine = engine
        self.app = build_app(engine, served_model_name=model_name, version=self.spec.name,
                             max_waiting=self.spec.max_waiting)
        self.loop = self.app.state.engine_loop  # the app's lifespan would start it; nobody runs that here
        self.loop.start()
        self.replica_id = _replica_id()
        self._announce(model_name)
        log.info("replica %s of %s ready: %s", self.replica_id, self.spec.name, self.cold_start.as_dict())

    async def handle(self, method: str, path: str, headers: list[tuple[str, str]], body: bytes,
                     need_tokens: int = 1, query: str = ""):
        """Stream the app's answer: first a dict (status, headers, which replica), then body chunks."""
        del need_tokens  # the router's: prompt + max_tokens
        async for piece in call_asgi(self.app, method, path, headers, body, query):
            if isinstance(piece, Head):
                yield {"status": piece.status, "headers": piece.headers, "replica": self.replica_id,
                       "version": self.spec.name, "pid": os.getpid()}
            else:
                yield piece

    def record_routing_stats(self) -> dict:
        stats = self.engine.stats()
        return {"num_blocks": stats.num_blocks, "reserved_blocks": stats.reserved_blocks,
                "used_blocks": stats.used_blocks, "num_waiting": stats.num_waiting,
                "num_running": stats.num_running, "block_size": stats.block_size, "time": time.time()}

    def info(self) -> dict:
        return {"replica": self.replica_id, "version": self.spec.name, "model": self.spec.model,
                "kv_cache_dtype": self.engine.kv_cache_dtype,
                "pid": os.getpid(), "started": self.started, "cold_start": self.cold_start.as_dict(),
                "stats": self.record_routing_stats(), "steps": self.loop.steps}

    def _announce(self, app_name: str) -> None:
        import json


        try:
            app_name = serve_app_name() or app_name
            path = replica_dir(app_name) / f"{self.replica_id}.json"
            path.parent.mkdir(parents=True, exist_ok=True)
            info = {k: v for k, v in self.info().items() if k != "stats"}
            path.write_text(json.dumps(info) + "\n")
        except OSError as exc:  # a report for `fleet status`, never a reason to fail the replica
            log.warning("could not write the replica report: %s", exc)

    def check_health(self) -> None:
        if not self.loop.alive:
            raise RuntimeError("the engine loop is not running")

    def __del__(self) -> None:
        loop = getattr(self, "loop", None)
        if loop is not None:
            loop.stop(timeout=2)


def serve_app_name() -> str | None:
    try:
        from ray import serve

        return serve.get_replica_context().app_name
    except Exception:
        return None


def _replica_id() -> str:
    try:
        from ray import serve

        return serve.get_replica_context().replica_id.unique_id
    except Exception:  # outside a Ray Serve replica (unit use)
        return f"local-{os.getpid()}"
