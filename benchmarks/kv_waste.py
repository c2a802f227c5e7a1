"""KV memory waste: our paged allocator against a contiguous max-length reservation per sequence.

Both are measured by driving `serving.core.block_manager.BlockManager` itself, not computed on paper:
each sequence is allocated for its prompt and grown token by token with `append_slots`, exactly as
the engine does. A contiguous per-sequence reservation of `max_len` tokens is the same allocator
with one block of `max_len` tokens per sequence. Reports the fraction of reserved KV slots that hold
no token (waste) and how many sequences at their full length each admits in the same memory.

    quantgate bench kv-waste --num-seqs 1000 --max-len 2048
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from benchmarks.common import output_dir, pyplot, save_figure
from serving.loadgen.report import machine, write_json
from serving.loadgen.stats import ratio, summarize


@dataclass
class Allocation:
    num_seqs: int
    used_tokens: int  # slots holding a token's KV
    reserved_tokens: int  # slots in the blocks handed out

    @property
    def waste(self) -> float:
        return 1.0 - self.used_tokens / self.reserved_tokens if self.reserved_tokens else 0.0


def realistic_lengths(
    num_seqs: int = 1000, *, max_len: int = 2048, seed: int = 0
) -> list[tuple[int, int]]:
    """(prompt, output) token counts from log-normals shaped like chat traffic (ShareGPT-like: mean
    prompt ~200 tokens, mean output ~300, long tails), clipped so prompt + output <= max_len."""
    if num_seqs < 1:
        raise ValueError(f"num_seqs must be at least 1, got {num_seqs}")
    if max_len < 2:
        raise ValueError(f"max_len must be at least 2, got {max_len}")
    rng = random.Random(seed)
    pairs = []
    for _ in range(num_seqs):
        prompt = min(max_len - 1, max(1, round(rng.lognormvariate(math.log(120), 1.0))))
        output = min(max_len - prompt, max(1, round(rng.lognormvariate(math.log(200), 0.9))))
        pairs.append((prompt, output))
    return pairs


def _sequence(index: int, prompt_len: int, output_len: int):
    from serving.core.sampling_params import SamplingParams
    from serving.core.sequence import Sequence

    params = SamplingParams(max_tokens=max(1, output_len), temperature=0.0)
    return Sequence(f"s{index}", None, [index % 1000 + 1] * prompt_len, params)


def _grow(manager, seq, output_len: int) -> None:
    """Admit `seq` (blocks for its prompt) and decode `output_len` tokens into its KV, as the engine does."""
    manager.allocate(seq)
    seq.num_computed_tokens = seq.num_tokens
    for _ in range(output_len):
        manager.append_slots(seq, 1)
        seq.token_ids.append(0)
        seq.num_computed_tokens += 1


def measure_allocation(pairs: list[tuple[int, int]], block_size: int) -> Allocation:
    """All sequences grown to their full length in one BlockManager; used vs reserved slots."""
    from serving.core.block_manager import BlockManager

    _check_pairs(pairs, None)
    need = sum(-(-(p + o) // block_size) for p, o in pairs)
    manager = BlockManager(need, block_size, enable_prefix_caching=False)
    seqs = []
    for i, (p, o) in enumerate(pairs):
        seq = _sequence(i, p, o)
        _grow(manager, seq, o)
        seqs.append(seq)
    used = sum(seq.num_tokens for seq in seqs)
    return Allocation(len(seqs), used, manager.num_used_blocks * block_size)


def count_admitted(pairs: list[tuple[int, int]], block_size: int, memory_tokens: int) -> int:
    """How many sequences, taken in order (cycling through `pairs`), fit at their full length in a
    KV memory of `memory_tokens` slots."""
    from serving.core.block_manager import BlockManager

    num_blocks = memory_tokens // block_size
    if num_blocks < 1:
        return 0
    manager = BlockManager(num_blocks, block_size, enable_prefix_caching=False)
    admitted = 0
    while True:
        p, o = pairs[admitted % len(pairs)]
        if manager.blocks_needed(p + o) > manager.num_free_blocks:
            return admitted
        _grow(manager, _sequence(admitted, p, o), o)
        admitted += 1


def run_kv_waste(
    pairs: list[tuple[int, int]] | None = None,
    *,
    num_seqs: int = 1000,
    max_len: int = 2048,
    block_size: int = 16,
    memory_tokens: int | None = None,
    block_sizes: tuple[int, ...] = (8, 16, 32, 64),
    seed: int = 0,
    out_dir: str | Path | None = None,
    plots: bool = True,
) -> dict[str, Any]:
    """Measure waste and admitted concurrency; writes `kv_waste.json` (+ a PNG) unless out_dir is False."""
    if block_size < 1 or max_len < 1:
        raise ValueError("block_size and max_len must be positive")
    given = pairs is not None
    pairs = pairs if given else realistic_lengths(num_seqs, max_len=max_len, seed=seed)
    _check_pairs(pairs, max_len)
    memory_tokens = memory_tokens or 32 * max_len
    paged = measure_allocation(pairs, block_size)
    contiguous = measure_allocation(pairs, max_len)  # one block of max_len tokens per sequence
    admitted_paged = count_admitted(pairs, block_size, memory_tokens)
    admitted_contiguous = count_admitted(pairs, max_len, memory_tokens)
    report: dict[str, Any] = {
        "benchmark": "kv_waste",
        "config": {"num_seqs": len(pairs), "max_len": max_len, "block_size": block_size,
                   "memory_tokens": memory_tokens, "seed": seed,
                   "lengths": "given" if given else "realistic (log-normal, ShareGPT-like)"},
        "machine": machine(),
        "lengths": {"prompt": summarize(p for p, _ in pairs), "output": summarize(o for _, o in pairs),
                    "total": summarize(p + o for p, o in pairs)},
        "used_tokens": paged.used_tokens,
        "paged": {"reserved_tokens": paged.reserved_tokens, "waste": paged.waste,
                  "utilization": 1 - paged.waste, "admitted_seqs": admitted_paged},
        "contiguous": {"reserved_tokens": contiguous.reserved_tokens, "waste": contiguous.waste,
                       "utilization": 1 - contiguous.waste, "admitted_seqs": admitted_contiguous},
        "paged_waste_over_contiguous_waste": ratio(paged.waste, contiguous.waste),
        "admitted_paged_over_contiguous": ratio(admitted_paged, admitted_contiguous),
        "waste_by_block_size": {str(b): measure_allocation(pairs, b).waste for b in block_sizes},
        "plots": {},
    }
    if out_dir is not False:
        out = output_dir(out_dir, "kv_waste")
        if plots:
            report["plots"] = {"bars": str(plot_kv_waste(report, out / "kv_waste.png"))}
        report["json"] = str(write_json(out / "kv_waste.json", report))
    return report


def plot_kv_waste(report: dict[str, Any], path: Path) -> Path:
    plt = pyplot()
    fig, (left, right) = plt.subplots(1, 2, figsize=(9, 3.6))
    names = ["paged", "contiguous"]
    used = report["used_tokens"]
    reserved = [report[n]["reserved_tokens"] for n in names]
    left.bar(names, reserved, color="#cccccc", label="reserved")
    left.bar(names, [used, used], color="#1f77b4", label="holding a token")
    for i, n in enumerate(names):
        left.annotate(f"{report[n]['waste']:.1%} waste", (i, reserved[i]), ha="center", va="bottom", fontsize=9)
    left.set_ylabel("KV slots (tokens)")
    left.set_title(f"{report['config']['num_seqs']} sequences at full length", fontsize=10)
    left.legend(fontsize=8)
    admitted = [report[n]["admitted_seqs"] for n in names]
    right.bar(names, admitted, color=["#2ca02c", "#d62728"])
    for i, a in enumerate(admitted):
        right.annotate(str(a), (i, a), ha="center", va="bottom", fontsize=9)
    right.set_ylabel("concurrent sequences")
    right.set_title(f"admitted in {report['config']['memory_tokens']} KV slots", fontsize=10)
    return save_figure(fig, path)


def print_report(report: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    cfg = report["config"]
    table = Table(title=f"KV waste: {cfg['num_seqs']} sequences, block {cfg['block_size']}, max_len {cfg['max_len']}")
    for col in ("allocator", "reserved slots", "used slots", "waste", "admitted in same memory"):
        table.add_column(col, justify="right" if col != "allocator" else "left")
    for name in ("paged", "contiguous"):
        r = report[name]
        table.add_row(name, str(r["reserved_tokens"]), str(report["used_tokens"]), f"{r['waste']:.2%}",
                      str(r["admitted_seqs"]))
    console = Console()
    console.print(table)
    console.print(
        f"paged waste is {report['paged_waste_over_contiguous_waste']:.3f}× the contiguous waste; "
        f"paged admits {report['admitted_paged_over_contiguous']:.1f}× the sequences. "
        "By block size: " + ", ".join(f"{b}: {w:.2%}" for b, w in report["waste_by_block_size"].items())
    )
    if "json" in report:
        console.print(f"report: {report['json']}")


def _check_pairs(pairs: list[tuple[int, int]], max_len: int | None) -> None:
    if not pairs:
        raise ValueError("no sequence lengths given")
    for p, o in pairs:
        if p < 1 or o < 0:
            raise ValueError(f"a sequence needs a prompt of >= 1 token and >= 0 output tokens, got ({p}, {o})")
        if max_len is not None and p + o > max_len:
            raise ValueError(f"a sequence of {p} + {o} tokens is longer than max_len {max_len}")
