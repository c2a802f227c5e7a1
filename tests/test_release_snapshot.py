"""A first release copies a source outside the home for the registry, before any build, fsync'd; a
release of a source under the home, or of a model with a champion, copies nothing."""

from __future__ import annotations

import hashlib
from pathlib import Path

from page_cache import resident_fraction, skip_where_synced_pages_stay

from flows import records
from flows.data import Source
from flows.time_shape import first_release_snapshot
from quantgate.env import home


def _model(root: Path) -> Path:
    root.mkdir(parents=True)
    (root / "config.json").write_text('{"model_type": "llama"}')
    (root / "model.safetensors").write_bytes(bytes(range(256)) * 4096)
    return root


def test_first_release_copies_the_source_once(store, tmp_path):
    model = _model(tmp_path / "user" / "my-model")
    source = Source(ref=str(model), name="my-model", path=str(model), content_hash="ab" * 32)
    assert records.needs_snapshot(model) and first_release_snapshot(str(model))
    copy = records.snapshot_first_release(source)
    assert copy == home() / "flows" / "snapshots" / ("ab" * 16)
    assert sorted(p.name for p in copy.iterdir()) == ["config.json", "model.safetensors"]
    digest = [hashlib.sha256((d / "model.safetensors").read_bytes()).hexdigest() for d in (model, copy)]
    assert digest[0] == digest[1]
    assert not (copy.parent / (copy.name + ".partial")).exists()
    assert records.snapshot(model, source.content_hash) == copy  # registering it later copies nothing more


def test_a_source_under_the_home_is_not_copied(store):
    model = _model(home() / "models" / "converted")
    source = Source(ref=str(model), name="converted", path=str(model), content_hash="cd" * 32)
    assert not records.needs_snapshot(model) and not first_release_snapshot(str(model))
    assert records.snapshot_first_release(source) is None
    assert not (home() / "flows" / "snapshots").exists()


def test_the_copy_leaves_the_page_cache_to_the_source(tmp_path):
    """The snapshot's copy is written back and dropped from the page cache, so it cannot evict the source the
    rest of the release reads; the source stays cached (a filesystem that keeps synced pages, tmpfs, skips)."""
    import os

    skip_where_synced_pages_stay(tmp_path)
    src = tmp_path / "weights.bin"
    src.write_bytes(os.urandom(8 << 20))
    copy = records._copy_synced(str(src), str(tmp_path / "copy.bin"))
    assert resident_fraction(Path(copy)) < 0.1 and resident_fraction(src) == 1.0
    assert hashlib.sha256(Path(copy).read_bytes()).digest() == hashlib.sha256(src.read_bytes()).digest()
