"""What the Triton kernels read for one step, built on the host and copied to the device in one transfer."""

from __future__ import annotations

from collections.abc import Sequence as Rows
from dataclasses import dataclass

import torch


@dataclass
class PagedStep:
    """Rows 0 .. num_decodes of the step are decode tokens (one per sequence); prefill chunks follow."""

    decode_tables: torch.Tensor  # [decodes, width] int32 block ids, padded with block 0
    decode_lens: torch.Tensor  # [decodes] int32: tokens each attends to, its new one included
    prefill_tables: torch.Tensor  # [chunks, width] int32
    prefill_starts: torch.Tensor  # [chunks] int32: first row of each chunk in the step
    prefill_lens: torch.Tensor  # [chunks] int32: tokens computed now
    prefill_context_lens: torch.Tensor  # [chunks] int32: tokens in the sequence's cache after this step
    max_prefill_len: int  # host int: sizes the prefill grid

    @property
    def num_decodes(self) -> int:
        return self.decode_lens.shape[0]

    @property
    def num_prefills(self) -> int:
        return self.prefill_lens.shape[0]

    @classmethod
    def build(cls, decode_tables: Rows[Rows[int]], decode_lens: Rows[int],
              prefill_tables: Rows[Rows[int]], prefills: Rows[tuple[int, int, int]],
              device: torch.device | str) -> PagedStep:
        """decode_tables/decode_lens per decode row; per prefill chunk its block table and
        (start row, length, context_len)."""
        width = max([len(t) for t in (*decode_tables, *prefill_tables)], default=1) or 1
        n, c = len(decode_lens), len(prefills)
        tables = [(*t, *[0] * (width - len(t))) for t in (*decode_tables, *prefill_tables)]
        # one flat buffer, one copy: tables, decode lengths, then the chunks' starts, lengths, context lengths
        flat = [b for t in tables for b in t] + list(decode_lens) + [x for column in zip(*prefills, strict=True) for x in column]
        dev = torch.tensor(flat, dtype=torch.int32).to(device)
        at = (n + c) * width
        chunk = dev[at + n :].view(3, c) if c else dev.new_zeros(3, 0)
        return cls(dev[: n * width].view(n, width), dev[at : at + n], dev[n * width : at].view(c, width),
                   chunk[0], chunk[1], chunk[2], max((length for _, length, _ in prefills), default=0))
