"""The CPU KV cache's memory: every layer's K and V (and int8 scales) in one anonymous mapping advised for
2 MB pages (madvise MADV_HUGEPAGE), so that transparent huge pages back it where the kernel's THP mode is
`madvise` (the common default) as well as `always`.

Decode attention reads each sequence's blocks where the block table put them, scattered over the cache: on
4 KB pages nearly every 2 KB block read misses the TLB and walks the page table. On 2 MB pages the paged
decode kernel ran 1.2-1.55x faster at 64 sequences x 128-2048 tokens (SmolLM2-135M's layer, AMX Xeon;
docs/results/2026-12-06-engine-under-load.md). CUDA caches, a kernel without THP or
QUANTGATE_KV_HUGE_PAGES=0: plain torch.zeros, as before.

The cost is at start: faulting a 2.15 GB cache in on huge pages took 7-12 s where the kernel had to compact
memory for them (0.2 s once it had free huge pages; 4 KB pages: 0.6 s), so only an engine that lives long asks
for it (`quantgate serve`); releases, evals and tests load engines by the dozen on fresh caches, whose
blocks sit side by side anyway.
"""

from __future__ import annotations

import math
import mmap
import sys

import torch

from quantgate import settings

HUGE_PAGE = 2 << 20


def huge_pages_wanted(device: torch.device) -> bool:
    return (torch.device(device).type == "cpu" and sys.platform.startswith("linux")
            and hasattr(mmap, "MADV_HUGEPAGE") and settings.enabled(settings.KV_HUGE_PAGES))


def zeroed_tensors(shapes: list[tuple[tuple[int, ...], torch.dtype]], device: torch.device | str,
                   huge_pages: bool = False) -> list[torch.Tensor]:
    """Zeroed tensors of these shapes and dtypes on `device`: with `huge_pages` (a CPU device: see
    huge_pages_wanted), views into one mapping on 2 MB pages, each starting on a 64-byte boundary; else each
    its own."""
    device = torch.device(device)
    if not huge_pages:
        return [torch.zeros(shape, dtype=dtype, device=device) for shape, dtype in shapes]
    offsets, total = [], 0
    for shape, dtype in shapes:
        offsets.append(total)
        total += -(-math.prod(shape) * dtype.itemsize // 64) * 64
    region = mmap.mmap(-1, max(total, 1) + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    raw = torch.frombuffer(region, dtype=torch.uint8)  # holds the mapping for as long as a view lives
    start = -raw.data_ptr() % HUGE_PAGE  # the first 2 MB boundary: the huge pages' frame
    if total >= HUGE_PAGE:
        try:
            region.madvise(mmap.MADV_HUGEPAGE, start, total // HUGE_PAGE * HUGE_PAGE)
        except OSError:  # a kernel built without THP: the mapping stays on 4 KB pages
            pass
    # Every page faulted in now, as torch.zeros did: left to the first write of each block, the faults (and
    # in THP's `madvise` defrag mode the compaction each huge page may need) fell on prefill's cache stores,
    # 15 ms a layer for 2,048 tokens instead of 0.8 (SmolLM2-135M, AMX Xeon).
    raw[start:start + total].zero_()
    return [raw[start + at:start + at + math.prod(shape) * dtype.itemsize].view(dtype).view(shape)
            for at, (shape, dtype) in zip(offsets, shapes, strict=True)]
