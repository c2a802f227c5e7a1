"""Owns the model and the paged KV cache; turns a scheduled step into one forward pass."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from quantgate.allocator import release_freed_memory
from quantgate.model_shape import kv_shape
from serving.core.scheduler import ScheduledSeq
from serving.core.sequence import Sequence, TokenLogprob
from serving.kernels.cpu import isa as isas
from serving.kernels.cpu.decoder_ops import fused_ops, paged_decode, prefill_attention, prefill_fits
from serving.model import attention
from serving.model.attention import SCALE_DTYPE, AttentionContext, DecodeBatch, DecodeGroup, PrefillChunk
from serving.model.kv_memory import huge_pages_wanted, zeroed_tensors
from serving.model.llama_forward import LlamaForward, supports
from serving.model.packed_linear import pack_linears, packing_wanted
from serving.model.sampler import sample, token_logprobs

DECODE_GROUP_SIZE = 16  # decode sequences per padded attention batch
LOGSOFTMAX_ROWS = 256  # prompt rows log-softmaxed in fp32 at a time


def _decode_first(scheduled: list[ScheduledSeq]) -> list[int]:
    """Row order for a step: decode tokens by context length (so groups pad little), then prefill chunks."""
    decodes = [i for i, item in enumerate(scheduled) if not item.is_prefill]
    decodes.sort(key=lambda i: scheduled[i].seq.num_computed_tokens)
    return decodes + [i for i, item in enumerate(scheduled) if item.is_prefill]


def check_kv_cache_dtype(name: str) -> str:
    if name not in attention.KV_FORMATS:
        raise ValueError(f"unknown kv_cache_dtype {name!r}; choose one of {', '.join(attention.KV_FORMATS)}")
    if name == "fp8" and not hasattr(torch, "float8_e4m3fn"):
        raise ValueError("kv_cache_dtype fp8 needs torch.float8_e4m3fn, which this torch lacks")
    return name


@dataclass
class KVCacheShape:
    num_layers: int
    kv_heads: int
    head_dim: int
    dtype: torch.dtype  # the model's dtype: what attention computes in (and stores, for "auto")
    cache_dtype: str = "auto"  # auto | int8 | fp8

    def __post_init__(self) -> None:
        check_kv_cache_dtype(self.cache_dtype)

    @property
    def storage_dtype(self) -> torch.dtype:
        return {"auto": self.dtype, "int8": torch.int8, "fp8": torch.uint8}[self.cache_dtype]

    @property
    def scale_bytes(self) -> int:
        """Per token and KV head, for each of K and V."""
        return attention.SCALE_DTYPE.itemsize if self.cache_dtype == "int8" else 0

    def bytes_per_block(self, block_size: int) -> int:
        per_head = self.head_dim * self.storage_dtype.itemsize + self.scale_bytes
        return 2 * self.num_layers * block_size * self.kv_heads * per_head

    @classmethod
    def from_config(cls, config, dtype: torch.dtype, cache_dtype: str = "auto") -> KVCacheShape:
        return cls(*kv_shape(config), dtype, cache_dtype)


@dataclass
class StepResult:
    sampled: dict[int, int]  # index in the scheduled list -> next token
    logprobs: dict[int, TokenLogprob]
    prompt_logprobs: dict[int, list[TokenLogprob | None]]  # index -> logprobs of the prompt tokens scored this step


def load_model(model_dir: Path, device: torch.device, dtype: torch.dtype, isa: str | None = None,
               prepare: Callable[[torch.nn.Module], object] | None = None):
    """A plain HF dir loads here; a quantized variant (it has a quantgate.json) by serving/model/quant/loader.py.
    Its layers take kernel path `isa` (None: the process default, `serving.kernels.cpu.isa`). `prepare` runs on
    the loaded model before the engine packs its linears: tensor parallelism cuts its shards there, since the
    packed layouts have no rows to slice (each shard is then packed like a whole weight)."""
    with isas.using(isa) as path:
        if (Path(model_dir) / "quantgate.json").is_file():
            from serving.model.quant.loader import load_variant

            model = load_variant(Path(model_dir), str(device), dtype)
        else:
            from quantgate.loading import load_causal_lm

            model = load_causal_lm(model_dir, dtype=dtype).to(device)
        if prepare is not None:
            prepare(model)
    model.set_attn_implementation(attention.register())
    if packing_wanted(torch.device(device), dtype, path):
        pack_linears(model, path)
    release_freed_memory()  # a cast or repack frees what the allocator would otherwise keep for the process's life
    return model.eval()


class ModelRunner:
    def __init__(self, model, device: torch.device, block_size: int, num_blocks: int, kv_dtype: torch.dtype,
                 kv_cache_dtype: str = "auto", isa: str | None = None, attention: str = "torch",
                 graph_shape: tuple[int, int] | None = None, kv_huge_pages: bool = False):
        """`attention`: "torch" (serving/model/attention.py, the compiled CPU kernel where it runs) or "triton"
        (serving/kernels/cuda). `graph_shape` (max batch, max blocks a table): decode steps replayed from captured
        graphs (serving/kernels/cuda/graphs.py; on CPU its eager stand-in), Triton attention only."""
        self.model = model
        self.device = device
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.shape = shape = KVCacheShape.from_config(model.config, kv_dtype, kv_cache_dtype)
        slots, layers = num_blocks * block_size, shape.num_layers
        rows = [((shape.kv_heads, slots, shape.head_dim), shape.storage_dtype)] * (2 * layers)
        scaled = kv_cache_dtype == "int8"
        if scaled:
            rows += [((shape.kv_heads, slots), SCALE_DTYPE)] * (2 * layers)
        # kv_huge_pages: one mapping on 2 MB pages (kv_memory.py): a long-lived server's blocks end up scattered
        cache = zeroed_tensors(rows, device, kv_huge_pages and huge_pages_wanted(device))
        self.k_cache, self.v_cache = cache[:layers], cache[layers:2 * layers]
        self.k_scale = self.v_scale = None
        if scaled:
            self.k_scale, self.v_scale = cache[2 * layers:3 * layers], cache[3 * layers:]
        self.generators: dict[str, torch.Generator] = {}
        self.decode_kernel = paged_decode(device, isa)  # None: gathered groups and matmuls (CUDA, no compiler)
        ops = fused_ops(device, isa)
        self.greedy_pick = getattr(ops, "greedy_pick", None)  # None: torch's argmax (sampler.sample)
        self.fast_forward = LlamaForward.of(model, torch.device(device), isa)  # None: the model's own forward
        # The prefill kernel of the dtype the hidden states are held in (a quantized embedding's KV dtype is not
        # theirs); None: torch's flash kernel (the torch path, bf16 off the bf16 paths, a head_dim it does not take)
        self.prefill_dtype = self.fast_forward.dtype if self.fast_forward is not None else kv_dtype
        fits = prefill_fits(shape.head_dim, self.prefill_dtype)
        self.prefill_kernel = prefill_attention(device, isa, self.prefill_dtype) if fits else None
        self.attention, self.graphs = attention, None
        if attention == "triton":
            from serving.kernels.cuda.fused_ops import TritonOps
            from serving.kernels.cuda.projections import fuse_projections

            self.decode_kernel = None
            self.fast_forward = LlamaForward(model, TritonOps()) if supports(model) else None
            if self.fast_forward is not None:
                fuse_projections(self.fast_forward)
        if graph_shape is not None:
            if self.attention != "triton" or self.fast_forward is None:
                raise ValueError("decode graphs need attention='triton' and a Llama-family model (llama_forward)")
            from serving.kernels.cuda.graphs import DecodeGraphs

            self.graphs = DecodeGraphs(self.fast_forward, self.k_cache, self.v_cache, block_size, *graph_shape, device)

    def kv_cache_bytes(self) -> int:
        """Bytes the cache tensors hold (codes and scales): what `bytes_per_block` promises."""
        tensors = self.k_cache + self.v_cache + (self.k_scale or []) + (self.v_scale or [])
        return sum(t.numel() * t.element_size() for t in tensors)

    @torch.inference_mode()
    def run(self, scheduled: list[ScheduledSeq]) -> StepResult:
        input_ids, positions, slots = [], [], []
        prefills: list[PrefillChunk] = []
        prefill_tables: list[list[int]] = []
        decode_seqs: list[Sequence] = []
        sample_rows: list[int] = []  # (row of the last token) for sequences that get a new token
        sample_idx: list[int] = []
        prompt_rows: dict[int, tuple[int, list[int]]] = {}  # index -> (positions skipped, rows scoring the next token)
        bs = self.block_size
        for idx in _decode_first(scheduled):
            seq, n = scheduled[idx].seq, scheduled[idx].num_new_tokens
            start, end, row = seq.num_computed_tokens, seq.num_computed_tokens + n, len(input_ids)
            input_ids.extend(seq.token_ids[start:end])
            positions.extend(range(start, end))
            table = seq.block_table
            slots.extend(table[p // bs] * bs + p % bs for p in range(start, end))
            if not scheduled[idx].is_prefill:
                decode_seqs.append(seq)
            else:
                context = None
                prefill_tables.append(table)
                if start > 0 and self.attention == "torch":
                    context = torch.tensor(
                        [table[p // bs] * bs + p % bs for p in range(end)], device=self.device
                    )
                prefills.append(PrefillChunk(row, n, end, context))
            if seq.wants_prompt_logprobs:
                scored = _scored_rows(seq, start, end, row)
                if scored is not None:
                    prompt_rows[idx] = scored
            if end == seq.num_tokens:
                sample_rows.append(row + n - 1)
                sample_idx.append(idx)

        if self.graphs is not None and decode_seqs and not prefills and self.graphs.fits(
                len(decode_seqs), max(len(s.block_table) for s in decode_seqs)):
            logits = self.graphs.run(input_ids, positions, slots, [s.block_table for s in decode_seqs],
                                     [s.num_computed_tokens + 1 for s in decode_seqs])
            return self._postprocess(scheduled, logits, sample_idx, prompt_rows)
        ctx = AttentionContext(
            self.k_cache,
            self.v_cache,
            bs,
            torch.tensor(slots, device=self.device),
            prefills,
            self._decode_groups(decode_seqs) if self.decode_kernel is None and self.attention == "torch" else [],
            kv_format=self.shape.cache_dtype,
            k_scale=self.k_scale,
            v_scale=self.v_scale,
            decode_batch=self._decode_batch(decode_seqs),
            prefill_kernel=self.prefill_kernel,
            prefill_dtype=self.prefill_dtype,
        )
        if self.attention == "triton":
            from serving.kernels.cuda.step import PagedStep

            ctx.paged = PagedStep.build([s.block_table for s in decode_seqs],
                                        [s.num_computed_tokens + 1 for s in decode_seqs], prefill_tables,
                                        [(c.start, c.length, c.context_len) for c in prefills], self.device)
        keep_rows = sample_rows + [r for _, rows in prompt_rows.values() for r in rows]
        logits = self._forward(ctx, torch.tensor(input_ids, device=self.device),
                               torch.tensor(positions, device=self.device),
                               torch.tensor(keep_rows, dtype=torch.long, device=self.device))
        return self._postprocess(scheduled, logits, sample_idx, prompt_rows)

    def _forward(self, ctx: AttentionContext, input_ids, positions, keep_rows) -> torch.Tensor:
        if self.fast_forward is not None:
            return self.fast_forward(ctx, input_ids, positions, keep_rows)
        attention.set_context(ctx)
        try:
            return self.model(input_ids=input_ids[None], position_ids=positions[None], use_cache=False,
                              logits_to_keep=keep_rows).logits[0]
        finally:
            attention.set_context(None)

    def _decode_batch(self, seqs: list[Sequence]) -> DecodeBatch | None:
        if self.decode_kernel is None or not seqs:
            return None
        width = max(len(s.block_table) for s in seqs)
        tables = [b for s in seqs for b in (*s.block_table, *[0] * (width - len(s.block_table)))]
        return DecodeBatch(
            torch.tensor(tables, dtype=torch.long).view(len(seqs), width),
            torch.tensor([s.num_computed_tokens + 1 for s in seqs], dtype=torch.long),
            self.decode_kernel,
        )

    def _decode_groups(self, seqs: list[Sequence]) -> list[DecodeGroup]:
        """Rows 0..len(seqs) hold the decode tokens, shortest context first; cut them into groups so that
        padding to a group's longest context wastes little gather and attention work."""
        groups = []
        bs = self.block_size
        for start in range(0, len(seqs), DECODE_GROUP_SIZE):
            members = seqs[start : start + DECODE_GROUP_SIZE]
            max_blocks = max(len(s.block_table) for s in members)
            tables = torch.zeros(len(members), max_blocks, dtype=torch.long)
            lengths = torch.empty(len(members), dtype=torch.long)
            for i, s in enumerate(members):
                tables[i, : len(s.block_table)] = torch.tensor(s.block_table)
                lengths[i] = s.num_computed_tokens + 1
            pad = torch.arange(max_blocks * bs)[None, :] >= lengths[:, None]
            groups.append(DecodeGroup(start, tables.view(-1).to(self.device), pad[None, :, None, :].to(self.device),
                                      lengths))
        return groups

    def _postprocess(self, scheduled, logits, sample_idx, prompt_rows) -> StepResult:
        result = StepResult({}, {}, {})
        sample_logits = logits[: len(sample_idx)]  # in the head's dtype: greedy rows need no fp32 copy
        seqs = [scheduled[i].seq for i in sample_idx]
        if seqs:
            tokens = sample(sample_logits, seqs, self.generators, self.greedy_pick)
            result.sampled = dict(zip(sample_idx, tokens, strict=True))
            want = [k for k, s in enumerate(seqs) if s.params.logprobs is not None]
            if want:
                lps = torch.log_softmax(sample_logits[want].float(), dim=-1)
                top = max(seqs[k].params.logprobs for k in want)
                for k, lp in zip(want, token_logprobs(lps, [tokens[k] for k in want], top), strict=True):
                    lp.top = lp.top[: seqs[k].params.logprobs]
                    result.logprobs[sample_idx[k]] = lp
        offset = len(sample_idx)
        for idx, (skip, rows) in prompt_rows.items():
            seq = scheduled[idx].seq
            first = seq.num_computed_tokens + skip + 1  # the first token scored
            scored: list[TokenLogprob | None] = [None] * skip
            # fp32 log-softmax a few rows at a time: a 2,048-row step over a 150k vocabulary is 1.2 GB a copy
            for a in range(0, len(rows), LOGSOFTMAX_ROWS):
                b = min(a + LOGSOFTMAX_ROWS, len(rows))
                lps = torch.log_softmax(logits[offset + a : offset + b].float(), dim=-1)
                scored += token_logprobs(lps, seq.token_ids[first + a : first + b], seq.params.prompt_logprobs)
            result.prompt_logprobs[idx] = scored
            offset += len(rows)
        return result


def _scored_rows(seq, start: int, end: int, row: int) -> tuple[int, list[int]] | None:
    """For a step computing positions start..end of a scoring sequence: how many of the owed prompt
    logprobs stay None (before `prompt_score_from`) and the rows whose logits score the rest."""
    last_scored = min(end, seq.num_prompt_tokens - 1)  # position p scores token p + 1
    if last_scored <= start:
        return None
    first = min(max(start, seq.prompt_score_from - 1), last_scored)
    return first - start, list(range(row + first - start, row + last_scored - start))
