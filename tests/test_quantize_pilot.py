"""The quantize pilot (quantize/pilot.py) times real builds of a model cut to its first layers: the cut source
is the model with fewer layers, and its build is the variant a release would make of those layers."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from quantize.pilot import QuantizeTiming, build_seconds, decoder_layers, quantize_timing, truncated_source


def test_a_truncated_source_says_fewer_layers_and_links_the_weights(tiny_model_dir: Path, tmp_path: Path) -> None:
    layers = decoder_layers(tiny_model_dir)
    assert layers >= 2
    cut = truncated_source(tiny_model_dir, 1, tmp_path / "cut")
    config = json.loads((cut / "config.json").read_text())
    assert config["num_hidden_layers"] == 1
    weights = [f for f in cut.iterdir() if f.suffix == ".safetensors"]
    assert weights and all(f.is_symlink() for f in weights)
    assert decoder_layers(tiny_model_dir) == layers  # the source is untouched


def test_per_layer_lists_are_cut_with_the_count(tmp_path: Path) -> None:
    source = tmp_path / "src"
    source.mkdir()
    (source / "config.json").write_text(json.dumps({"text_config": {"num_hidden_layers": 4,
                                                                    "layer_types": ["a", "b", "a", "b"]},
                                                    "architectures": ["X"]}))
    cut = json.loads((truncated_source(source, 2, tmp_path / "cut") / "config.json").read_text())
    assert cut["text_config"] == {"num_hidden_layers": 2, "layer_types": ["a", "b"]}
    assert cut["architectures"] == ["X"]


@pytest.mark.parametrize("method", ["int8wo", "int4-awq"])
def test_the_pilot_builds_the_cut_model_and_keeps_nothing(tiny_model_dir: Path, method: str, tmp_path: Path,
                                                          monkeypatch) -> None:
    monkeypatch.setattr("tempfile.tempdir", str(tmp_path))
    assert build_seconds(tiny_model_dir, method, {}, 1) > 0
    assert list(tmp_path.iterdir()) == []  # the cut source and its variant are gone


def test_quantize_timing_adds_up(tiny_model_dir: Path) -> None:
    timing = quantize_timing(tiny_model_dir, "int8wo")
    assert isinstance(timing, QuantizeTiming) and timing.layers == decoder_layers(tiny_model_dir)
    assert timing.fixed_s >= 0 and timing.per_layer_s >= 0 and timing.start_s >= 0
    assert timing.seconds == pytest.approx(timing.start_s + timing.fixed_s + timing.layers * timing.per_layer_s)
    assert timing.start_s > 0.5  # a fresh interpreter imports torch before it builds


def test_the_kept_builds_are_served_beside_the_source_cut_alike(tiny_model_dir: Path, tmp_path: Path) -> None:
    """The time plan costs a variant's load and decode step from its pilot builds at both depths, each served
    beside the source cut to the same layers (gates.pilot.cut_served)."""
    from gates.pilot import cut_served

    kept = tmp_path / "kept"
    timing = quantize_timing(tiny_model_dir, "int8wo", keep=kept)
    assert timing.kept == (1, min(6, timing.layers)) and decoder_layers(kept / "1" / "source") == 1
    assert all((kept / str(n) / "variant" / "quantgate.json").is_file() for n in timing.kept)
    cut = cut_served(kept, timing.kept, timing.layers, batch=2, steps=4)
    assert (cut.layers, cut.model_layers) == (timing.kept, timing.layers)
    assert min(min(pair) for pair in cut.load_s + cut.step_s) > 0


def test_the_source_hash_is_costed_until_it_is_remembered(tiny_model_dir: Path, tmp_path: Path) -> None:
    """A release hashes the source as it resolves it unless its hash is remembered for the directory as it is."""
    import shutil

    from quantize.pilot import source_hash_seconds
    from quantize.variant import cached_content_hash, memoized_content_hash

    source = Path(shutil.copytree(tiny_model_dir, tmp_path / "source"))
    assert memoized_content_hash(source) is None and source_hash_seconds(source) > 0
    digest = cached_content_hash(source)
    assert memoized_content_hash(source) == digest and source_hash_seconds(source) == 0.0
    (source / "config.json").touch()  # a newer mtime: hashed again
    assert memoized_content_hash(source) is None


def test_the_source_copy_is_costed_at_its_size_and_leaves_nothing(tiny_model_dir: Path, tmp_path: Path) -> None:
    """A first release's snapshot copy: the source's bytes at the rate of a synced sample copy into the target's
    directory, which keeps nothing of it."""
    from quantize.pilot import source_copy_seconds

    target = tmp_path / "flows"
    assert source_copy_seconds(tiny_model_dir, target) > 0
    assert list(target.iterdir()) == []


def test_one_rate_through_both_builds_holds_a_noisy_build() -> None:
    """A round-to-nearest build's rate is fitted through the origin to both depths' (parameters, seconds): a slow
    one-layer build (the VM's first touch of freed memory) may not plan the layers at nothing, as the difference
    of the two builds did (Qwen2.5-Coder-1.5B int8wo: 7.8 s at 1 layer, 6.6 s at 6)."""
    from quantize.pilot import seconds_per_parameter

    outside, per_layer = 233_000_000, 46_800_000  # Qwen2.5-Coder-1.5B: tied embedding, one decoder layer
    steady = seconds_per_parameter({1: 3.1, 6: 4.8}, outside, per_layer)
    noisy = seconds_per_parameter({1: 7.8, 6: 6.6}, outside, per_layer)
    full = outside + 28 * per_layer
    assert 14 < steady * full < 16  # its builds at 28 layers: 17-21 s beside a start of ~4 s
    assert noisy * per_layer > 0.2 and noisy * full < 2.5 * steady * full
