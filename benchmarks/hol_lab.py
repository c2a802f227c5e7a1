"""The head-of-line blocking lab: one mixed workload through static and continuous batching, side by side.

80 % short requests (8–32 new tokens) and 20 % long ones (256–512), all at once or at a fixed rate,
with a fixed seed, run through the real engine twice: once with the static scheduler (a new batch only
when the whole batch has finished) and once with the continuous one, same model, same batch size.
Output lengths are forced with `ignore_eos`. Reports completion-time percentiles of short requests and
of all requests, TTFT/TPOT, throughput, and how many times better continuous batching makes the short
requests' p99; plots their latency CDFs and a Gantt timeline of which request held which batch slot.

    quantgate bench hol --num-requests 48 --max-num-seqs 16
"""

from __future__ import annotations

import gc
import heapq
import random
import time
from collections import deque
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from benchmarks.common import output_dir
from benchmarks.hol_report import SCHEDULERS, plot_gantt, plot_short_cdf
from serving.loadgen.prompts import load_prompts
from serving.loadgen.report import ProgressBar, machine, write_json
from serving.loadgen.stats import ratio, summarize


@dataclass
class LabRequest:
    index: int
    kind: str  # "short" | "long"
    prompt: str
    max_tokens: int
    arrival: float  # seconds after the start of the run

    @property
    def request_id(self) -> str:
        return f"r{self.index}"


@dataclass
class SlotInterval:
    request_id: str
    slot: int
    start: float  # seconds after the start of the run
    end: float


@dataclass
class RunResult:
    """What one workload did in one engine: per-request timings (seconds after the start) and slots."""

    scheduler: str
    requests: list[dict[str, Any]]
    intervals: list[SlotInterval]
    makespan: float
    num_steps: int
    num_preemptions: int
    step_batch_sizes: list[int] = field(default_factory=list)
    padding_waste: float | None = None  # dynamic batching: padded token slots / useful ones


def make_workload(
    num_requests: int = 48,
    *,
    short_fraction: float = 0.8,
    short_tokens: tuple[int, int] = (8, 32),
    long_tokens: tuple[int, int] = (256, 512),
    rate: float | None = None,
    seed: int = 0,
    prompts: list[str] | None = None,
) -> list[LabRequest]:
    """A reproducible mixed workload. `rate` (requests/s) spaces arrivals evenly; None sends all at once."""
    if num_requests < 1:
        raise ValueError(f"num_requests must be at least 1, got {num_requests}")
    if not 0 <= short_fraction <= 1:
        raise ValueError(f"short_fraction must be in [0, 1], got {short_fraction}")
    for name, (lo, hi) in (("short_tokens", short_tokens), ("long_tokens", long_tokens)):
        if not 1 <= lo <= hi:
            raise ValueError(f"{name} must be a range 1 <= lo <= hi, got {lo}..{hi}")
    if rate is not None and rate <= 0:
        raise ValueError(f"rate must be positive (requests/s), got {rate}")
    rng = random.Random(seed)
    prompts = prompts or load_prompts()
    num_short = round(num_requests * short_fraction)
    kinds = ["short"] * num_short + ["long"] * (num_requests - num_short)
    rng.shuffle(kinds)
    workload = []
    for i, kind in enumerate(kinds):
        lo, hi = short_tokens if kind == "short" else long_tokens
        workload.append(
            LabRequest(
                index=i,
                kind=kind,
                prompt=rng.choice(prompts),
                max_tokens=rng.randint(lo, hi),
                arrival=0.0 if rate is None else i / rate,
            )
        )
    return workload


def kv_blocks_for(engine, workload: list[LabRequest], max_num_seqs: int) -> int:
    """Enough KV blocks that `max_num_seqs` of the longest requests fit: the lab measures scheduling,
    not preemption."""
    longest = max(len(engine.tokenizer.encode(r.prompt)) + r.max_tokens for r in workload)
    return max_num_seqs * -(-longest // engine.config.block_size) + 1


class SlotTracker:
    """Which batch slot each running request holds, as intervals of wall time (the Gantt chart's rows):
    a request keeps its slot from the step it joins the batch until the step after which it left."""

    def __init__(self) -> None:
        self.slot_of: dict[str, tuple[int, float]] = {}  # request id -> (slot, start)
        self.free: list[int] = []
        self.next_slot = 0
        self.last_end = 0.0
        self.intervals: list[SlotInterval] = []

    def step(self, occupying: list[str], start: float, end: float) -> None:
        current = set(occupying)
        for rid in [rid for rid in self.slot_of if rid not in current]:  # left the batch after the last step
            slot, began = self.slot_of.pop(rid)
            self.intervals.append(SlotInterval(rid, slot, began, self.last_end))
            heapq.heappush(self.free, slot)
        for rid in occupying:
            if rid not in self.slot_of:
                if self.free:
                    slot = heapq.heappop(self.free)
                else:
                    slot, self.next_slot = self.next_slot, self.next_slot + 1
                self.slot_of[rid] = (slot, start)
        self.last_end = end

    def close(self) -> list[SlotInterval]:
        for rid, (slot, began) in self.slot_of.items():
            self.intervals.append(SlotInterval(rid, slot, began, self.last_end))
        self.slot_of = {}
        return sorted(self.intervals, key=lambda iv: (iv.start, iv.slot))


def _request_record(r: LabRequest, out, t0: float, steps: tuple[int, int | None, int]) -> dict[str, Any]:
    """One finished request's times (wall and engine steps); `steps`: (arrival, first token, finish)."""
    arrival_step, first_step, finish_step = steps
    m = out.metrics
    return {
        "request_id": r.request_id,
        "kind": r.kind,
        "prompt_tokens": len(out.prompt_token_ids),
        "output_tokens": len(out.token_ids),
        "arrival": m.arrival_time - t0,
        "first_token": m.first_token_time - t0,
        "finished": m.finished_time - t0,
        "completion": m.e2e,
        "queue_time": m.queue_time,
        "ttft": m.ttft,
        "tpot": m.tpot,
        "first_token_step": first_step,
        "finished_step": finish_step,
        "completion_steps": finish_step - arrival_step + 1,
    }


def run_workload(engine, workload: list[LabRequest], *, label: str = "", progress: bool = True) -> RunResult:
    """Feed requests at their arrival times, step the engine until all finish, record slot occupancy."""
    from serving import SamplingParams

    pending = deque(sorted(workload, key=lambda r: r.arrival))
    by_id = {r.request_id: r for r in workload}
    finals: dict[str, Any] = {}
    slots = SlotTracker()
    batch_sizes: list[int] = []
    arrival_step: dict[str, int] = {}  # engine steps are the machine-independent clock
    first_step: dict[str, int] = {}
    finish_step: dict[str, int] = {}
    preempt_before = engine.stats().num_preemptions
    bar = ProgressBar(len(workload), label) if progress else None
    t0 = time.perf_counter()
    while pending or engine.has_unfinished():
        now = time.perf_counter() - t0
        while pending and pending[0].arrival <= now:
            r = pending.popleft()
            params = SamplingParams(max_tokens=r.max_tokens, temperature=0.0, ignore_eos=True)
            engine.add_request(r.prompt, params, request_id=r.request_id, arrival_time=t0 + r.arrival)
            arrival_step[r.request_id] = len(batch_sizes)
        if not engine.has_unfinished():
            time.sleep(max(0.0, pending[0].arrival - now))
            continue
        start = time.perf_counter() - t0
        outputs = engine.step()
        end = time.perf_counter() - t0
        step = len(batch_sizes)
        occupying = [s.request_id for s in engine.scheduler.running]
        for out in outputs:
            if out.token_ids:
                first_step.setdefault(out.request_id, step)
            if out.finished:
                finish_step[out.request_id] = step
                occupying.append(out.request_id)
                finals[out.request_id] = out
                if bar:
                    bar.advance(1)
        batch_sizes.append(len(occupying))
        slots.step(occupying, start, end)
    if bar:
        bar.stop()
    requests = [_request_record(by_id[rid], out, t0, (arrival_step[rid], first_step.get(rid), finish_step[rid]))
                for rid, out in finals.items()]
    requests.sort(key=lambda d: by_id[d["request_id"]].index)
    return RunResult(
        scheduler=engine.scheduler_name,
        requests=requests,
        intervals=slots.close(),
        makespan=max((d["finished"] for d in requests), default=0.0),
        num_steps=len(batch_sizes),
        num_preemptions=engine.stats().num_preemptions - preempt_before,
        step_batch_sizes=batch_sizes,
    )


def summarize_run(run: RunResult) -> dict[str, Any]:
    short = [d for d in run.requests if d["kind"] == "short"]
    tokens = sum(d["output_tokens"] for d in run.requests)
    return {
        "completion_short_s": summarize(d["completion"] for d in short),
        "completion_all_s": summarize(d["completion"] for d in run.requests),
        "completion_short_steps": summarize(d["completion_steps"] for d in short),
        "ttft_short_s": summarize(d["ttft"] for d in short),
        "ttft_s": summarize(d["ttft"] for d in run.requests),
        "tpot_s": summarize(d["tpot"] for d in run.requests),
        "queue_time_s": summarize(d["queue_time"] for d in run.requests),
        "makespan_s": run.makespan,
        "output_tokens": tokens,
        "throughput_tokens_per_s": ratio(tokens, run.makespan),
        "throughput_requests_per_s": ratio(len(run.requests), run.makespan),
        "num_requests": len(run.requests),
        "num_short": len(short),
        "num_steps": run.num_steps,
        "mean_batch_size": ratio(sum(run.step_batch_sizes), len(run.step_batch_sizes)),
        "num_preemptions": run.num_preemptions,
        "padding_waste": run.padding_waste,
    }


def full_batch_step_time(engine, batch: int, steps: int = 6) -> float:
    """Warm the engine up and return the median time of a decode step with `batch` sequences."""
    from serving import SamplingParams

    params = SamplingParams(max_tokens=steps + 1, temperature=0.0, ignore_eos=True)
    for i in range(batch):
        engine.add_request(f"warm-up request {i}", params)
    times = []
    while engine.has_unfinished():
        start = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - start)
    decode = sorted(times[1:-1] or times)
    return decode[len(decode) // 2]


def run_each_scheduler(base, model: str, make: Callable[[float | None], list[LabRequest]], *,
                       rate: float | str | None, steps_per_arrival: float, max_num_seqs: int, num_kv_blocks: int,
                       max_num_batched_tokens: int, batch_timeout_ms: float, progress: bool
                       ) -> tuple[dict[str, RunResult], float, float | None]:
    """Every scheduler over `base`'s model on one workload, `make(rate)`, made once the first engine's
    full-batch step is timed (rate "auto": one arrival every `steps_per_arrival` such steps); returns
    the runs, that step time and the rate used."""
    from serving import LLMEngine

    runs: dict[str, RunResult] = {}
    step_time, workload = None, []
    for name in SCHEDULERS:
        engine = LLMEngine(
            base.model, base.tokenizer, device=base.device, scheduler=name, max_num_seqs=max_num_seqs,
            num_kv_blocks=num_kv_blocks, max_num_batched_tokens=max_num_batched_tokens, model_name=model,
            # batches of max_num_seqs that also close when the oldest waited the timeout
            batch_timeout_s=batch_timeout_ms / 1000 if name == "dynamic" else None,
        )
        measured = full_batch_step_time(engine, max_num_seqs)  # a full batch: closes on size, not the timeout
        if name == "dynamic":
            engine.scheduler.batches.clear()  # the warm-up's
        if step_time is None:  # the first engine fixes the workload; all run exactly the same one
            step_time = measured
            if rate == "auto":
                rate = 1.0 / (steps_per_arrival * step_time)
            workload = make(rate)
        runs[name] = run_workload(engine, workload, label=f"{name:>10}", progress=progress)
        if name == "dynamic":
            runs[name].padding_waste = engine.scheduler.padding_waste()
        del engine
        gc.collect()
    return runs, step_time, rate


def static_vs_continuous(summaries: dict[str, dict[str, Any]]) -> dict[str, float | None]:
    """The issue's ratios: continuous / static short p99 (below 1: continuous is faster), and how many
    times better continuous is, in seconds and in engine steps (free of the machine's speed and noise)."""
    def p99(name: str, key: str) -> float | None:
        return summaries[name][key]["p99"]

    return {
        "short_p99_continuous_over_static": ratio(p99("continuous", "completion_short_s"),
                                                  p99("static", "completion_short_s")),
        "short_p99_speedup": ratio(p99("static", "completion_short_s"), p99("continuous", "completion_short_s")),
        "short_p99_speedup_steps": ratio(p99("static", "completion_short_steps"),
                                         p99("continuous", "completion_short_steps")),
        "all_p99_speedup": ratio(p99("static", "completion_all_s"), p99("continuous", "completion_all_s")),
        "throughput_continuous_over_static": ratio(summaries["continuous"]["throughput_tokens_per_s"],
                                                   summaries["static"]["throughput_tokens_per_s"]),
    }


def run_hol_lab(
    model: str = "smollm2-135m",
    *,
    num_requests: int = 48,
    max_num_seqs: int = 16,
    rate: float | str | None = "auto",
    steps_per_arrival: float = 8.0,
    seed: int = 0,
    device: str | None = None,
    dtype: str | None = None,
    num_kv_blocks: int | None = None,
    max_num_batched_tokens: int = 512,
    short_tokens: tuple[int, int] = (8, 32),
    long_tokens: tuple[int, int] = (256, 512),
    short_fraction: float = 0.8,
    batch_timeout_ms: float = 100.0,
    out_dir: str | Path | None = None,
    plots: bool = True,
    progress: bool = True,
) -> dict[str, Any]:
    """Run the lab and write `hol_lab.json` (+ PNGs) into `out_dir`; returns the report.

    `rate`: requests/s at a fixed rate; None sends all at once; "auto" sends one request every
    `steps_per_arrival` full-batch decode steps, timed on this machine during warm-up, so the load
    relative to the engine's capacity is the same on any machine.
    """
    from serving import LLMEngine

    if isinstance(rate, str) and rate != "auto":
        raise ValueError(f"rate must be a number of requests/s, None (all at once) or 'auto', got {rate!r}")
    if steps_per_arrival <= 0:
        raise ValueError(f"steps_per_arrival must be positive, got {steps_per_arrival}")
    shape = dict(short_fraction=short_fraction, short_tokens=short_tokens, long_tokens=long_tokens, seed=seed)
    workload = make_workload(num_requests, **shape)  # validates before the model loads
    out = output_dir(out_dir, "hol")
    base = LLMEngine.from_pretrained(model, device=device, dtype=dtype, num_kv_blocks=1, max_num_seqs=1)
    blocks = num_kv_blocks or kv_blocks_for(base, workload, max_num_seqs)
    runs, step_time, rate = run_each_scheduler(
        base, str(model), lambda r: make_workload(num_requests, rate=r, **shape), rate=rate,
        steps_per_arrival=steps_per_arrival, max_num_seqs=max_num_seqs, num_kv_blocks=blocks,
        max_num_batched_tokens=max_num_batched_tokens, batch_timeout_ms=batch_timeout_ms, progress=progress)
    summaries = {name: summarize_run(run) for name, run in runs.items()}
    report: dict[str, Any] = {
        "benchmark": "hol_lab",
        "config": {
            "model": str(model),
            "device": str(base.device),
            "dtype": str(base.model.dtype).removeprefix("torch."),
            "num_requests": num_requests,
            "short_fraction": short_fraction,
            "short_tokens": list(short_tokens),
            "long_tokens": list(long_tokens),
            "arrivals": "all at once" if rate is None else f"fixed rate {rate:.3g} req/s",
            "rate_requests_per_s": rate,
            "full_batch_step_s": step_time,
            "seed": seed,
            "max_num_seqs": max_num_seqs,
            "max_num_batched_tokens": max_num_batched_tokens,
            "num_kv_blocks": blocks,
            "block_size": base.block_size,
            "batch_timeout_ms": batch_timeout_ms,
        },
        "machine": machine(),
        "schedulers": summaries,
        **static_vs_continuous(summaries),
        "runs": {
            name: {"requests": run.requests, "intervals": [asdict(iv) for iv in run.intervals]}
            for name, run in runs.items()
        },
        "plots": {},
    }
    if plots:
        report["plots"] = {
            "cdf": str(plot_short_cdf(runs, out / "hol_short_cdf.png")),
            "gantt": str(plot_gantt(runs, out / "hol_gantt.png")),
        }
    report["json"] = str(write_json(out / "hol_lab.json", report))
    return report
