"""The engine's GPU path: paged attention as Triton kernels of our own, and decode captured in CUDA graphs.

The kernels read the same paged cache as serving/model/attention.py (per layer `[kv_heads, slots, head_dim]`,
slot = block * block_size + offset) through each sequence's block table, in place:

- `store.py`: the step's K/V written to their slots (slot -1: a padding row, skipped);
- `decode.py`: one query token per sequence, the query heads of a KV head read its K/V once (GQA);
- `prefill.py`: prompt chunks over their cached context and themselves, causal (chunked prefill, prefix hits);
- `step.py`: the step's block tables and lengths as device tensors; `attention.py` runs one layer with them;
- `fused_ops.py`: RMSNorm, add + RMSNorm, rotary + K/V store, one launch each, so `LlamaForward` serves CUDA
  with the same ~12 ops a layer as on CPU (`torch_ops.py`: the same in torch, their reference);
- `graphs.py`: decode steps captured per bucketed batch size (static buffers, padding to the bucket);
- `interpreter.py`: where Triton's interpreter computes otherwise than a GPU, and the way around it.

On a CUDA device the engine takes this path by default; on CPU only when asked (`attention="triton"`), which
needs Triton's interpreter (`TRITON_INTERPRET=1` before the process starts): how tests check the kernels.
"""

from __future__ import annotations

import importlib.util

import torch

from quantgate import settings

ATTENTION_BACKENDS = ("auto", "torch", "triton")


def triton_installed() -> bool:
    return importlib.util.find_spec("triton") is not None


def resolve_backend(name: str, device: torch.device | str, kv_cache_dtype: str = "auto") -> str:
    """`auto`: Triton on CUDA where it is installed and the cache holds the model's dtype, else torch.
    Raises ValueError for a choice that cannot run here."""
    if name not in ATTENTION_BACKENDS:
        raise ValueError(f"unknown attention {name!r}; choose one of {', '.join(ATTENTION_BACKENDS)}")
    device_type = torch.device(device).type
    if name == "auto":
        return "triton" if device_type == "cuda" and kv_cache_dtype == "auto" and triton_installed() else "torch"
    if name == "triton":
        if kv_cache_dtype != "auto":
            raise ValueError(f"attention='triton' reads a cache in the model's dtype; kv_cache_dtype "
                             f"{kv_cache_dtype!r} needs attention='torch'")
        if not triton_installed():
            raise ValueError("attention='triton' needs the triton package")
        if device_type == "cpu" and not settings.enabled(settings.TRITON_INTERPRET):
            raise ValueError("attention='triton' on CPU runs in Triton's interpreter: export TRITON_INTERPRET=1 "
                             "before the process starts")
        if device_type not in ("cpu", "cuda"):
            raise ValueError(f"attention='triton' runs on cuda (or cpu under the interpreter), not {device_type}")
    return name
