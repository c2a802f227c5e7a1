"""`quantgate quantize` and `quantgate capacity`; heavy imports stay inside the handlers."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from quantize.methods import INT4_DEFAULT, METHODS


def register(subparsers) -> None:
    q = subparsers.add_parser(
        "quantize",
        help="make an INT8/INT4 variant of a model (cached by content hash)",
        description="Quantize a model into a variant directory: weights, tokenizer and quantgate.json. "
        f"Methods: {', '.join(f'{m.name} ({m.description})' for m in METHODS.values())}. int4 = {INT4_DEFAULT}.",
    )
    q.add_argument("--model", default="smollm2-135m", help="model reference (default: smollm2-135m)")
    q.add_argument("--method", required=True, help=f"one of {', '.join(METHODS)} (int4 = {INT4_DEFAULT})")
    q.add_argument("--out", type=Path, default=None, help="output directory (default: the cache in QUANTGATE_HOME)")
    q.add_argument("--compute-dtype", default=None, help="4-bit methods: matmul dtype (float32, bfloat16, float16)")
    q.add_argument("--no-double-quant", action="store_true", help="4-bit methods: plain fp32 block scales")
    q.add_argument("--opt", action="append", default=[], metavar="KEY=VALUE", help="any other method option")
    q.add_argument("--force", action="store_true", help="rebuild even if an intact variant exists")
    q.set_defaults(func=_quantize)

    c = subparsers.add_parser(
        "capacity",
        help="KV blocks and concurrent sequences that fit beside each variant's weights",
        description="For a memory budget, how many KV blocks and sequences of --seq-len tokens fit beside "
        "the weights of the baseline and each variant. Works from a config alone (e.g. --model llama-70b).",
    )
    c.add_argument("--model", default="smollm2-135m",
                   help="model reference, a config.json, or a preset: llama-70b (default: smollm2-135m)")
    c.add_argument("--memory-gb", type=float, default=None, help="budget in GiB (default: the device's free memory)")
    c.add_argument("--device", default=None, help="whose free memory is the default budget (default: cuda if any, else cpu)")
    c.add_argument("--seq-len", type=int, default=None, help="tokens per sequence (default: min(4096, max context))")
    c.add_argument("--block-size", type=int, default=16)
    c.add_argument("--dtype", default="bfloat16", help="baseline weights, unquantized parts and KV cache")
    c.add_argument("--reserve-gb", type=float, default=0.0, help="kept free for activations")
    c.add_argument("--json", type=Path, default=None, help="also write the table here")
    c.set_defaults(func=_capacity)


def _parse_opts(args: argparse.Namespace) -> dict[str, Any]:
    opts: dict[str, Any] = {}
    for item in args.opt:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise ValueError(f"--opt wants KEY=VALUE, got {item!r}")
        try:
            opts[key] = json.loads(value)
        except ValueError:
            opts[key] = value
    if args.compute_dtype:
        opts["compute_dtype"] = args.compute_dtype
    if args.no_double_quant:
        opts["double_quant"] = False
    return opts


def _quantize(args: argparse.Namespace) -> int:
    from rich.console import Console

    from quantize import get_method, quantize, read_manifest

    opts = _parse_opts(args)
    method = get_method(args.method).name  # an unknown method fails here, before the spinner
    with Console(stderr=True).status(f"quantizing {args.model} with {method} (instant if cached)"):
        out = quantize(args.model, method, args.out, force=args.force, **opts)
    m = read_manifest(out)
    source = m["source"].get("weight_bytes")
    ratio = f" ({m['weight_bytes'] / source:.2f}x of the source's {source / 2**20:.1f} MiB)" if source else ""
    print(f"{m['method']} variant of {m['source']['ref']}: {out}")
    print(f"  weights {m['weight_bytes'] / 2**20:.1f} MiB{ratio}, built in {m['quantize_seconds']:.1f} s")
    return 0


def _capacity(args: argparse.Namespace) -> int:
    from quantize.capacity import (
        GIB,
        capacity_table,
        device_free_bytes,
        format_table,
        load_config,
        rows_as_dicts,
    )

    config = load_config(args.model)
    memory = int(args.memory_gb * GIB) if args.memory_gb is not None else device_free_bytes(args.device)
    if memory <= 0:
        raise ValueError("--memory-gb must be positive")
    seq_len = args.seq_len or min(4096, int(config.get("max_position_embeddings") or 4096))
    measured = _measured_weights(args.model, args.dtype)
    rows = capacity_table(config, memory, seq_len=seq_len, block_size=args.block_size, dtype=args.dtype,
                          reserve_bytes=int(args.reserve_gb * GIB), measured=measured)
    print(f"{args.model}: " + format_table(rows, memory, seq_len))
    if args.json:
        args.json.write_text(json.dumps({"model": args.model, "memory_bytes": memory, "seq_len": seq_len,
                                         "dtype": args.dtype, "rows": rows_as_dicts(rows)}, indent=2))
    return 0


def _measured_weights(model: str, dtype: str) -> dict[str, int]:
    """Weight bytes of the source and of cached default variants whose unquantized parts are `dtype`."""
    from quantize.capacity import PRESETS

    if model in PRESETS or model.endswith(".json"):
        return {}
    from quantize.variant import measured_weight_bytes

    return measured_weight_bytes(model, dtype)
