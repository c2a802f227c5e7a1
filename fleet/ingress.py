"""The fleet's OpenAI-compatible ingress: picks a version (weights, sticky per `user`), forwards the request
to that version's deployment and relays the answer, streamed or whole. Promote/rollback change its
traffic state in place: the next request sees them, no replica restarts."""


import asyncio
import hmac
import logging

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from ray import serve

from fleet.config import FleetConfig
from fleet.sizing import RequestSizer
from fleet.traffic import TrafficState
from serving.http.http_errors import install_error_handlers
from serving.http.protocol import APIError, error_body

log = logging.getLogger("quantgate.fleet")

OPEN_RETRIES = 1
PASS_HEADERS = {"content-type", "retry-after", "cache-control", "x-accel-buffering"}

app = FastAPI(title="quantgate fleet", docs_url=None, redoc_url=None, openapi_url=None)


install_error_handlers(app, log)  # the single server's error shapes (404/405 naming the path, 500s)


def _failed(version: str, exc: BaseException) -> APIError:
    return APIError(503, f"a replica of version {version!r} failed while answering ({type(exc).__name__}); "
                    "the request was not completed, retry it", "replica_failed", {"Retry-After": "1"})


def _sse_error(err: APIError) -> bytes:
    import json

    return f"data: {json.dumps(error_body(err.status, err.message, err.code))}\n\ndata: [DONE]\n\n".encode()


async def _relay_stream(gen, version: str):
    try:
        async for chunk in gen:
            yield chunk
    except (asyncio.CancelledError, KeyboardInterrupt):
        raise
    except Exception as exc:  # the replica died mid-stream: say so in the stream, as the server does
        log.warning("replica of %s failed mid-stream: %s", version, exc)
        yield _sse_error(_failed(version, exc))


def _serve_status(app_name: str) -> dict:
    """Ray Serve's view of the application's deployments, as seen from inside it."""
    try:
        app_status = serve.status().applications[app_name]
    except Exception as exc:  # a report, never a reason to fail /fleet/state
        return {"status": f"unknown ({type(exc).__name__})", "deployments": {}}
    deployments = {name: {"status": str(d.status).rsplit(".", 1)[-1],
                          "replica_states": {str(k).rsplit(".", 1)[-1]: v for k, v in d.replica_states.items()}}
                   for name, d in app_status.deployments.items()}
    return {"status": str(app_status.status).rsplit(".", 1)[-1], "deployments": deployments}


def _error_response(err: APIError) -> JSONResponse:
    return JSONResponse(error_body(err.status, err.message, err.code, err.param), err.status, headers=err.headers)


@serve.deployment(name="ingress", num_replicas=1, ray_actor_options={"num_cpus": 0})
@serve.ingress(app)
class FleetIngress:
    def __init__(self, config: dict, versions: dict):
        from transformers import AutoConfig, AutoTokenizer

        from quantgate.env import apply_defaults
        from quantgate.models import resolve_model

        apply_defaults()
        self.config = FleetConfig.model_validate(config)
        self.versions = versions  # version name -> DeploymentHandle
        self.traffic = TrafficState({v.name: v.weight for v in self.config.versions}, self.config.champion)
        model_dir = resolve_model(self.config.version(self.config.champion).model)
        hf = AutoConfig.from_pretrained(model_dir)
        self.sizer = RequestSizer(AutoTokenizer.from_pretrained(model_dir),
                                  getattr(hf, "max_position_embeddings", None) or 2048)

    # ---- the OpenAI surface ----------------------------------------------------------------------
    @app.post("/v1/completions")
    async def completions(self, request: Request):
        return await self._generate(request)

    @app.post("/v1/chat/completions")
    async def chat(self, request: Request):
        return await self._generate(request)

    @app.get("/v1/models")
    async def models(self, request: Request):
        return await self._forward(request, self.traffic.champion)

    @app.get("/tokenizer_info")
    async def tokenizer_info(self, request: Request):
        return await self._forward(request, self.traffic.champion)

    @app.get("/health")
    async def health(self, request: Request):
        return await self._forward(request, self.traffic.champion)

    @app.post("/tokenize")
    async def tokenize(self, request: Request):
        return await self._forward(request, self.traffic.champion)

    @app.post("/detokenize")
    async def detokenize(self, request: Request):
        return await self._forward(request, self.traffic.champion)

    # ---- the fleet's own -------------------------------------------------------------------------
    @app.get("/fleet/state")
    async def http_state(self, request: Request):
        self._admin(request)
        return self.state()

    @app.post("/fleet/traffic")
    async def http_traffic(self, request: Request):
        self._admin(request)
        data = self.sizer.parse(await request.body())
        try:
            action, reason = data.get("action"), data.get("reason", "")
            if action == "promote":
                change = self.promote(str(data.get("version")), reason)
            elif action == "rollback":
                change = self.rollback(reason)
            elif action == "weights":
                change = self.set_weights(dict(data.get("weights") or {}), reason)
            else:
                raise ValueError(f"action must be promote, rollback or weights, got {action!r}")
        except (ValueError, TypeError) as exc:
            return JSONResponse(error_body(400, str(exc)), 400)
        return {"change": change, **self.state()}

    def _admin(self, request: Request) -> None:
        key = self.config.admin_key
        if key is None:
            return
        scheme, _, given = request.headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(given.strip().encode(), key.encode()):
            raise APIError(401, "the fleet's admin endpoints need `Authorization: Bearer <admin key>`",
                           "invalid_admin_key")

    def state(self) -> dict:
        return {"fleet": self.config.name, "model": self.config.model_name, **self.traffic.snapshot(),
                **_serve_status(self.config.name)}

    def promote(self, version: str, reason: str) -> dict:
        change = self.traffic.promote(version, reason)
        log.warning("promote %s: %s", version, reason)
        return change.as_dict()

    def rollback(self, reason: str) -> dict:
        change = self.traffic.rollback(reason)
        log.warning("rollback to %s: %s", change.champion, reason)
        return change.as_dict()

    def set_weights(self, weights: dict[str, float], reason: str) -> dict:
        return self.traffic.set_weights(weights, reason).as_dict()

    # ---- relaying --------------------------------------------------------------------------------
    async def _generate(self, request: Request) -> Response:
        body = await request.body()
        data = self.sizer.parse(body)
        user = data.get("user") if isinstance(data.get("user"), str) else None
        version = self.traffic.pick(user)
        need = self.sizer.need_tokens(request.url.path, data)
        return await self._relay(request, version, body, need)

    async def _forward(self, request: Request, version: str) -> Response:
        return await self._relay(request, version, await request.body(), 1)

    async def _relay(self, request: Request, version: str, body: bytes, need: int) -> Response:
        headers = [(k, v) for k, v in request.headers.items() if k.lower() not in {"host", "content-length"}]
        gen, head = None, None
        for attempt in range(1 + OPEN_RETRIES):  # nothing reached the client yet: another replica may answer
            gen = self.versions[version].options(stream=True).handle.remote(
                request.method, request.url.path, headers, body, need_tokens=need, query=request.url.query)
            try:
                head = await gen.__anext__()
                break
            except (asyncio.CancelledError, KeyboardInterrupt):
                raise
            except Exception as exc:
                log.warning("replica of %s failed before answering (attempt %d): %r", version, attempt + 1, exc)
                if attempt == OPEN_RETRIES:
                    return _error_response(_failed(version, exc))
        out_headers = {k: v for k, v in head["headers"] if k.lower() in PASS_HEADERS}
        out_headers.update({"x-quantgate-version": version, "x-quantgate-replica": head["replica"]})
        if "text/event-stream" in out_headers.get("content-type", ""):
            return StreamingResponse(_relay_stream(gen, version), head["status"], out_headers)
        try:
            chunks = [c async for c in gen]
        except (asyncio.CancelledError, KeyboardInterrupt):
            raise
        except Exception as exc:
            return _error_response(_failed(version, exc))
        return Response(b"".join(chunks), head["status"], out_headers)

