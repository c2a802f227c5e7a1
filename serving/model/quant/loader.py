"""Loading what the engine serves: a plain HF directory, or a verified variant directory (quantgate.json).

The variant's weight files say its format: `int8wo.safetensors` / `int4wo.safetensors` are ours
(checkpoint.py builds the layers of int8.py / int4.py), anything else was saved by transformers
(bitsandbytes' int8 and nf4/fp4 load through `from_pretrained` with their quantization config).
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import TYPE_CHECKING

from quantgate.env import apply_defaults
from quantgate.loading import load_causal_lm
from quantgate.models import resolve_model
from serving.model.quant.integrity import MANIFEST, verify_variant

if TYPE_CHECKING:
    import torch
    from transformers import PreTrainedModel


def quiet_bitsandbytes() -> None:
    """bitsandbytes logs a line per 8-bit matmul on CPU and one about an optional package at import."""

    class _Drop(logging.Filter):
        def filter(self, record: logging.LogRecord) -> bool:
            message = record.getMessage()
            return "inputs will be cast" not in message and "kernels" not in message

    for name in ("bitsandbytes.autograd._functions", "bitsandbytes.backends.cpu.ops"):
        logger = logging.getLogger(name)
        if not any(isinstance(f, _Drop) for f in logger.filters):
            logger.addFilter(_Drop())


def load_variant(directory: str | Path, device: str = "cpu", dtype: torch.dtype | None = None) -> PreTrainedModel:
    """Load a verified variant directory as a ready causal LM on `device`."""
    # late: torch and transformers load here, so `import quantize` (the CLI's --help) stays cheap
    from serving.model.quant.checkpoint import WEIGHTS_FILES, load_weight_only

    directory = Path(directory)
    verify_variant(directory)
    for weight_format, file in WEIGHTS_FILES.items():
        if (directory / file).is_file():
            return load_weight_only(directory, device, dtype, weight_format).eval()
    quiet_bitsandbytes()
    return load_causal_lm(directory, dtype=dtype or "auto", device_map={"": device}).eval()


def load_model(model_dir: str | Path, device: str = "cpu", dtype: torch.dtype | None = None) -> PreTrainedModel:
    """Any model the engine may serve: a plain HF directory, a variant (verified first), or a reference.

    `dtype=None` keeps the dtype the directory was saved in.
    """
    apply_defaults()
    path = resolve_model(model_dir)
    if (path / MANIFEST).exists():
        return load_variant(path, device, dtype)
    return load_causal_lm(path, dtype=dtype or "auto", device_map={"": device}).eval()
