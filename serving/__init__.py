"""quantgate's serving engine: paged KV cache, continuous batching, streaming. No MLflow, no Prefect.

Four rooms (docs/layout.md): `core/` the engine and its schedulers, `model/` model execution, `http/` the
OpenAI-compatible server, `routing/` the canary router; `cli.py` the `generate`, `serve` and `route` verbs.

Names are imported on first use, so `quantgate --help` does not pay for importing torch.
"""

from __future__ import annotations

import importlib

_EXPORTS = {
    "EngineConfig": "serving.core.engine_interface",
    "EngineStats": "serving.core.engine_interface",
    "LLMEngine": "serving.core.engine",
    "RequestOutput": "serving.core.engine_interface",
    "SamplingParams": "serving.core.sampling_params",
    "RequestMetrics": "serving.core.sequence",
    "TokenLogprob": "serving.core.sequence",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module 'serving' has no attribute {name!r}")
    return getattr(importlib.import_module(_EXPORTS[name]), name)
