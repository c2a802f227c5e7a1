"""Serving verbs: `quantgate generate` (and `serve`, `route` from the server module)."""

from __future__ import annotations

import argparse


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("generate", help="generate with the paged-attention engine and print tokens/s")
    p.add_argument("prompts", nargs="*", help="prompts (default: a few built-in ones)")
    p.add_argument("--model", default="smollm2-135m", help="model reference or variant directory")
    p.add_argument("--device", default=None, help="cpu or cuda (default: cuda when available)")
    p.add_argument("--dtype", default=None, help="float32, bfloat16 or float16")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--scheduler", choices=["continuous", "static"], default="continuous")
    p.add_argument("--chat", action="store_true", help="wrap each prompt in the model's chat template")
    p.set_defaults(func=_generate)


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
    with console.status(f"loading {args.model}"):
        engine = LLMEngine.from_pretrained(
            args.model, device=args.device, dtype=args.dtype, scheduler=args.scheduler
        )
    prompts = args.prompts or DEMO_PROMPTS
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
