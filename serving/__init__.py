"""quantgate's serving engine: paged KV cache, continuous batching, streaming. No MLflow, no Prefect."""

from serving.engine import EngineStats, LLMEngine, RequestOutput
from serving.sampling_params import SamplingParams
from serving.sequence import RequestMetrics, TokenLogprob

__all__ = ["EngineStats", "LLMEngine", "RequestMetrics", "RequestOutput", "SamplingParams", "TokenLogprob"]
