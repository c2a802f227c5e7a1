"""Building a model is one thread at a time per process, and a built model is checked before use.

transformers and accelerate patch process-global state while they construct a model (meta-device
init, `nn.Module.register_parameter`, init-skipping context managers). Two threads building at once
break each other: "Cannot copy out of meta tensor", or weights silently left freshly initialised.
Every model construction in quantgate goes through `model_construction()`; work on a built model
(forward passes, quantization of its tensors, saving) runs outside it, in parallel.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch
    from transformers import PreTrainedModel

_CONSTRUCTION = threading.RLock()


class UnmaterialisedModelError(RuntimeError):
    """A model whose weights are not all real data read from its checkpoint."""


@contextmanager
def model_construction() -> Iterator[None]:
    with _CONSTRUCTION:
        yield


def load_causal_lm(path: str | Path, **kwargs: Any) -> PreTrainedModel:
    """`AutoModelForCausalLM.from_pretrained(path, **kwargs)`, serialised, refusing missing weights."""
    from transformers import AutoModelForCausalLM

    with model_construction():
        model, info = AutoModelForCausalLM.from_pretrained(path, output_loading_info=True, **kwargs)
    missing = [k for k in info.get("missing_keys", ()) if k not in _tied_keys(model)]
    if missing:
        raise UnmaterialisedModelError(
            f"{path}: {len(missing)} weights missing from the checkpoint would be freshly initialised: "
            f"{', '.join(sorted(missing)[:8])}"
        )
    check_materialised(model, str(path))
    return model


def check_materialised(model: torch.nn.Module, what: str = "model") -> None:
    """Every parameter and buffer holds data (none left on the meta device)."""
    meta = [name for name, t in _named_tensors(model) if t.device.type == "meta"]
    if meta:
        raise UnmaterialisedModelError(
            f"{what}: {len(meta)} tensors were never materialised (still on the meta device): "
            f"{', '.join(meta[:8])}"
        )


def resident_bytes(model: torch.nn.Module) -> int:
    """Bytes of parameters and buffers in memory (tied weights counted once, meta tensors not at all)."""
    seen: set[int] = set()
    total = 0
    for _, t in _named_tensors(model):
        if id(t) in seen or t.device.type == "meta":
            continue
        seen.add(id(t))
        total += t.numel() * t.element_size()
    return total


def _named_tensors(model: torch.nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    yield from model.named_parameters(remove_duplicate=False)
    yield from model.named_buffers(remove_duplicate=False)


def _tied_keys(model: PreTrainedModel) -> set[str]:
    """Keys a checkpoint may leave out because they share another tensor (tied embeddings)."""
    keys = getattr(model, "all_tied_weights_keys", None) or getattr(model, "_tied_weights_keys", None) or {}
    return set(keys)
