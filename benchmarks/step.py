"""`quantgate bench step`: where one decode step of the engine goes (issue 47, "Know the step").

Per variant (baseline, int8wo, int4-awq), kernel path (`isa=`), batch and context length, one engine holds
`batch` sequences of `context` tokens each (their prefill is skipped: the KV slots are allocated by the real
scheduler and block manager but not computed, since only the step's timing matters), then decode steps are
timed two ways in interleaved rounds:

- whole: `engine.step()` untouched (median over rounds);
- parts: the same step with timers around `scheduler.schedule`, `runner.run`, `runner._forward`, the lm_head
  (hooks) and `runner._postprocess` (sampling), plus the decoder stack's pieces timed on their own over the
  step's own tensors and cache: every layer's weight GEMMs (the projections the engine calls), attention over
  the paged KV (`attention.attend` with the step's context), the fused norm / rotary / SiLU ops, and the
  prelude (embedding, rotary tables, first norm).

The parts are summed and set beside the whole (the gap is the dispatch between the decoder's ops that no
part holds; the compiled decode plan keeps it small). Each part has its bound where it has one: weight and
KV bytes ÷ the read bandwidth, FLOPs ÷ the peak GEMM rate, both measured here (`read_bandwidth_gbs`, a
square `torch.mm` in the step's dtype). Tensor allocation is estimated apart (torch.empty of the step's
intermediates), since it happens inside the GEMM and elementwise parts.

    quantgate bench step [--model smollm2-135m] [--variants baseline,int8wo,int4-awq] [--paths all]
        [--batches 1,16,64] [--contexts 128,512] [--rounds 5] [--threads N] [--out-dir DIR] [--no-plots]
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import time
from pathlib import Path

if __package__ in (None, ""):  # run as a script: import the repo's packages
    sys.path[0] = str(Path(__file__).resolve().parents[1])

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from benchmarks.common import pyplot, save_figure, write_rows_report  # noqa: E402

BLOCK_SIZE = 16
# the step's parts, in the order they run: together they should make the whole step
PARTS = ("scheduler", "runner_prep", "prelude", "weight_gemms", "attention", "elementwise", "lm_head", "sampling",
         "engine_bookkeeping")
PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
WRAPPED = (("scheduler", "schedule"), ("scheduler", "step_done"), ("runner", "run"), ("runner", "_forward"),
           ("runner", "_postprocess"))


def plain_step(engine) -> dict:
    start = time.perf_counter()
    engine.step()
    return {"step": time.perf_counter() - start}


def _timed(times: dict, name: str, fn):
    def wrapper(*args, **kwargs):
        start = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            times[name] = times.get(name, 0.0) + time.perf_counter() - start
    return wrapper


def instrumented_step(engine) -> dict:
    """One step with timers around the engine's own pieces (instance attributes shadow the methods and are
    deleted after, so the plain steps run the untouched code); the forward's inputs are kept for the
    isolated parts."""
    times: dict[str, float] = {}
    captured: dict = {}
    runner, objects = engine.runner, {"scheduler": engine.scheduler, "runner": engine.runner}
    forward = runner._forward

    def capture(ctx, input_ids, positions, keep_rows):
        captured.update(ctx=ctx, input_ids=input_ids, positions=positions)
        return forward(ctx, input_ids, positions, keep_rows)

    for owner, name in WRAPPED:
        fn = capture if name == "_forward" else getattr(objects[owner], name)
        setattr(objects[owner], name, _timed(times, name, fn))
    head = runner.model.lm_head
    hooks = [head.register_forward_pre_hook(lambda *_: times.__setitem__("head_start", time.perf_counter())),
             head.register_forward_hook(lambda *_: times.__setitem__(
                 "lm_head", time.perf_counter() - times["head_start"]))]
    try:
        start = time.perf_counter()
        engine.step()
        step = time.perf_counter() - start
    finally:
        for hook in hooks:
            hook.remove()
        for owner, name in WRAPPED:
            delattr(objects[owner], name)
    return {"scheduler": times["schedule"] + times["step_done"],
            "runner_prep": times["run"] - times["_forward"] - times["_postprocess"],
            "lm_head": times["lm_head"], "sampling": times["_postprocess"],
            "engine_bookkeeping": step - times["run"] - times["schedule"] - times["step_done"],
            "decoder_in_step": times["_forward"] - times["lm_head"], "captured": captured}


def _mean(fn, reps: int) -> float:
    fn()
    start = time.perf_counter()
    for _ in range(reps):
        fn()
    return (time.perf_counter() - start) / reps


def _layer_plans(engine) -> list:
    from serving.model.llama_forward import LayerPlan

    forward = engine.runner.fast_forward
    if forward is not None:
        return forward.plans
    if not hasattr(engine, "_step_bench_plans"):  # the model's own forward: its modules, called the same way
        engine._step_bench_plans = [LayerPlan.of(layer) for layer in engine.runner.model.model.layers]
    return engine._step_bench_plans


def _rms(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return weight * (x * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def isolated_parts(engine, captured: dict, reps: int = 3) -> dict[str, float]:
    """The decoder's pieces, each timed on its own over the step's shapes, context and cache (seconds)."""
    from serving.model import attention

    runner, plans = engine.runner, _layer_plans(engine)
    model, ctx, ids, positions = runner.model, captured["ctx"], captured["input_ids"], captured["positions"]
    cfg, dtype, tokens = model.config, runner.shape.dtype, ids.shape[0]
    hidden, inter, dim = cfg.hidden_size, cfg.intermediate_size, runner.shape.head_dim
    heads, kv_heads = cfg.num_attention_heads, cfg.num_key_value_heads
    ops = runner.fast_forward.ops if runner.fast_forward is not None else None
    rand = lambda *shape: torch.randn(*shape, dtype=dtype)  # noqa: E731
    x, a, h, residual = rand(tokens, hidden), rand(tokens, heads * dim), rand(tokens, inter), rand(tokens, hidden)
    q, kv, qkv, gate_up = rand(tokens, heads, dim), rand(kv_heads, tokens, dim), rand(tokens, (heads + 2 * kv_heads) * dim), rand(tokens, 2 * inter)
    cos, sin = (t[0].contiguous() for t in model.model.rotary_emb(x[None], positions[None]))

    def gemms():
        for p in plans:
            p.qkv(x), p.o_proj(a), p.gate_up(x), p.down_proj(h)

    def attend():
        for i, p in enumerate(plans):
            attention.attend(ctx, i, q, kv, kv, p.scaling, True, p.window)

    def elementwise():
        for i, p in enumerate(plans):
            qs, ks, vs = qkv.split([heads * dim, kv_heads * dim, kv_heads * dim], dim=-1)
            if ops is not None:
                ops.rotary_store(qs, ks, vs, cos, sin, dim, ctx.k_cache[i], ctx.v_cache[i], ctx.slot_mapping)
                ops.add_rms_norm(residual, x, *p.post_norm)
            else:  # the model's own forward: rotary and the norms in torch ops
                torch.cat([qs[..., dim // 2:], qs[..., : dim // 2]], -1) * sin.repeat(1, heads) + qs * cos.repeat(1, heads)
                _rms(residual + x, *p.post_norm)
            g, u = gate_up.chunk(2, dim=-1)
            F.silu(g) * u
            ops.add_rms_norm(residual, x, *p.input_norm) if ops is not None else _rms(residual + x, *p.input_norm)

    def prelude():
        r = model.model.embed_tokens(ids).to(dtype).contiguous()
        c, s = model.model.rotary_emb(r[None], positions[None])
        c[0].contiguous(), s[0].contiguous()
        ops.rms_norm(r, *plans[0].input_norm) if ops is not None else _rms(r, *plans[0].input_norm)

    shapes = [(tokens, (heads + 2 * kv_heads) * dim), (tokens, heads, dim), (tokens, heads, dim), (tokens, hidden),
              (tokens, hidden), (tokens, 2 * inter), (tokens, inter), (tokens, inter), (tokens, hidden),
              (tokens, hidden)]  # what a layer allocates in a decode step (decode_step.cpp's `run`)

    def allocate():
        for _ in plans:
            for shape in shapes:
                torch.empty(shape, dtype=dtype)

    with torch.inference_mode():
        return {"weight_gemms": _mean(gemms, reps), "attention": _mean(attend, reps),
                "elementwise": _mean(elementwise, reps), "prelude": _mean(prelude, reps),
                "allocation_est": _mean(allocate, reps), "allocations": float(len(shapes) * len(plans))}


def _bytes(modules) -> int:
    """Bytes of the modules' parameters and buffers, each storage once (fused calls share them)."""
    seen: dict[int, int] = {}
    for module in modules:
        for t in [*module.parameters(), *module.buffers()]:
            try:
                seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
            except (NotImplementedError, RuntimeError):  # an opaque (oneDNN-packed) weight: its logical size
                seen[id(t)] = t.numel() * t.element_size()
    return sum(seen.values())


def bounds(engine, batch: int, context: int, bandwidth_gbs: float, peak_flops: float,
           gemm_peak: float | None = None) -> dict[str, float]:
    """Seconds each bounded part needs at least: max(bytes ÷ read bandwidth, FLOPs ÷ peak GEMM rate); the
    projections' at `gemm_peak` where they multiply in another type (w8a8: int8), attention's at the dtype's."""
    gemm_peak = gemm_peak or peak_flops
    model, shape = engine.runner.model, engine.runner.shape
    cfg, bw = model.config, bandwidth_gbs * 1e9
    hidden, inter, dim = cfg.hidden_size, cfg.intermediate_size, shape.head_dim
    heads, kv_heads, layers = cfg.num_attention_heads, cfg.num_key_value_heads, shape.num_layers
    proj = [getattr(layer.self_attn if name[0] in "qkvo" else layer.mlp, name)
            for layer in model.model.layers for name in PROJECTIONS]
    per_layer = hidden * (heads + 2 * kv_heads) * dim + heads * dim * hidden + 3 * hidden * inter
    kv_bytes = 2 * layers * kv_heads * dim * shape.storage_dtype.itemsize * batch * context
    return {"weight_gemms": max(_bytes(proj) / bw, 2 * batch * per_layer * layers / gemm_peak),
            "lm_head": max(_bytes([model.lm_head]) / bw, 2 * batch * hidden * cfg.vocab_size / gemm_peak),
            "attention": max(kv_bytes / bw, 4 * layers * heads * dim * batch * context / peak_flops),
            "sampling": 4 * batch * cfg.vocab_size / bw}


def peak_gemm_gflops(dtype: torch.dtype, n: int = 1024, reps: int = 5) -> float:
    """Best of `reps` square n×n×n matmuls in `dtype` with torch's threads: the machine's GEMM rate; for int8,
    torch's int8 GEMM (oneDNN: VNNI, AMX-INT8), what a W8A8 projection's products reach."""
    if dtype == torch.int8:
        a, b = (torch.randint(-127, 128, (n, n), dtype=dtype) for _ in range(2))
        mm = torch._int_mm
    else:
        a, b = torch.randn(n, n, dtype=dtype), torch.randn(n, n, dtype=dtype)
        mm = torch.mm
    mm(a, b)
    best = float("inf")
    for _ in range(reps):
        start = time.perf_counter()
        mm(a, b)
        best = min(best, time.perf_counter() - start)
    return 2 * n**3 / best / 1e9


def multiplies_int8(engine) -> bool:
    from serving.model.quant.w8a8 import Int8DynamicLinear

    return any(isinstance(m, Int8DynamicLinear) for m in engine.runner.model.modules())


def _fake_run(scheduled):
    """The runner's stand-in while the sequences fill: a token for each sequence whose prompt is done."""
    from serving.model.model_runner import StepResult

    return StepResult({i: 1000 for i, s in enumerate(scheduled)
                       if s.seq.num_computed_tokens + s.num_new_tokens == s.seq.num_tokens}, {}, {})


def max_tokens(batch: int, context: int, steps: int) -> int:
    """Tokens a sequence may make: the timed steps, plus the fake ones it decodes while the others are still
    filling (prefill chunks of the scheduler's token budget), so that none finishes while the step is timed."""
    from serving.core.scheduler import MAX_NUM_BATCHED_TOKENS

    return steps + 4 + -(-batch * context // MAX_NUM_BATCHED_TOKENS)


def scatter_free_blocks(engine, seed: int) -> None:
    """The free list in a seeded random order: the blocks a long-running server hands out once requests of
    every length have come and gone (a fresh cache gives each sequence neighbouring blocks)."""
    manager = engine.block_manager
    ids = list(manager.free_block_ids)
    random.Random(seed).shuffle(ids)
    manager.free_block_ids = dict.fromkeys(ids)


def fill(engine, batch: int, context: int, steps: int, seed: int, scattered: bool = False) -> list[str]:
    """`batch` sequences with `context` tokens in the cache (uncomputed), each decoding from then on;
    `scattered`: in blocks drawn from anywhere in the cache (scatter_free_blocks)."""
    from serving import SamplingParams

    rng = random.Random(seed)
    if scattered:
        scatter_free_blocks(engine, seed)
    params = SamplingParams(max_tokens=max_tokens(batch, context, steps), temperature=0, ignore_eos=True)
    ids = [engine.add_request([rng.randrange(1000, engine.vocab_size) for _ in range(context - 1)], params)
           for _ in range(batch)]
    engine.runner.run = _fake_run  # an instance attribute: the class's method is back once it is deleted
    try:
        while True:
            plan_items = engine.step()
            running = [s for s in engine.sequences.values() if s.num_computed_tokens >= s.num_prompt_tokens]
            if len(running) == batch and plan_items:
                break
    finally:
        del engine.runner.run
    return ids


def drain(engine, ids: list[str]) -> None:
    for request_id in ids:
        engine.abort(request_id)
    engine.runner.run = _fake_run
    try:
        while engine.has_unfinished():
            engine.step()
    finally:
        del engine.runner.run


def measure(engine, batch: int, context: int, rounds: int, bandwidth: float, peak: float,
            scattered: bool = False, gemm_peak: float | None = None) -> dict:
    """Whole step and its parts, `rounds` interleaved rounds after one warm-up; medians."""
    ids = fill(engine, batch, context, steps=2 * rounds + 4, seed=batch * 7919 + context, scattered=scattered)
    whole: list[float] = []
    parts: dict[str, list[float]] = {}
    try:
        for r in range(rounds + 1):
            order = (plain_step, instrumented_step) if r % 2 else (instrumented_step, plain_step)
            for fn in order:
                got = fn(engine)
                if r == 0:
                    continue  # the warm-up round
                if fn is plain_step:
                    whole.append(got["step"])
                else:
                    got.update(isolated_parts(engine, got.pop("captured")))
                    for name, value in got.items():
                        parts.setdefault(name, []).append(value)
        live = sum(1 for i in ids if i in engine.sequences and not engine.sequences[i].is_finished)
        if live != batch:  # a shrinking batch would time smaller steps than the row says
            raise RuntimeError(f"{batch - live} of {batch} sequences finished while the step was timed")
    finally:
        drain(engine, ids)
    med = {name: statistics.median(v) for name, v in parts.items()}
    row_parts = {name: med[name] for name in PARTS}
    step = statistics.median(whole)
    bound = bounds(engine, batch, context, bandwidth, peak, gemm_peak)
    decoder_parts = sum(med[name] for name in ("prelude", "weight_gemms", "attention", "elementwise"))
    return {"batch": batch, "context": context, "step_s": step, "step_min_s": min(whole), "step_rounds": whole,
            "parts_s": row_parts, "parts_min_s": {name: min(parts[name]) for name in PARTS},
            "sum_parts_s": sum(row_parts.values()), "sum_over_step": sum(row_parts.values()) / step,
            # the decoder as timed inside the step, less its pieces timed alone: dispatch between the ops
            # (Python or the plan's C++) and whatever else no part holds
            "decoder_in_step_s": med["decoder_in_step"], "decoder_dispatch_s": med["decoder_in_step"] - decoder_parts,
            "allocation_est_s": med["allocation_est"],
            "allocations_per_step": med["allocations"], "bounds_s": bound,
            "bound_s": sum(bound.values()), "step_over_bound": step / sum(bound.values())}


def engine_for(model_dir: Path, path: str, batches: list[int], contexts: list[int], rounds: int,
               scattered: bool = False):
    """`scattered`: the cache a server sizes by default (its blocks handed out scattered) and holds (on 2 MB
    pages where QUANTGATE_KV_HUGE_PAGES allows), else just the blocks the largest row needs."""
    from serving import LLMEngine

    per_seq = -(-(max(contexts) + max_tokens(max(batches), max(contexts), 2 * rounds + 4)) // BLOCK_SIZE)
    sized = {"kv_huge_pages": True} if scattered else {"num_kv_blocks": max(batches) * per_seq + 4}
    return LLMEngine.from_pretrained(str(model_dir), device="cpu", isa=path, enable_prefix_caching=False,
                                     max_num_seqs=max(batches), block_size=BLOCK_SIZE, **sized)


def run(model: str, variants: list[str], paths: list[str], batches: list[int], contexts: list[int], rounds: int,
        out_dir: str | None = None, plots: bool = True, scattered: bool = False) -> dict:
    from benchmarks.isa_paths import read_bandwidth_gbs
    from benchmarks.variants import variant_dir

    bandwidth = read_bandwidth_gbs()
    peaks: dict[str, float] = {}
    rows = []
    for variant in variants:
        directory = variant_dir(model, variant)
        for path in paths:
            engine = engine_for(directory, path, batches, contexts, rounds, scattered)
            dtype = engine.runner.shape.dtype
            key = str(dtype).removeprefix("torch.")
            peak = peaks.setdefault(key, peak_gemm_gflops(dtype))
            gemm_peak = peaks.setdefault("int8", peak_gemm_gflops(torch.int8)) if multiplies_int8(engine) else peak
            plan = engine.runner.fast_forward is not None and engine.runner.fast_forward.step is not None
            for batch in batches:
                for context in contexts:
                    row = {"variant": variant, "path": path, "dtype": key, "decode_plan": plan,
                           "load_avg": os.getloadavg()[0], "scattered": scattered,
                           "kv_blocks": engine.block_manager.num_blocks,
                           **measure(engine, batch, context, rounds, bandwidth, peak * 1e9, scattered,
                                     gemm_peak * 1e9)}
                    rows.append(row)
                    print_row(row)
            del engine
    return write_rows_report(out_dir, "step", rows, plot, plots, read_bandwidth_gbs=bandwidth,
                             peak_gemm_gflops=peaks, model=model, rounds=rounds, parts=list(PARTS),
                             load_avg=os.getloadavg())


def print_row(row: dict) -> None:
    ms = {k: v * 1e3 for k, v in row["parts_s"].items()}
    cells = "  ".join(f"{k} {v:.2f}" for k, v in ms.items())
    print(f"{row['variant']:>9} {row['path']:>10} b{row['batch']:<3} ctx{row['context']:<4} "
          f"step {row['step_s'] * 1e3:8.2f} ms  parts {row['sum_parts_s'] * 1e3:8.2f} "
          f"({row['sum_over_step']:.2f}x)  bound {row['bound_s'] * 1e3:6.2f} ({row['step_over_bound']:.1f}x)  "
          f"load {row['load_avg']:.1f}\n    {cells}")


def plot(rows: list[dict], path: Path) -> Path:
    """Stacked bars of the parts per configuration, the whole step and the bound as markers."""
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(max(6, 0.5 * len(rows) + 2), 5))
    labels = [f"{r['variant']}\n{r['path']}\nb{r['batch']} c{r['context']}" for r in rows]
    bottom = [0.0] * len(rows)
    for name in PARTS:
        heights = [r["parts_s"][name] * 1e3 for r in rows]
        ax.bar(range(len(rows)), heights, bottom=bottom, label=name)
        bottom = [b + h for b, h in zip(bottom, heights, strict=True)]
    ax.scatter(range(len(rows)), [r["step_s"] * 1e3 for r in rows], marker="_", s=400, c="k", label="whole step")
    ax.scatter(range(len(rows)), [r["bound_s"] * 1e3 for r in rows], marker="v", c="r", label="bound")
    ax.set_xticks(range(len(rows)), labels, fontsize=6)  # a linear axis: on a log one the bottom parts look large
    ax.set_ylabel("ms per decode step")
    ax.legend(fontsize=6, ncol=2)
    return save_figure(fig, path)


def main(argv: list[str] | None = None) -> dict:
    from quantgate.env import apply_defaults
    from serving.kernels.cpu import isa as isas

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--variants", default="baseline,int8wo,int4-awq")
    parser.add_argument("--paths", default="all", help="kernel paths (isa=), comma-separated; all: every one here")
    parser.add_argument("--batches", default="1,16,64")
    parser.add_argument("--contexts", default="128,512")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--scattered", action="store_true",
                        help="the server's default cache, its blocks handed out in random order (a cache after churn)")
    parser.add_argument("--out-dir", default=None)
    parser.add_argument("--no-plots", dest="plots", action="store_false")
    args = parser.parse_args(argv)
    apply_defaults()
    if args.threads:
        torch.set_num_threads(args.threads)
    paths = isas.supported() if args.paths == "all" else [isas.check(p) for p in args.paths.split(",")]
    report = run(args.model, args.variants.split(","), paths, [int(b) for b in args.batches.split(",")],
                 [int(c) for c in args.contexts.split(",")], args.rounds, args.out_dir, args.plots, args.scattered)
    print(f"wrote {report}")
    import json

    return json.loads(Path(report).read_text())


if __name__ == "__main__":
    main()
