"""What of a file the page cache holds, for tests of writers that drop what they wrote (quantgate.files)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest


def resident_fraction(path: Path) -> float:
    """The share of `path`'s pages in the page cache (mincore over a private mapping of it)."""
    import ctypes
    import mmap

    size = path.stat().st_size
    with open(path, "rb") as handle, mmap.mmap(handle.fileno(), size, access=mmap.ACCESS_COPY) as mapped:
        pages = (size + mmap.PAGESIZE - 1) // mmap.PAGESIZE
        vec = (ctypes.c_ubyte * pages)()
        address = ctypes.addressof(ctypes.c_char.from_buffer(mapped))
        libc = ctypes.CDLL(None, use_errno=True)
        assert libc.mincore(ctypes.c_void_p(address), ctypes.c_size_t(size), vec) == 0, ctypes.get_errno()
        return sum(v & 1 for v in vec) / pages


def skip_where_synced_pages_stay(directory: Path) -> None:
    """Skip the test on a filesystem that keeps synced pages cached (tmpfs): there nothing can be dropped."""
    probe = directory / "page-cache-probe.bin"
    probe.write_bytes(os.urandom(4 << 20))
    assert resident_fraction(probe) > 0.9  # a file written the plain way stays cached
    with open(probe, "rb") as handle:
        os.fsync(handle.fileno())
        os.posix_fadvise(handle.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)
    dropped = resident_fraction(probe) <= 0.1
    probe.unlink()
    if not dropped:
        pytest.skip("this filesystem keeps synced pages cached (tmpfs)")
