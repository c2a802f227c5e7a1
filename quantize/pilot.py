"""What quantizing a model costs on this machine, measured on its first decoder layers.

The pilot builds the model truncated to `PILOT_LAYERS[0]` and to `PILOT_LAYERS[1]` decoder layers, by the same code
a release runs (`quantize.variant`'s build, streamed where the method streams), into a throw-away directory, twice
each (the faster counts). A round-to-nearest build streams bytes: one seconds-per-parameter rate is fitted to both
builds (`seconds_per_parameter`), the embedding's and head's parameters costed as a layer's. A calibrated build
(AWQ, GPTQ) costs what its layers' searches cost: the difference of the two builds is the extra layers', the
smaller less its layers the fixed part. A process's first build pays imports and first calls (5.98 s against
2.33 s for one layer of Qwen2.5-Coder-0.5B, int8wo), as a release's quantize child does once: the smaller build
runs first in a fresh interpreter, and that start's excess is costed on its own. The truncated source is the real
one with a config.json that says fewer layers (its weights linked, never copied), so the reads, casts, calibration
and writes are the real tensors' (`gates/time_plan.py` adds it up for `quantgate release --plan`).
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from quantgate.model_shape import text_config

PILOT_LAYERS = (1, 6)  # decoder layers in the two builds: five layers apart keep the per-layer figure above the
# builds' noise (Qwen2.5-Coder-0.5B: int8wo 0.25 s a layer, int4-awq 0.85; +-1 s a build); 7 of 32 layers at 8B


@dataclass(frozen=True)
class QuantizeTiming:
    method: str
    layers: int  # the model's decoder layers
    fixed_s: float  # whatever the depth
    per_layer_s: float
    start_s: float = 0.0  # a fresh process's first build beyond a warm one's: imports and first calls
    kept: tuple[int, ...] = ()  # the depths whose builds were kept (quantize_timing's `keep`)

    @property
    def seconds(self) -> float:
        return self.start_s + self.fixed_s + self.layers * self.per_layer_s


def decoder_layers(source: Path) -> int:
    return int(text_config(json.loads((source / "config.json").read_text()))["num_hidden_layers"])


def truncated_source(source: Path, layers: int, into: Path) -> Path:
    """`source` with `layers` decoder layers: every file linked but config.json, whose layer count (and every
    per-layer list, e.g. `layer_types`) is cut to `layers`."""
    config = json.loads((source / "config.json").read_text())
    text = text_config(config)  # the nested mapping itself: cut in place
    depth = int(text["num_hidden_layers"])
    for key, value in list(text.items()):
        if isinstance(value, list) and len(value) == depth:
            text[key] = value[:layers]
    text["num_hidden_layers"] = layers
    into.mkdir(parents=True)
    for file in source.iterdir():
        if file.name != "config.json" and not file.name.startswith("."):
            (into / file.name).symlink_to(file.resolve())
    (into / "config.json").write_text(json.dumps(config, indent=2))
    return into


def build_seconds(source: Path, method: str, options: dict[str, Any], layers: int, keep: Path | None = None) -> float:
    """Seconds of one build of `source` cut to `layers` decoder layers (nothing cached; nothing kept, or where
    `keep` names a new directory, the cut source in keep/source and its variant in keep/variant)."""
    from quantize.methods import get_method
    from quantize.variant import build_into

    spec = get_method(method)
    with tempfile.TemporaryDirectory(prefix="quantgate-quantize-pilot-") as tmp:
        into = keep or Path(tmp)
        cut = truncated_source(source, layers, into / "source")
        out = into / "variant"
        out.mkdir()
        start = time.perf_counter()
        build_into(spec, cut, spec.options(options), out)
        return time.perf_counter() - start


def child_build_seconds(source: Path, method: str, options: dict[str, Any], layers: int) -> float:
    """Wall seconds of a fresh interpreter that runs one `build_seconds`: what a release's quantize child pays
    (flows/stage_process.py) at this depth, its start included."""
    code = ("import json, sys; from pathlib import Path; from quantize.pilot import build_seconds; "
            "build_seconds(Path(sys.argv[1]), sys.argv[2], json.loads(sys.argv[3]), int(sys.argv[4]))")
    start = time.perf_counter()
    subprocess.run([sys.executable, "-c", code, str(source), method, json.dumps(options), str(layers)], check=True,
                   cwd=Path(__file__).resolve().parents[1], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    return time.perf_counter() - start


def quantize_timing(source: Path, method: str, options: dict[str, Any] | None = None,
                    keep: Path | None = None) -> QuantizeTiming:
    """`method`'s build of `source` (a model directory) timed at PILOT_LAYERS decoder layers: in a fresh process
    once (its start), then here at both depths (per layer and fixed). `keep`: where each depth's first build
    stays, in keep/<layers> (build_seconds), for the pilot to serve beside the source cut alike."""
    from quantize.methods import get_method

    layers, options = decoder_layers(source), options or {}
    small, large = (min(n, layers) for n in PILOT_LAYERS)
    kept = tuple(sorted({small, large})) if keep else ()
    t_child = child_build_seconds(source, method, options, small)
    runs = {small: [build_seconds(source, method, options, small, keep / str(small) if keep else None)]}
    if large != small:
        runs[large] = [build_seconds(source, method, options, large, keep / str(large) if keep else None)]
    for depth in runs:  # once more each: the faster counts (a first build paid first calls, or a cold read)
        runs[depth].append(build_seconds(source, method, options, depth))
    times = {depth: min(t) for depth, t in runs.items()}
    start = max(t_child - times[small], 0.0)
    if "calibration_tokens" in get_method(method).defaults and large != small:  # a layer's search dominates
        per_layer = max(times[large] - times[small], 0.0) / (large - small)
        return QuantizeTiming(method, layers, max(times[small] - small * per_layer, 0.0), per_layer, start, kept)
    outside, per_layer = parameter_split(source)
    rate = seconds_per_parameter(times, outside, per_layer)
    return QuantizeTiming(method, layers, rate * outside, rate * per_layer, start, kept)


def parameter_split(source: Path) -> tuple[int, int]:
    """(parameters outside the decoder layers, parameters in one), from the config's shapes."""
    from quantize.capacity import ModelShape

    shape = ModelShape.from_config(json.loads((source / "config.json").read_text()))
    per_layer = sum(o * i for o, i in shape.layer_linears())
    return shape.num_params() - shape.num_layers * per_layer, per_layer


def seconds_per_parameter(times: dict[int, float], outside: int, per_layer: int) -> float:
    """One rate through the origin over the builds (least squares, time against parameters built): a build costs
    its parameters at it, the embedding's and head's as a layer's. The difference of the two depths' times, carried
    to the model's depth (x5.4 at 28 layers), made a build's noise the plan's: Qwen2.5-Coder-1.5B's int8wo planned
    at 11-37 s where it took 18-25 s (the VM's first touch of freed memory costs a build up to +8 s at random)."""
    params = {depth: outside + depth * per_layer for depth in times}
    return sum(times[d] * params[d] for d in times) / sum(p * p for p in params.values())


HASH_SAMPLE_BYTES = 256 << 20  # read and hashed once to time this machine's sha256 over the source's files


def _total_and_largest(source: Path) -> tuple[int, Path]:
    """The source's bytes (its files but hidden ones) and its largest file, the one a rate is sampled on."""
    files = [p for p in source.rglob("*") if p.is_file() and not p.name.startswith(".")]
    return sum(p.stat().st_size for p in files), max(files, key=lambda p: p.stat().st_size)


def source_hash_seconds(source: Path) -> float:
    """What a release pays to hash the source as it resolves it (quantize.variant.cached_content_hash): nothing
    where its hash is remembered for the directory as it is now, else its bytes at the rate measured here on
    its largest file's first HASH_SAMPLE_BYTES (read as the release will read them: page cache or disk)."""
    import hashlib

    from quantize.variant import memoized_content_hash

    if memoized_content_hash(source) is not None:
        return 0.0
    total, largest = _total_and_largest(Path(source))
    digest, read = hashlib.sha256(), 0
    start = time.perf_counter()
    with open(largest, "rb") as handle:
        while read < HASH_SAMPLE_BYTES and (block := handle.read(1 << 22)):  # file_sha256's reads
            digest.update(block)
            read += len(block)
    return total / max(read, 1) * (time.perf_counter() - start)


def source_copy_seconds(source: Path, target_dir: Path, samples: int = 3) -> float:
    """What a first release pays to copy the source for the registry (flows.records.snapshot: every file copied,
    fsync'd and dropped from the page cache): its bytes at the median rate of `samples` copies of its largest
    file's first HASH_SAMPLE_BYTES into `target_dir` (where the snapshot goes: the same disk), made as
    shutil.copy2 copies (os.sendfile) and _copy_synced syncs and drops them."""
    import os
    import statistics
    import tempfile

    from quantgate.files import sync_and_drop

    total, largest = _total_and_largest(Path(source))
    target_dir.mkdir(parents=True, exist_ok=True)
    rates = []
    for _ in range(samples):
        copied = 0
        with tempfile.TemporaryFile(dir=target_dir) as out, open(largest, "rb") as handle:
            start = time.perf_counter()
            while copied < HASH_SAMPLE_BYTES and (sent := os.sendfile(out.fileno(), handle.fileno(), copied,
                                                                        min(1 << 23, HASH_SAMPLE_BYTES - copied))):
                copied += sent
            sync_and_drop(out.fileno())
            rates.append(max(copied, 1) / (time.perf_counter() - start))
    return total / statistics.median(rates)
