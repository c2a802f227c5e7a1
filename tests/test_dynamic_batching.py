"""Dynamic batching: batches close on size or on timeout (a deterministic clock), run as static batches,
and the real engine's greedy output under it equals HF's."""

from __future__ import annotations

from engine_helpers import DEVICE, DTYPE, hf_greedy
from test_engine import assert_no_leak, random_prompts

from serving import LLMEngine, SamplingParams
from serving.core.block_manager import BlockManager
from serving.core.dynamic_batching import DynamicBatch, DynamicBatchScheduler
from serving.core.sequence import Sequence


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0
        self.waits: list[float] = []

    def __call__(self) -> float:
        return self.now

    def wait(self, seconds: float) -> None:
        self.waits.append(seconds)


def make_scheduler(batch_size: int, timeout: float) -> tuple[DynamicBatchScheduler, FakeClock]:
    clock = FakeClock()
    sched = DynamicBatchScheduler(BlockManager(64, 4), batch_size, 512, batch_timeout_s=timeout,
                                  clock=clock, idle_wait=clock.wait)
    return sched, clock


def seq(i: int, prompt_len: int = 5, max_tokens: int = 4) -> Sequence:
    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    return Sequence(f"r{i}", None, list(range(10, 10 + prompt_len)), params)


def finish_all(sched: DynamicBatchScheduler, outputs: dict[str, int]) -> None:
    for s in list(sched.running):
        s.token_ids.extend([1] * outputs.get(s.request_id, 1))
        sched.finish(s)


def test_batch_closes_on_size_before_the_timeout():
    sched, clock = make_scheduler(batch_size=3, timeout=0.5)
    for i in range(2):
        sched.add(seq(i))
    assert sched.schedule().scheduled == []  # 2 of 3 waiting, nobody waited 0.5 s: the batch stays open
    assert clock.waits and all(0 < w <= 0.001 for w in clock.waits)  # it waited a little, did not spin
    clock.now += 0.1
    for i in range(2, 5):
        sched.add(seq(i))
    out = sched.schedule()
    assert [s.seq.request_id for s in out.scheduled] == ["r0", "r1", "r2"]  # B of them, FIFO
    assert [s.num_new_tokens for s in out.scheduled] == [5, 5, 5]
    batch = sched.batches[0]
    assert (batch.reason, batch.size) == ("size", 3)
    assert abs(batch.oldest_wait_s - 0.1) < 1e-9
    clock.now += 10  # r3, r4 are long past the timeout, but a static batch admits nobody until it ends
    for s in out.scheduled:
        s.seq.num_computed_tokens += s.num_new_tokens
    assert {s.seq.request_id for s in sched.schedule().scheduled} == {"r0", "r1", "r2"}
    finish_all(sched, {"r0": 1, "r1": 4, "r2": 2})
    assert batch.done
    # a padded [3, 5 + 4] batch holds 27 slots; 15 prompt + 7 output tokens are useful
    assert (batch.useful_slots, batch.padded_slots) == (22, 5)
    assert sched.padding_waste() == 5 / 22
    out = sched.schedule()  # the next batch: r3, r4 waited 10 s, more than the timeout
    assert [s.seq.request_id for s in out.scheduled] == ["r3", "r4"]
    assert (sched.batches[1].reason, sched.batches[1].size) == ("timeout", 2)


def test_batch_closes_on_timeout_exactly_when_the_oldest_has_waited_t():
    sched, clock = make_scheduler(batch_size=8, timeout=0.05)
    sched.add(seq(0))
    clock.now += 0.03
    sched.add(seq(1))
    clock.now += 0.0199
    assert sched.schedule().scheduled == [] and sched.close_reason() is None
    assert 0 < clock.waits[-1] <= 0.001
    clock.now += 0.0001  # r0 has now waited exactly 50 ms (r1 only 20 ms)
    assert sched.close_reason() == "timeout"
    out = sched.schedule()
    assert [s.seq.request_id for s in out.scheduled] == ["r0", "r1"]
    assert sched.batches[0].reason == "timeout" and abs(sched.batches[0].oldest_wait_s - 0.05) < 1e-9


def test_zero_timeout_is_static_batching_of_whatever_is_queued():
    sched, _ = make_scheduler(batch_size=4, timeout=0.0)
    sched.add(seq(0))
    assert [s.seq.request_id for s in sched.schedule().scheduled] == ["r0"]


def test_padding_accounting_of_an_unequal_batch():
    batch = DynamicBatch("size", 0.0, 0.0, ["a", "b"], {"a": (10, 2), "b": (3, 30)})
    assert batch.useful_slots == 45 and batch.padded_slots == 2 * (10 + 30) - 45


def test_dynamic_engine_matches_hf_greedy_and_closes_on_size_then_timeout(tiny_model_dir):
    engine = LLMEngine.from_pretrained(str(tiny_model_dir), device=DEVICE, dtype=DTYPE, scheduler="dynamic",
                                       max_num_seqs=3, batch_timeout_s=0.02)
    assert engine.config.batch_timeout_s == 0.02
    prompts = random_prompts(7, engine.vocab_size, seed=11)
    max_tokens = [5, 19, 3, 12, 8, 1, 15]
    params = [SamplingParams(max_tokens=m, temperature=0, ignore_eos=True) for m in max_tokens]
    outs = engine.generate(prompts, params)
    for prompt, m, out in zip(prompts, max_tokens, outs, strict=True):
        assert out.token_ids == hf_greedy(tiny_model_dir, prompt, m), f"prompt of {len(prompt)} tokens"
    batches = engine.scheduler.batches
    assert [(b.size, b.reason) for b in batches] == [(3, "size"), (3, "size"), (1, "timeout")]
    assert [b.request_ids for b in batches] == [[o.request_id for o in outs[i:i + 3]] for i in (0, 3, 6)]
    assert batches[2].oldest_wait_s >= 0.02
    assert engine.scheduler.padding_waste() > 0
    assert_no_leak(engine)


def test_bench_dynamic_sweep_writes_curves(tiny_model_dir, tmp_path):
    import json

    from benchmarks.dynamic import run_dynamic_sweep

    report = run_dynamic_sweep(str(tiny_model_dir), batch_sizes=(1, 4), timeouts_ms=(0.0, 1000.0), num_requests=8,
                               short_tokens=(2, 4), long_tokens=(16, 24), seed=2, out_dir=tmp_path, progress=False)
    points = {(p["batch_size"], p["timeout_ms"]): p for p in report["points"]}
    assert set(points) == {(1, 0.0), (4, 0.0), (1, 1000.0), (4, 1000.0)}
    for (b, _), p in points.items():
        assert p["mean_closed_batch_size"] <= b and p["short_p99_s"] > 0
    assert points[(1, 0.0)]["padding_waste"] == 0 and points[(1, 1000.0)]["padding_waste"] == 0  # nothing to pad
    assert points[(4, 1000.0)]["padding_waste"] > 0  # four mixed lengths in each batch
    assert points[(4, 1000.0)]["mean_closed_batch_size"] >= points[(4, 0.0)]["mean_closed_batch_size"]
    assert points[(1, 0.0)]["closed_on_timeout"] == 0  # a batch of one is full as soon as one waits
    saved = json.loads((tmp_path / "dynamic.json").read_text())
    assert saved["points"] == report["points"]
    assert open(report["plots"]["sweep"], "rb").read(8) == b"\x89PNG\r\n\x1a\n"
