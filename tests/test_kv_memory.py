"""serving/model/kv_memory.py: the CPU KV cache in one mapping advised for 2 MB pages."""

from __future__ import annotations

import gc
import sys
from pathlib import Path

import pytest
import torch

from serving.model.kv_memory import HUGE_PAGE, huge_pages_wanted, zeroed_tensors

LINUX = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="madvise and /proc are Linux's")


def _vma_flags(address: int) -> list[str]:
    """The VmFlags of the mapping holding `address` (/proc/self/smaps)."""
    inside, flags = False, []
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()[0]
        if "-" in head and all(c in "0123456789abcdef-" for c in head):
            lo, hi = (int(x, 16) for x in head.split("-"))
            inside = lo <= address < hi
        elif inside and line.startswith("VmFlags:"):
            flags = line.split()[1:]
    return flags


def test_every_tensor_is_zero_its_own_and_aligned():
    shapes = [((3, 4096, 64), torch.bfloat16), ((3, 4096, 64), torch.bfloat16), ((3, 4096), torch.float16),
              ((5, 7), torch.float32)]
    tensors = zeroed_tensors(shapes, "cpu", huge_pages=True)
    assert [(tuple(t.shape), t.dtype) for t in tensors] == [(s, d) for s, d in shapes]
    assert all(t.is_contiguous() and t.data_ptr() % 64 == 0 and not t.any() for t in tensors)
    for i, t in enumerate(tensors):
        t.fill_(i + 1)
    assert [t.unique().tolist() for t in tensors] == [[1.0], [2.0], [3.0], [4.0]]  # no view overlaps another
    plain = zeroed_tensors(shapes, "cpu", huge_pages=False)
    assert [(tuple(t.shape), t.dtype) for t in plain] == [(s, d) for s, d in shapes] and not any(t.any() for t in plain)


@LINUX
def test_the_cache_mapping_is_advised_for_huge_pages_and_freed_with_its_views():
    import mmap

    if not hasattr(mmap, "MADV_HUGEPAGE") or not Path("/sys/kernel/mm/transparent_hugepage").is_dir():
        pytest.skip("no transparent huge pages here (this Python's mmap or the kernel)")
    (k,) = zeroed_tensors([((4, HUGE_PAGE), torch.uint8)], "cpu", huge_pages=True)
    assert k.data_ptr() % HUGE_PAGE == 0 and "hg" in _vma_flags(k.data_ptr())  # madvise(MADV_HUGEPAGE) took
    address = k.data_ptr()
    del k
    gc.collect()
    assert not _vma_flags(address)  # the mapping went with its last view


def test_huge_pages_are_for_cpu_caches_and_can_be_switched_off(monkeypatch):
    assert not huge_pages_wanted(torch.device("meta"))
    monkeypatch.setenv("QUANTGATE_KV_HUGE_PAGES", "0")
    assert not huge_pages_wanted(torch.device("cpu"))


@pytest.mark.parametrize("asked", [True, False])
def test_an_engine_that_asks_keeps_its_cache_in_the_advised_mapping(tiny_model_dir, asked):
    from serving import LLMEngine, SamplingParams

    engine = LLMEngine.from_pretrained(str(tiny_model_dir), kv_cache_memory_gb=0.01, kv_huge_pages=asked)
    runner = engine.runner
    base = runner.k_cache[0].untyped_storage().data_ptr()
    shared = all(t.untyped_storage().data_ptr() == base for t in runner.k_cache + runner.v_cache)
    assert shared == (asked and huge_pages_wanted(torch.device("cpu")))  # one mapping where huge pages can back it
    out = engine.generate([[5, 6, 7, 8]], SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True))
    assert len(out[0].token_ids) == 3 and runner.kv_cache_bytes() > 0
