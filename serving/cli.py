"""Serving verbs: `quantgate generate` (and `serve`, `route` from the server module)."""

from __future__ import annotations

import argparse


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("generate", help="generate with the paged-attention engine and print tokens/s")
    p.add_argument("prompts", nargs="*", help="prompts (default: a few built-in ones)")
    p.add_argument("--model", default="smollm2-135m", help="model reference or variant directory")
    p.add_argument("--device", default=None, help="cpu or cuda (default: cuda when available)")
    p.add_argument("--dtype", default="auto",
                   help="auto (bf16 on CUDA and on the amx/avx512bf16 kernel paths, else fp32), float32, bfloat16, float16")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--kv-cache-dtype", choices=["auto", "int8", "fp8"], default="auto",
                   help="KV cache storage: auto (the model's dtype), int8 (codes + a scale per token and head), fp8 e4m3")
    p.add_argument("--scheduler", choices=["continuous", "static", "dynamic"], default="continuous")
    _dynamic_args(p)
    p.add_argument("--chat", action="store_true", help="wrap each prompt in the model's chat template")
    p.set_defaults(func=_generate)
    _register_serve(subparsers)
    _register_route(subparsers)


def _dynamic_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--max-batch-size", type=int, default=None,
                   help="--scheduler dynamic: a batch closes when this many requests wait (its max_num_seqs)")
    p.add_argument("--batch-timeout-ms", type=float, default=50.0,
                   help="--scheduler dynamic: ... or when the oldest has waited this long (default 50 ms)")


def _batch_options(args: argparse.Namespace, default_seqs: int) -> dict:
    """The engine's batching options: max_num_seqs (--max-batch-size is the dynamic policy's name for it)
    and, with --scheduler dynamic, its batch timeout."""
    if args.max_batch_size is not None and args.scheduler != "dynamic":
        raise ValueError("--max-batch-size is the dynamic scheduler's batch size; use --scheduler dynamic")
    if args.batch_timeout_ms < 0:
        raise ValueError("--batch-timeout-ms must be >= 0")
    timeout = {"batch_timeout_s": args.batch_timeout_ms / 1000} if args.scheduler == "dynamic" else {}
    return {"max_num_seqs": args.max_batch_size or default_seqs, **timeout}


DEMO_PROMPTS = [
    "The capital of France is",
    "Write a haiku about the sea.",
    "Explain in one sentence why the sky is blue.",
    "List three prime numbers:",
    "def fibonacci(n):",
    "The three laws of thermodynamics are",
    "A good name for a pet turtle is",
    "Translate to French: good morning",
]


def _generate(args: argparse.Namespace) -> int:
    import time

    from rich.console import Console
    from rich.table import Table

    from serving import LLMEngine, SamplingParams

    console = Console()
    prompts = args.prompts or DEMO_PROMPTS
    # No more sequences than prompts: the engine's default KV budget is capped at that many full contexts, so
    # one prompt to an 8B model reserves one context's cache (1 GB), not the 2 GB default
    with console.status(f"loading {args.model}"):
        engine = LLMEngine.from_pretrained(
            args.model, device=args.device, dtype=args.dtype, scheduler=args.scheduler,
            kv_cache_dtype=args.kv_cache_dtype, **_batch_options(args, min(64, len(prompts))),
        )
    if args.chat:
        prompts = [
            engine.tokenizer.apply_chat_template(
                [{"role": "user", "content": p}], tokenize=False, add_generation_prompt=True
            )
            for p in prompts
        ]
    params = SamplingParams(
        max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p, seed=args.seed
    )
    start = time.perf_counter()
    outputs = engine.generate(prompts, params, use_tqdm=True)
    elapsed = time.perf_counter() - start
    table = Table("prompt", "output", "tokens", "TTFT s", "TPOT ms")
    for out in outputs:
        m = out.metrics
        table.add_row(
            (out.prompt or "")[-40:],
            out.text.strip()[:80],
            str(len(out.token_ids)),
            f"{m.ttft:.3f}",
            f"{m.tpot * 1000:.1f}" if m.tpot else "-",
        )
    console.print(table)
    total = sum(len(o.token_ids) for o in outputs)
    stats = engine.stats()
    console.print(
        f"{len(outputs)} requests, {total} output tokens in {elapsed:.2f} s: "
        f"[bold]{total / elapsed:.1f} tokens/s[/bold] ({engine.device}, {engine.scheduler_name} batching, "
        f"{stats.num_blocks} KV blocks of {stats.block_size} tokens, {stats.num_preemptions} preemptions)"
    )
    return 0


# ---- serve / route -----------------------------------------------------------------------------
def _register_serve(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("serve", help="serve a model over an OpenAI-compatible HTTP API")
    p.add_argument("--model", default="smollm2-135m", help="model reference or variant directory")
    p.add_argument("--host", default="127.0.0.1", help="interface to listen on (default: loopback only)")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--api-keys", default=None, metavar="FILE",
                   help="YAML of API key -> tenant and per-tenant limits; without it no key is needed")
    p.add_argument("--metrics-key", default=None,
                   help="bearer key /metrics asks for (with --api-keys it is required there; the keys file's "
                        "`metrics_key` keeps it out of the process list)")
    p.add_argument("--prefix-cache-scope", choices=["tenant", "global"], default="tenant",
                   help="tenant: a request reuses only its own tenant's cached prefixes (and those of its "
                        "`cache_salt`); global: tenants share them, so one can time another's prompts")
    p.add_argument("--served-model-name", default=None, help="the `model` clients ask for (default: from --model)")
    p.add_argument("--model-version", default=None, help="the `version` label of every metric (default: the name)")
    p.add_argument("--device", default=None, help="cpu or cuda (default: cuda when available)")
    p.add_argument("--dtype", default="auto",
                   help="auto (bf16 on CUDA and on the amx/avx512bf16 kernel paths, else fp32), float32, bfloat16, float16")
    p.add_argument("--kv-cache-dtype", choices=["auto", "int8", "fp8"], default="auto",
                   help="KV cache storage: auto (the model's dtype), int8 (codes + a scale per token and head), fp8 e4m3")
    p.add_argument("--scheduler", choices=["continuous", "static", "dynamic"], default="continuous")
    _dynamic_args(p)
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--max-num-batched-tokens", type=int, default=2048, help="tokens per engine step (default 2048)")
    p.add_argument("--num-kv-blocks", type=int, default=None)
    p.add_argument("--kv-cache-memory-gb", type=float, default=None)
    p.add_argument("--max-waiting", type=int, default=256, help="queued requests before 429s (whole server)")
    p.add_argument("--tenant-slack", type=float, default=0.25,
                   help="while tenants share the engine, how much slower than a decode-only step their steps may be "
                        "on average (isolation vs the flooding tenant's prefill throughput)")
    p.add_argument("--tenant-prefill-chunk", type=int, default=64,
                   help="prefill tokens a shared step takes when the tenants' time allowance permits")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's choice)")
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel ranks (processes; gloo on CPU, NCCL on CUDA)")
    p.add_argument("--pp", type=int, default=1, help="pipeline-parallel ranks (contiguous layer ranges)")
    p.add_argument("--microbatches", type=int, default=None, help="--pp: micro-batches per step (default: --pp)")
    p.add_argument("--log-level", default="info")
    p.set_defaults(func=_serve)


def _register_route(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("route", help="canary router in front of several `quantgate serve` backends")
    p.add_argument("--config", required=True, metavar="FILE", help="router YAML (versions, weights, backends)")
    p.add_argument("--host", default=None, help="interface (default: the config's, else 127.0.0.1)")
    p.add_argument("--port", type=int, default=None, help="port (default: the config's, else 9000)")
    p.add_argument("--log-level", default="info")
    p.set_defaults(func=_route)


def _serve(args: argparse.Namespace) -> int:
    import sys

    import uvicorn

    from serving.core.fairness import TenantFairness
    from serving.http.tenants import load_tenants

    if args.max_waiting < 1:
        raise ValueError("--max-waiting must be at least 1")
    if not 0 < args.tenant_slack < 100 or args.tenant_prefill_chunk < 1:
        raise ValueError("--tenant-slack must be in (0, 100) and --tenant-prefill-chunk at least 1")
    if args.metrics_key is not None and len(args.metrics_key) < 8:
        raise ValueError("--metrics-key must be at least 8 characters")
    tenants = load_tenants(args.api_keys) if args.api_keys else None  # a bad file fails before the model loads
    if tenants is not None:
        tenants = tenants.with_metrics_key(args.metrics_key)
    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    from serving import LLMEngine
    from serving.http.server import build_app

    engine = LLMEngine.from_pretrained(
        args.model, device=args.device, dtype=args.dtype, scheduler=args.scheduler,
        **_batch_options(args, args.max_num_seqs),
        max_num_batched_tokens=args.max_num_batched_tokens, num_kv_blocks=args.num_kv_blocks,
        kv_cache_memory_gb=args.kv_cache_memory_gb, prefix_cache_scope=args.prefix_cache_scope,
        kv_cache_dtype=args.kv_cache_dtype, kv_huge_pages=True,  # a server lives long: its blocks scatter
        tenant_fairness=TenantFairness.for_tenants(tenants, step_slack=args.tenant_slack,
                                                   prefill_chunk=args.tenant_prefill_chunk),
        **_parallel_options(args),
    )
    app = build_app(engine, served_model_name=args.served_model_name, version=args.model_version,
                    tenants=tenants, max_waiting=args.max_waiting, metrics_key=args.metrics_key, engine_thread=False)
    server = uvicorn.Server(uvicorn.Config(app, host=args.host, port=args.port, log_level=args.log_level,
                                           timeout_graceful_shutdown=5))
    group = getattr(engine, "parallel", None)
    if group is not None:  # a rank that dies stops the server: uvicorn's graceful shutdown
        group.on_failure = lambda _why: setattr(server, "should_exit", True)
    try:
        _serve_on_main_thread(server, app.state.engine_loop)
    finally:
        if group is not None:
            group.shutdown()
    if not server.started:  # as uvicorn.run: e.g. the port was taken
        return 3
    if group is not None and group.failure:
        print(f"quantgate serve: {group.failure}", file=sys.stderr)
        return 1
    return 0


def _serve_on_main_thread(server, loop) -> None:
    """uvicorn on a thread, the engine on this (main) thread, where torch's ops run fastest. SIGTERM or
    SIGINT: drain the engine loop (nothing new admitted, in-flight requests get DRAIN_TIMEOUT_S), then
    uvicorn's graceful shutdown; a second signal exits at once."""
    import signal
    import threading

    from serving.http.engine_loop import DRAIN_TIMEOUT_S

    def on_signal(signum, frame):
        if server.should_exit:
            server.force_exit = True
        loop.drain(DRAIN_TIMEOUT_S)
        server.should_exit = True

    previous = {sig: signal.signal(sig, on_signal) for sig in (signal.SIGTERM, signal.SIGINT)}
    http = threading.Thread(target=server.run, name="quantgate-http", daemon=True)
    http.start()
    try:
        loop.run_here(http.is_alive)
        http.join()
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def _parallel_options(args: argparse.Namespace) -> dict:
    if args.tp < 1 or args.pp < 1:
        raise ValueError("--tp and --pp must be at least 1")
    if args.tp == 1 and args.pp == 1:
        return {}
    return {"tensor_parallel_size": args.tp, "pipeline_parallel_size": args.pp,
            "num_microbatches": args.microbatches, "threads_per_rank": args.threads}


def _route(args: argparse.Namespace) -> int:
    import uvicorn

    from serving.routing.router import build_router_app, load_router_config

    config = load_router_config(args.config)
    app = build_router_app(config)
    uvicorn.run(app, host=args.host or config.host, port=args.port or config.port, log_level=args.log_level,
                timeout_graceful_shutdown=5)
    return 0
