"""Files: the YAML users hand to quantgate (API keys, router configs), read with a ValueError naming the file;
a file written back to disk and out of the page cache."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any


def read_yaml(path: str | Path, what: str) -> Any:
    """The parsed document; ValueError "<what> <path> does not exist / is not valid YAML: ..." otherwise."""
    import yaml

    path = Path(path)
    if not path.is_file():
        raise ValueError(f"{what} {path} does not exist")
    try:
        return yaml.safe_load(path.read_text())
    except yaml.YAMLError as exc:
        raise ValueError(f"{what} {path} is not valid YAML: {exc}") from exc


def sync_and_drop(fd: int) -> None:
    """Write the open file `fd` back to disk and drop its pages from the page cache (where the OS can): a copy
    nobody reads soon then evicts nothing the process still reads (flows/records.py's snapshot)."""
    os.fsync(fd)
    if hasattr(os, "posix_fadvise"):
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
