"""Watch model directories and GGUF files; report a change once its content has settled.

Cheap polling: a stat signature (names, sizes, mtimes) per path every `interval_s`; when it moves, the
path is pending until the signature has stayed still for `debounce_s` (a copy in progress is not a
release); then the content hash decides whether the model really changed (a `touch` is not a change).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

from quantgate.models import content_hash, file_sha256


def check_watchable(path: str | Path) -> Path:
    p = Path(path).expanduser()
    if p.is_dir():
        if not (p / "config.json").is_file():
            raise ValueError(f"{p} is a directory but not a HF model directory (no config.json)")
        return p.resolve()
    if p.suffix == ".gguf":
        if not p.is_file():
            raise ValueError(f"GGUF file not found: {p}")
        return p.resolve()
    if not p.exists():
        raise ValueError(f"cannot watch {p}: it does not exist")
    raise ValueError(f"cannot watch {p}: neither a HF model directory nor a .gguf file")


def signature(path: Path) -> tuple:
    """What changes whenever a file under `path` is written: names, sizes, modification times."""
    files = [path] if path.is_file() else sorted(p for p in path.rglob("*") if p.is_file())
    entries = []
    for f in files:
        try:
            st = f.stat()
        except FileNotFoundError:  # removed while we looked: the next poll sees the new state
            continue
        entries.append((str(f.relative_to(path)) if f != path else f.name, st.st_size, st.st_mtime_ns))
    return tuple(entries)


def digest(path: Path) -> str:
    return file_sha256(path) if path.is_file() else content_hash(path)


@dataclass
class Watched:
    path: Path
    signature: tuple
    digest: str
    pending_since: float | None = None


@dataclass(frozen=True)
class Change:
    path: Path
    old_digest: str
    new_digest: str


class ModelWatcher:
    def __init__(self, paths: Iterable[str | Path], debounce_s: float = 5.0, clock: Callable[[], float] = time.monotonic):
        checked = [check_watchable(p) for p in paths]
        if not checked:
            raise ValueError("nothing to watch: give at least one model directory or .gguf file")
        if debounce_s < 0:
            raise ValueError(f"debounce must be >= 0 seconds, got {debounce_s}")
        self.debounce_s = debounce_s
        self.clock = clock
        self.items = {p: Watched(p, signature(p), digest(p)) for p in checked}

    def poll(self) -> list[Change]:
        """One look at every path; the changes whose content settled since the last look."""
        now = self.clock()
        changes: list[Change] = []
        for item in self.items.values():
            if not item.path.exists():  # being replaced (rename dance) or deleted: wait for it
                item.pending_since = now
                continue
            sig = signature(item.path)
            if sig != item.signature:
                item.signature, item.pending_since = sig, now
                continue
            if item.pending_since is None or now - item.pending_since < self.debounce_s:
                continue
            item.pending_since = None
            new = digest(item.path)
            if new != item.digest:
                changes.append(Change(item.path, item.digest, new))
                item.digest = new
        return changes

    def run(self, on_change: Callable[[Change], None], interval_s: float = 2.0, max_polls: int | None = None) -> None:
        polls = 0
        while max_polls is None or polls < max_polls:
            for change in self.poll():
                on_change(change)
            polls += 1
            time.sleep(interval_s)
