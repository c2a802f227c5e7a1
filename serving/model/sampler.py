"""Turn the last-position logits of each sequence into its next token (and logprobs when asked)."""

from __future__ import annotations

import torch

from serving.core.sequence import Sequence, TokenLogprob

NO_TOKEN = -1  # a row whose logits are not all finite (a broken model or variant): that sequence fails alone


def sample(logits: torch.Tensor, seqs: list[Sequence], generators: dict[str, torch.Generator],
           greedy_pick=None) -> list[int]:
    """logits: [len(seqs), vocab] in the head's dtype. Greedy rows share one argmax: `greedy_pick`
    (fused_ops.cpp: one read of the logits as they are, -1 for a row with NaN/inf) where the CPU kernels run,
    else torch's over an fp32 copy; others sample one by one in fp32. A row with NaN/inf logits gets
    NO_TOKEN instead of failing every sequence of the step."""
    if greedy_pick is not None and logits.dtype in (torch.float32, torch.bfloat16):  # the kernel's two dtypes
        picked = greedy_pick(logits).tolist()
        next_tokens, finite = [NO_TOKEN if t < 0 else t for t in picked], [t >= 0 for t in picked]
    else:
        # max(dim) gives argmax's index (the first of ties) and the row's max in one pass, cheaper than argmax
        # on CPU (docs/results/design-figures.md). NaN propagates through the max, and +-inf show in max/amin: two
        # reductions instead of a [rows, vocab] boolean temporary per op (isfinite allocates three)
        rows = logits.float()
        peaks, best = rows.max(dim=-1)
        next_tokens = best.tolist()
        finite = (torch.isfinite(peaks) & torch.isfinite(rows.amin(dim=-1))).tolist()
    for i, seq in enumerate(seqs):
        p = seq.params
        if not finite[i]:
            next_tokens[i] = NO_TOKEN
            continue
        if p.greedy:
            continue
        row = logits[i].float() / p.temperature
        if p.top_k > 0 and p.top_k < row.shape[-1]:
            kth = torch.topk(row, p.top_k).values[-1]
            row = row.masked_fill(row < kth, float("-inf"))
        if p.top_p < 1.0:
            sorted_logits, order = torch.sort(row, descending=True)
            cumulative = sorted_logits.softmax(-1).cumsum(-1)
            drop = cumulative - sorted_logits.softmax(-1) >= p.top_p  # keep the smallest set reaching top_p
            row = row.masked_fill(torch.zeros_like(drop).scatter(0, order, drop), float("-inf"))
        probs = row.softmax(-1)
        next_tokens[i] = int(torch.multinomial(probs, 1, generator=generators.get(seq.request_id)).item())
    return next_tokens


def token_logprobs(logprobs: torch.Tensor, targets: list[int], top: int) -> list[TokenLogprob]:
    """logprobs: [n, vocab] log-softmaxed rows; the logprob of each target plus the `top` best."""
    chosen = logprobs.gather(1, torch.tensor(targets, device=logprobs.device)[:, None])[:, 0].tolist()
    if top > 0:
        values, indices = torch.topk(logprobs, top, dim=-1)
        tops = [list(zip(i, v, strict=True)) for i, v in zip(indices.tolist(), values.tolist(), strict=True)]
    else:
        tops = [[] for _ in targets]
    return [TokenLogprob(t, lp, tp) for t, lp, tp in zip(targets, chosen, tops, strict=True)]
