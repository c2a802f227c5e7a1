"""This machine's measured costs for the release plan: a short pilot of our engine on the model — seconds per
eval item per task, per speed round, per prompt token, per decode step at each batch, per load — and of each
quantization on the model's first layers (quantize/pilot.py) (`quantgate release --plan`: gates/release_plan.py
sizes n with them, gates/time_plan.py adds up each stage)."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from gates.judging.policy import Policy

PILOT_ITEMS = (4, 32)  # items per task timed twice: the difference is the per-item cost, without the task's setup;
# a release submits a suite's items together and the engine batches them: at 1 and 3 items the difference was
# latency, 3.3x the batched cost (Qwen2.5-Coder-0.5B, six suites at 40 items: 0.46 s planned, 0.14 s measured).
# At 40 items the plan is 3 t16 - 2 t4 from 4 and 16 (a run's noise tripled: 4.4-8.0 s for ARC-Easy's 4.4 s
# over two pilots), 1.29 t32 - 0.29 t4 from 4 and 32.
PILOT_CANARY_REQUESTS = 8  # replayed through one server and the router: the canary's cost per request


@dataclass(frozen=True)
class CutServed:
    """The model and one variant cut to the same few decoder layers (`layers`, two depths), as the engine serves
    them: each one's load and decode step at each depth, (baseline, variant). Each line through the two depths
    is a fixed part (embedding, head, runtime) and a part per layer: at the model's `model_layers` the two lines
    differ by what the whole variant saves (or costs) beside the whole baseline (gates.time_plan.less_saved)."""

    layers: tuple[int, int]
    model_layers: int
    load_s: tuple[tuple[float, float], tuple[float, float]]  # (baseline, variant) at layers[0], then at layers[1]
    step_s: tuple[tuple[float, float], tuple[float, float]]

    def saved(self, field_name: str) -> float:
        """Seconds the whole variant saves beside the whole baseline in `load_s` or `step_s` (< 0: it costs)."""
        (b1, v1), (b2, v2) = getattr(self, field_name)
        n1, n2 = self.layers
        slope = ((b2 - v2) - (b1 - v1)) / (n2 - n1)
        return (b1 - v1) + (self.model_layers - n1) * slope


@dataclass
class Timing:
    """This machine's measured costs (one model): seconds per item per task, per speed round (every point),
    prompt tokens per second (fidelity chunks and long-context probes are prompt-bound); where from."""

    item_s: dict[str, float] = field(default_factory=dict)
    setup_s: dict[str, float] = field(default_factory=dict)  # per task and run, whatever its items (lm-eval
    # building its requests; the first task's also the harness's first import)
    round_s: float | None = None
    prefill_tps: float | None = None
    load_s: float | None = None  # the engine's load of the model
    first_load_s: float = 0.0  # what a fresh process's first load pays beyond a warm one: the kernels loaded, the
    # model's classes imported, first calls (never the kernels' build: the pilot's own first load makes what a fresh
    # home lacks, 45 s of SmolLM2-135M's 49 s there, and a release after the plan finds them)
    decode_s: dict[int, float] = field(default_factory=dict)  # batch -> seconds of its decode point (context + steps)
    source: str = ""
    round_source: str = ""
    quantize: dict[str, Any] = field(default_factory=dict)  # stage label -> quantize.pilot.QuantizeTiming
    canary_up_s: float | None = None  # a server and the router in front of it started and stopped
    canary_request_s: float | None = None  # per request replayed through them at the canary's concurrency
    serving_wave_s: float | None = None  # one wave of the measure stage's serving benchmark, as it runs there
    first_wave_s: float = 0.0  # what a process's first wave pays beyond it (its first server and streams)
    variants: dict[str, CutServed] = field(default_factory=dict)  # quantize stage label -> its cut, served
    source_hash_s: float = 0.0  # the release's hashing of the source (none where its hash is remembered)
    snapshot_s: float = 0.0  # a first release's copy of the source for the registry (none where it makes none)


def _time(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def _item_seconds(engine, task: str) -> tuple[float, float]:
    """A task's seconds per item and per run: two pilot runs of PILOT_ITEMS items, on different items (the
    engine's prefix cache would serve a repeated item's prompt, which a release computes), the difference over
    the extra items per item (the larger run's mean if noise inverts it), what the smaller run took beyond its
    items per run (a release pays it once per task and model). A task with fewer items takes overlapping ones."""
    from evals.run import run_suite
    from evals.tasks import available_items, resolve_tasks

    small, large = PILOT_ITEMS
    available = available_items(resolve_tasks([task])[0]) or small + large
    second = range(small, small + large) if available >= small + large else range(max(available - large, 0), available)
    t_small = _time(lambda: run_suite(engine, [task], docs=range(small)))
    t_large = _time(lambda: run_suite(engine, [task], docs=second))
    per_item = (t_large - t_small) / (len(second) - small)
    if per_item <= 0:
        return t_large / len(second), 0.0
    return per_item, max(t_small - small * per_item, 0.0)


def _round_seconds(engine, policy: Policy, seed: int) -> tuple[float, float, dict[int, float]]:
    """One model's speed round at the policy's points (as flows.speed_rounds times them, context prefill
    included), its prompt tokens per second and each decode point's seconds: (seconds, tok/s, {batch: s}).
    Each round its own prompts (`seed`): a repeat would come from the prefix cache (the speed stage's engines
    have none), as the warm-up's did (Qwen2.5-Coder-0.5B: a 512-token prefill timed 0.08 s, 0.51 s uncached)."""
    import random

    from serving import SamplingParams

    sp, rng = policy.speed, random.Random(seed)

    def prompts(n: int, length: int) -> list[list[int]]:
        return [[rng.randrange(1000, engine.vocab_size) for _ in range(length)] for _ in range(n)]

    prefill = _time(lambda: engine.generate(prompts(1, sp.prefill_tokens),
                                            SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)))
    decode = {b: _time(lambda b=b: engine.generate(prompts(b, sp.decode_context), SamplingParams(
        max_tokens=sp.decode_steps + 1, temperature=0.0, ignore_eos=True)))
        for b in policy.decode_batches}  # the flow times every batch, gated or not (flows.data.SpeedPlan)
    return sp.prefill_calls * prefill + sum(decode.values()), sp.prefill_tokens / prefill, decode


def _canary_seconds(engine, canary) -> tuple[float, float]:
    """(start and stop, seconds per request) of the canary's replay (`canary`: gates.time_plan.CanaryShape)
    through a server on `engine` and the router in front of it: the same HTTP, streaming and routing as the
    canary's, with one engine where the canary runs two on the same cores (Qwen2.5-Coder-0.5B, 24 requests:
    6.4 s here, 7.3 s beside its int8wo variant, 8.5 s beside a second baseline). Last: the engine is served."""
    import secrets

    from serving.http.server import build_app
    from serving.http.server_thread import ServerThread
    from serving.loadgen.replay import replay, traffic
    from serving.routing.router import build_router_app, parse_router_config

    n = max(min(canary.requests, PILOT_CANARY_REQUESTS), 1)
    start = time.perf_counter()
    with ServerThread(build_app(engine, served_model_name="pilot", version="pilot")) as server:
        config = parse_router_config({"versions": {"pilot": {"weight": 1.0, "backends": [server.url]}},
                                      "canary": "pilot", "admin_key": secrets.token_hex(16)}, source="the pilot's router")
        with ServerThread(build_router_app(config)) as router:
            up = time.perf_counter()
            records = replay(router.url, traffic(n, seed=1), canary.concurrency, canary.max_tokens)
            replayed = time.perf_counter()
    failed = [r["error"] for r in records if r["error"]]
    if failed:
        raise RuntimeError(f"the pilot's canary replay failed: {failed[0]}")
    return up - start + time.perf_counter() - replayed, (replayed - up) / n


def pilot(model: str, tasks: list[str], policy: Policy, need_items: bool = True, release=None) -> Timing:
    """Time each of `release`'s quantizations (gates.time_plan.ReleaseShape) on the model's first layers; load the
    engine on `model` twice (the first load's excess is the process's once); time PILOT_ITEMS items of every task
    (when `need_items`), one speed round after a warm-up one, a few of the canary's requests replayed through a
    server and the router, and each variant's deeper build served beside the model cut alike (CutServed)."""
    import tempfile

    from quantgate.allocator import release_engine_memory
    from quantgate.env import home
    from quantgate.models import resolve_model
    from quantize.pilot import quantize_timing, source_copy_seconds, source_hash_seconds
    from serving import LLMEngine

    source = str(resolve_model(model))
    # first, as the release copies first, before the pilot's builds leave their writes to the disk
    snapshot_s = source_copy_seconds(Path(source), home() / "flows") if release is not None and release.snapshot else 0.0
    with tempfile.TemporaryDirectory(prefix="quantgate-pilot-") as kept:
        built = {label: quantize_timing(Path(source), method, options, keep=Path(kept) / label)
                 for label, method, options in (release.quantize if release else ())}
        LLMEngine.from_pretrained(source)  # this process's first load, dropped at once: two never resident
        release_engine_memory()
        first_s = _fresh_load_seconds(source)  # after it: this plan has built the kernels a fresh home lacked
        start = time.perf_counter()
        engine = LLMEngine.from_pretrained(source)
        load_s = time.perf_counter() - start
        timing = Timing(source=f"measured here: a pilot of {PILOT_ITEMS[0]} and {PILOT_ITEMS[1]} items per task on "
                        f"{model}", load_s=load_s, first_load_s=max(first_s - load_s, 0.0), quantize=built,
                        source_hash_s=source_hash_seconds(Path(source)), snapshot_s=snapshot_s)
        if need_items:
            for task in tasks:
                timing.item_s[task], timing.setup_s[task] = _item_seconds(engine, task)
        _round_seconds(engine, policy, seed=0)  # warm-up: first calls pay for allocation and kernel selection
        timing.round_s, timing.prefill_tps, timing.decode_s = _round_seconds(engine, policy, seed=1)
        timing.round_source = f"one pilot round of the baseline on {model}"
        if release is not None:
            timing.serving_wave_s, timing.first_wave_s = _serving_wave_seconds(engine, release.measure)
        if release is not None and release.canary is not None:
            timing.canary_up_s, timing.canary_request_s = _canary_seconds(engine, release.canary)
        del engine
        release_engine_memory()
        if release is not None:
            batch, steps = release.measure.bench_concurrency, release.measure.bench_max_tokens
            timing.variants = {label: cut_served(Path(kept) / label, q.kept, q.layers, batch, steps)
                               for label, q in built.items() if len(q.kept) == 2}
    return timing


def _fresh_load_seconds(source: str) -> float:
    """The engine's load as a fresh process's first (the release's baseline measure: its quantizations ran in
    children), serving already imported as the flow has it: this machine's kernels loaded, the model's classes
    imported, first calls. Qwen2.5-Coder-0.5B: 5.5-6.4 s in
    the release where the pilot's own first load, after its quantize builds, took 2.0 s."""
    import subprocess
    import sys

    code = ("import sys, time; from serving import LLMEngine; start = time.perf_counter(); "
            "LLMEngine.from_pretrained(sys.argv[1]); print(time.perf_counter() - start)")
    done = subprocess.run([sys.executable, "-c", code, source], check=True, capture_output=True, text=True,
                          cwd=Path(__file__).resolve().parents[1])
    return float(done.stdout.strip().splitlines()[-1])


def _serving_wave_seconds(engine, measure) -> tuple[float, float]:
    """Seconds of one wave of the measure stage's serving benchmark (`measure`: gates.time_plan.MeasureShape):
    `bench_concurrency` streams of `bench_max_tokens` tokens through our server, stepped on this thread, as
    flows/serving_harness.py runs it (the HTTP streaming costs beside the decode steps: 94 ms a step there for
    Qwen2.5-Coder-0.5B at 4 streams, 54 ms in the engine alone). A first wave, then two timed: (seconds a wave,
    what the process's first wave pays beyond it: its first server's start; 0.1-0.3 s at 0.5B once uvicorn no
    longer reconfigured the process's logging, serving/http/server_thread.py)."""
    from serving.http.server import build_app
    from serving.http.server_thread import ServerThread, run_beside_engine
    from serving.loadgen.run import run_serving_benchmark

    app = build_app(engine, served_model_name="pilot", version="pilot", engine_thread=False)
    streams = max(measure.bench_concurrency, 1)

    def waves(n: int) -> None:
        run_beside_engine(app.state.engine_loop, lambda: run_serving_benchmark(
            server.url, "pilot", num_requests=n * streams, concurrency=streams, max_tokens=measure.bench_max_tokens,
            ignore_eos=True, temperature=0.0, seed=n))

    with ServerThread(app) as server:
        first = _time(lambda: waves(1))
        wave = _time(lambda: waves(2)) / 2
    return wave, max(first - wave, 0.0)


def _served_seconds(path: Path, batch: int, steps: int) -> tuple[float, float]:
    """(load, seconds per decode step at `batch` short prompts) of the engine on `path`, the step timed after a
    first call; the engine dropped after."""
    from quantgate.allocator import release_engine_memory
    from serving import LLMEngine, SamplingParams

    start = time.perf_counter()
    engine = LLMEngine.from_pretrained(str(path))
    load_s = time.perf_counter() - start
    params = SamplingParams(max_tokens=steps + 1, temperature=0.0, ignore_eos=True)

    def prompts(seed: int) -> list[list[int]]:
        return [[1000 + 97 * seed + 13 * i + j for j in range(16)] for i in range(batch)]

    engine.generate(prompts(0), params)
    start = time.perf_counter()
    engine.generate(prompts(1), params)
    step_s = (time.perf_counter() - start) / (steps + 1)
    del engine
    release_engine_memory()
    return load_s, step_s


def cut_served(kept: Path, layers: tuple[int, int], model_layers: int, batch: int, steps: int) -> CutServed:
    """The variant's builds kept by the quantize pilot (kept/<layers>/variant) and the source cut alike
    (kept/<layers>/source), each loaded and stepped; the variant loaded once before, untimed (its kernel path's
    first calls)."""
    _served_seconds(kept / str(layers[0]) / "variant", batch, 1)
    pairs = [(_served_seconds(kept / str(n) / "source", batch, steps), _served_seconds(kept / str(n) / "variant", batch, steps))
             for n in layers]
    return CutServed(layers, model_layers, tuple((b[0], v[0]) for b, v in pairs), tuple((b[1], v[1]) for b, v in pairs))
