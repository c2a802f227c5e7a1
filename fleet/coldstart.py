"""A replica's cold start, phase by phase: read, (quantized) load, KV allocation, first forward."""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass
from pathlib import Path

READ_CHUNK = 16 << 20


@dataclass
class ColdStart:
    import_s: float  # torch, transformers and the engine's modules, in the replica's fresh process
    read_s: float  # reading the weight files once (the OS page cache may already hold them)
    load_s: float  # building the model from them: dequantized baseline, or a variant's quantized layers
    tokenizer_s: float
    kv_alloc_s: float  # the engine: KV cache tensors, block manager, scheduler
    first_forward_s: float  # one request of one token through the engine
    bytes_read: int
    num_kv_blocks: int

    @property
    def total_s(self) -> float:
        return self.import_s + self.read_s + self.load_s + self.tokenizer_s + self.kv_alloc_s + self.first_forward_s

    def as_dict(self) -> dict:
        return {**asdict(self), "total_s": self.total_s}


def read_files(model_dir: Path) -> int:
    """Read every weight file of a model dir to the end; the bytes read."""
    total = 0
    for path in sorted(model_dir.rglob("*")):
        if path.is_file() and path.suffix in {".safetensors", ".bin", ".pt", ".gguf"}:
            with path.open("rb") as f:
                while chunk := f.read(READ_CHUNK):
                    total += len(chunk)
    return total


def load_engine(model: str, *, device: str | None = None, dtype: str | None = "auto", **engine_kwargs):
    """Build an LLMEngine the way `LLMEngine.from_pretrained` does, timing each phase; (engine, ColdStart)."""
    began = time.perf_counter()
    import torch
    from transformers import AutoTokenizer

    from quantgate.env import apply_defaults
    from quantgate.models import resolve_model
    from serving.core.engine import LLMEngine
    from serving.core.sampling_params import SamplingParams
    from serving.model.device import default_device, resolve_dtype
    from serving.model.model_runner import load_model

    apply_defaults()
    marks = [time.perf_counter()]
    model_dir = resolve_model(model)
    nbytes = read_files(model_dir)
    marks.append(time.perf_counter())
    dev = torch.device(device or default_device())
    hf_model = load_model(model_dir, dev, resolve_dtype(None if dtype in (None, "auto") else dtype, dev))
    marks.append(time.perf_counter())
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    marks.append(time.perf_counter())
    engine_kwargs.setdefault("model_name", str(model))
    engine = LLMEngine(hf_model, tokenizer, device=dev, **engine_kwargs)
    marks.append(time.perf_counter())
    engine.generate([[tokenizer.eos_token_id or 0] * 4], SamplingParams(max_tokens=1, ignore_eos=True))
    marks.append(time.perf_counter())
    d = [b - a for a, b in zip(marks, marks[1:], strict=False)]
    return engine, ColdStart(marks[0] - began, d[0], d[1], d[2], d[3], d[4], nbytes, engine.config.num_kv_blocks)


def replica_dir(name: str) -> Path:
    """Where each replica writes its cold start and identity when it is ready (this machine's replicas)."""
    from quantgate.env import home

    return home() / "fleet" / name / "replicas"
