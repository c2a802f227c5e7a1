"""A built variant must still be its source model: checked on a fixed input before anything is saved.

Quantization moves logits a little; a model whose weights were left on the meta device or freshly
initialised (a broken concurrent load, a checkpoint that does not match) has logits unrelated to the
source's. The probe compares the two on one fixed input and refuses the build when they disagree.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import TYPE_CHECKING

from quantgate.loading import UnmaterialisedModelError, check_materialised, load_causal_lm

if TYPE_CHECKING:
    import torch
    from transformers import PreTrainedModel

PROBE_LENGTH = 32
# Mean cosine similarity of the probe's logits (centred per position) between variant and source.
# Measured on the default model: int8wo 0.997, int4wo 0.969, int8 0.963, nf4 0.909, fp4 0.808 (tiny test
# Llama: int8wo 0.999, int8 0.999, nf4 0.920, fp4 0.840); the same architecture with random weights: 0.001.
MIN_COSINE = 0.5


@dataclass(frozen=True)
class ProbeResult:
    cosine: float  # mean over positions of the centred logits' cosine similarity
    top1_agreement: float  # share of positions whose argmax is the same


def probe_ids(vocab_size: int) -> list[int]:
    """A fixed, vocabulary-independent input: spread over the ids, the same on every machine."""
    return [(7 + 7919 * i) % vocab_size for i in range(PROBE_LENGTH)]


def logits_of(model: PreTrainedModel, ids: list[int]) -> torch.Tensor:
    import torch

    device = next(model.parameters()).device
    with torch.inference_mode():
        return model(input_ids=torch.tensor([ids], device=device)).logits[0].float().cpu()


@lru_cache(maxsize=4)
def _source_logits(source: str, content_hash: str, vocab_size: int) -> torch.Tensor:
    import torch

    model = load_causal_lm(source, dtype=torch.float32).eval()
    return logits_of(model, probe_ids(vocab_size))


def compare(variant: torch.Tensor, source: torch.Tensor) -> ProbeResult:
    import torch

    a, b = variant - variant.mean(-1, keepdim=True), source - source.mean(-1, keepdim=True)
    cosine = torch.nn.functional.cosine_similarity(a, b, dim=-1).mean().item()
    top1 = (variant.argmax(-1) == source.argmax(-1)).float().mean().item()
    return ProbeResult(round(cosine, 6), round(top1, 6))


def check_layer_by_layer(variant: torch.Tensor, source: torch.Tensor, method: str) -> ProbeResult:
    """A streamed build's probe (its logits beside the source's, the layers run side by side as they passed):
    refused below MIN_COSINE, as check_built refuses an in-memory build."""
    result = compare(variant, source)
    if not result.cosine >= MIN_COSINE:
        raise ValueError(f"{method}: the variant's logits are unrelated to the source's (cosine {result.cosine:.3f} < "
                         f"{MIN_COSINE}); nothing was saved")
    return result


def check_built(model: PreTrainedModel, source: Path, content_hash: str, method: str) -> ProbeResult:
    """Refuse a built model that has unmaterialised tensors or does not behave like its source."""
    check_materialised(model, f"{method} variant of {source}")
    vocab = model.get_input_embeddings().num_embeddings
    result = compare(logits_of(model, probe_ids(vocab)), _source_logits(str(source), content_hash, vocab))
    if not result.cosine >= MIN_COSINE:
        differing = differing_parameters(model, source)
        named = f"; parameters that differ from the source: {', '.join(differing[:8])}" if differing else ""
        raise UnmaterialisedModelError(
            f"the {method} variant of {source} does not behave like its source on the fixed probe "
            f"(logit cosine {result.cosine:.3f} < {MIN_COSINE}, top-1 agreement {result.top1_agreement:.2f}): "
            f"its weights were not all loaded{named}; nothing was saved"
        )
    return result


def differing_parameters(model: PreTrainedModel, source: Path, atol: float = 1e-2) -> list[str]:
    """Unquantized parameters (same name and shape as in the source's safetensors) whose values differ."""
    import torch
    from safetensors import safe_open

    params = dict(model.named_parameters())
    differing = []
    for file in sorted(Path(source).glob("*.safetensors")):
        with safe_open(str(file), framework="pt") as handle:
            for key in handle.keys():
                ours = params.get(key)
                if ours is None or ours.device.type == "meta" or not ours.is_floating_point():
                    continue
                theirs = handle.get_tensor(key)
                if ours.shape == theirs.shape and not torch.allclose(
                    ours.detach().float().cpu(), theirs.float(), atol=atol, rtol=1e-2
                ):
                    differing.append(key)
    return differing


@dataclass(frozen=True)
class TensorCheck:
    """A streamed build checked tensor by tensor against its source (no model is ever whole in memory)."""

    tensors: int  # tensors compared
    worst_ratio: float  # max over quantized elements of |source - dequantized| / its bound (≤ 1 passes)
    worst_tensor: str
    relative_error: float  # ‖source - dequantized‖ / ‖source‖ over every quantized weight


def check_streamed(plan, weights: Path) -> TensorCheck:
    """Read the written variant back and compare every tensor with its source, block by block.

    The logit probe needs the whole variant and the whole source in memory; what it guards against
    (values that are not the source's: unwritten, misplaced, from another tensor) shows tensor by tensor
    too. A quantized weight must lie within its format's rounding bound of the source's values (int8:
    half a step per element; int4: half a step plus bf16 rounding of the scale and zero), an unquantized
    one must equal the source cast to the option dtype.
    """
    from safetensors import safe_open

    from quantize.streaming import source_blocks

    worst, worst_name, err2, ref2 = 0.0, "", 0.0, 0.0
    with safe_open(str(weights), framework="pt") as variant:
        for job in plan.jobs:
            start = 0
            for block in source_blocks(plan.source, job.source_key):
                block = block.to(plan.dtype)
                rows = block.shape[0] if block.dim() else 1
                if job.kind == "copy":
                    written = variant.get_slice(job.outputs[0])[start:start + rows] if block.dim() else \
                        variant.get_tensor(job.outputs[0])
                    if not bool((written.to(block.dtype) == block).all()):
                        raise _mismatch(plan, job.outputs[0], "is not the source's value")
                else:
                    ratio, e2, r2 = _quantized_error(job, variant, block, start)
                    err2, ref2 = err2 + e2, ref2 + r2
                    if ratio > worst:
                        worst, worst_name = ratio, job.outputs[0]
                start += rows
    if worst > 1.0:
        raise _mismatch(plan, worst_name, f"is {worst:.2f}x its rounding bound away from the source")
    return TensorCheck(len(plan.jobs), round(worst, 6), worst_name, round((err2 / max(ref2, 1e-30)) ** 0.5, 6))


def _quantized_error(job, variant, block: torch.Tensor, start: int) -> tuple[float, float, float]:
    """(max error / bound, squared error, squared source) of rows [start, start + len(block)); the bound is
    per row (int8) or per group (int4), so the error's maximum is taken there first (fewer passes)."""
    import torch

    from serving.model.quant.int4 import dequantize_rows

    stop = start + block.shape[0]
    source = block.float()
    if job.kind == "int8":
        q = variant.get_slice(job.outputs[0])[start:stop]
        scale = variant.get_slice(job.outputs[1])[start:stop]
        diff = source - q.float() * scale[:, None]
        worst = diff.abs().amax(dim=1)
        # half a step, and float rounding of w / s and q * s (relative 2^-23 of the row's largest value)
        bound = 0.5 * scale * (1 + 1e-3) + 1e-6 * 127 * scale
    else:
        sz = variant.get_slice(job.outputs[1])[:, start:stop]  # [K/g, rows, 2]
        diff = source - dequantize_rows(variant.get_slice(job.outputs[0])[start:stop], sz, job.group_size,
                                        torch.float32)
        worst = diff.abs().view(diff.shape[0], -1, job.group_size).amax(dim=-1)  # [rows, K/g]
        per_group = sz.float().transpose(0, 1)  # [rows, K/g, 2]
        step, zero = per_group[..., 0].abs(), per_group[..., 1].abs()
        # half a step, and the bf16 rounding (2^-8 relative) of the scale (times |q - 8| <= 8) and the zero
        bound = 0.5 * step * (1 + 1e-3) + 8 * step * 2**-8 + zero * 2**-8 + 1e-6
    ratio = (worst / bound).max().item() if worst.numel() else 0.0
    return ratio, torch.linalg.vector_norm(diff).item() ** 2, torch.linalg.vector_norm(source).item() ** 2


def _mismatch(plan, name: str, what: str) -> UnmaterialisedModelError:
    return UnmaterialisedModelError(
        f"the {plan.method} variant of {plan.source.directory}: {name} {what}; nothing was saved")
