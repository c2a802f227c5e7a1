"""LLMEngine: requests in, tokens out, one paged-attention forward per step."""

from __future__ import annotations

import itertools
import logging
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import torch

from serving.core.block_manager import BlockManager
from serving.core.engine_interface import EngineConfig, EngineStats, RequestOutput
from serving.core.fairness import TenantFairness
from serving.core.request_text import Finisher, eos_token_ids, request_output, tokenize_prompt
from serving.core.sampling_params import SamplingParams
from serving.core.scheduler import MAX_NUM_BATCHED_TOKENS
from serving.core.schedulers import SCHEDULERS
from serving.core.sequence import Sequence, SequenceStatus
from serving.kernels.cpu import isa as isas
from serving.kernels.cuda import resolve_backend
from serving.model.device import default_device, resolve_dtype
from serving.model.llama_forward import supports
from serving.model.model_runner import KVCacheShape, ModelRunner, load_model
from serving.model.sampler import NO_TOKEN

__all__ = ["EngineConfig", "EngineStats", "LLMEngine", "RequestOutput"]

log = logging.getLogger(__name__)

DEFAULT_CPU_KV_GB = 2.0
GPU_MEMORY_UTILIZATION = 0.9
MAX_GRAPH_BATCH = 512  # decode steps of more sequences run eagerly


class LLMEngine:
    """The engine (its contract, `EngineClient`, and what it reports are in serving/core/engine_interface.py)."""

    def __init__(
        self,
        model,
        tokenizer,
        *,
        device: str | torch.device = "cpu",
        block_size: int = 16,
        num_kv_blocks: int | None = None,
        kv_cache_memory_gb: float | None = None,
        scheduler: str = "continuous",
        max_num_seqs: int = 64,
        max_num_batched_tokens: int = MAX_NUM_BATCHED_TOKENS,
        enable_prefix_caching: bool = True,
        prefix_cache_scope: str = "tenant",
        max_model_len: int | None = None,
        model_name: str = "model",
        kv_cache_dtype: str = "auto",
        tenant_fairness: TenantFairness | None = None,
        isa: str | None = None,
        attention: str = "auto",
        cuda_graphs: bool | None = None,
        batch_timeout_s: float | None = None,
        kv_huge_pages: bool = False,
    ):
        """`kv_huge_pages`: the CPU cache on 2 MB pages (serving/model/kv_memory.py; `quantgate serve` asks for it,
        QUANTGATE_KV_HUGE_PAGES=0 refuses it): faster decode attention once blocks scatter, seconds more to start.
        `attention`: auto (Triton kernels on CUDA, torch elsewhere), torch, or triton (serving/kernels/cuda; on CPU
        in Triton's interpreter). `cuda_graphs`: decode replayed from CUDA graphs per batch bucket (None: on
        wherever Triton attention runs on CUDA; True on CPU runs the eager stand-in). `batch_timeout_s`: the
        dynamic scheduler's batch timeout (None: its default; an error with another scheduler)."""
        if scheduler not in SCHEDULERS:
            raise ValueError(f"unknown scheduler {scheduler!r}; choose one of {sorted(SCHEDULERS)}")
        if batch_timeout_s is not None and scheduler != "dynamic":
            raise ValueError("batch_timeout_s is the dynamic scheduler's; use scheduler='dynamic'")
        if max_num_seqs < 1 or max_num_batched_tokens < 1:
            raise ValueError("max_num_seqs and max_num_batched_tokens must be positive")
        self.device = torch.device(device)
        self.attention = resolve_backend(attention, self.device, kv_cache_dtype)
        if cuda_graphs is None:
            cuda_graphs = self.attention == "triton" and self.device.type == "cuda" and supports(model)
        if cuda_graphs and (self.attention != "triton" or not supports(model)):
            raise ValueError("cuda_graphs needs attention='triton' and a model serving/model/llama_forward.py runs")
        self.model = model
        self.tokenizer = tokenizer
        self.model_name = model_name
        self.block_size = block_size
        config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
        self.max_model_len = max_model_len or getattr(config, "max_position_embeddings", None) or 2048
        self.vocab_size = model.get_input_embeddings().weight.shape[0]
        kv_dtype = model.get_input_embeddings().weight.dtype
        if not kv_dtype.is_floating_point:
            kv_dtype = torch.float32
        shape = KVCacheShape.from_config(model.config, kv_dtype, kv_cache_dtype)  # auto | int8 | fp8
        if num_kv_blocks is None:
            num_kv_blocks = self._blocks_for_budget(shape, kv_cache_memory_gb)
            if kv_cache_memory_gb is None:  # never reserve more than every slot at full context could use
                num_kv_blocks = min(num_kv_blocks, max_num_seqs * -(-self.max_model_len // block_size))
        self.block_manager = BlockManager(num_kv_blocks, block_size, enable_prefix_caching, prefix_cache_scope)
        options = {} if batch_timeout_s is None else {"batch_timeout_s": batch_timeout_s}
        self.scheduler = SCHEDULERS[scheduler](self.block_manager, max_num_seqs, max_num_batched_tokens,
                                               fairness=tenant_fairness or TenantFairness(), **options)
        self.scheduler_name = scheduler
        # the kernel path attention and the fused ops take (the model's layers recorded theirs at load)
        self.kernel_isa = isas.resolve(isa) if self.device.type == "cpu" else self.device.type
        graph_shape = (min(max_num_seqs, MAX_GRAPH_BATCH), -(-self.max_model_len // block_size)) if cuda_graphs else None
        self.runner = ModelRunner(model, self.device, block_size, num_kv_blocks, kv_dtype, kv_cache_dtype,
                                  isa if self.device.type == "cpu" else None, self.attention, graph_shape,
                                  kv_huge_pages)
        self.kv_cache_dtype = kv_cache_dtype
        self.config = EngineConfig(
            model_name, str(self.device), block_size, num_kv_blocks, self.max_model_len, scheduler, max_num_seqs,
            max_num_batched_tokens, enable_prefix_caching, prefix_cache_scope, kv_cache_dtype, self.attention,
            self.kernel_isa, bool(cuda_graphs), getattr(self.scheduler, "batch_timeout_s", None))
        self.eos_token_ids = eos_token_ids(model, tokenizer)
        self.finisher = Finisher(tokenizer, self.eos_token_ids, self.max_model_len)
        self.sequences: dict[str, Sequence] = {}
        self._inbox: list[Sequence] = []
        self._aborts: list[str] = []
        self._lock = threading.Lock()
        self._ids = itertools.count()
        self.prompt_tokens = 0
        self.generation_tokens = 0

    @classmethod
    def from_pretrained(
        cls,
        model: str | Path = "smollm2-135m",
        device: str | None = None,
        dtype: torch.dtype | str | None = None,
        tensor_parallel_size: int = 1,
        pipeline_parallel_size: int = 1,
        isa: str | None = None,
        **kwargs,
    ) -> LLMEngine:
        """Load any model reference (`smollm2-135m`, a HF dir, a `.gguf`, a quantized variant dir).
        With tensor_parallel_size or pipeline_parallel_size > 1 the ranks run as processes (serving/model/parallel).
        `isa` forces a kernel path (amx, avx512bf16, avx512, avx2, scalar, torch; default: `QUANTGATE_ISA`, else
        the best this CPU runs)."""
        if tensor_parallel_size > 1 or pipeline_parallel_size > 1:
            from serving.model.parallel import from_pretrained_parallel

            return from_pretrained_parallel(cls, model, device, dtype, tensor_parallel_size,
                                            pipeline_parallel_size, isa=isa, **kwargs)
        from transformers import AutoTokenizer

        from quantgate.env import apply_defaults
        from quantgate.models import resolve_model

        apply_defaults()
        model_dir = resolve_model(model)
        device = torch.device(device or default_device())
        dtype = resolve_dtype(dtype, device, isa)
        hf_model = load_model(model_dir, device, dtype, isa)
        tokenizer = AutoTokenizer.from_pretrained(model_dir)
        kwargs.setdefault("model_name", str(model))
        return cls(hf_model, tokenizer, device=device, isa=isa, **kwargs)

    # ---- requests ------------------------------------------------------------------------------
    def add_request(
        self,
        prompt: str | list[int],
        params: SamplingParams | None = None,
        request_id: str | None = None,
        *,
        tenant: str = "default",
        cache_salt: str | None = None,
        stream_text: bool = False,
        arrival_time: float | None = None,
    ) -> str:
        """Validate and queue a request; thread-safe. Raises ValueError naming what is wrong."""
        params = params or SamplingParams()
        params.validate()
        text, token_ids = tokenize_prompt(self.tokenizer, self.vocab_size, prompt)
        self._check_fits(len(token_ids), params.max_tokens, tenant)
        with self._lock:
            request_id = request_id if request_id is not None else f"req-{next(self._ids)}"
            if request_id in self.sequences or any(s.request_id == request_id for s in self._inbox):
                raise ValueError(f"request id {request_id!r} is already in use")
            seq = Sequence(request_id, text, token_ids, params, tenant=tenant, cache_salt=cache_salt,
                           stream_text=stream_text)
            if arrival_time is not None:
                seq.metrics.arrival_time = arrival_time
            if params.seed is not None and not params.greedy:
                gen = torch.Generator(device=self.device)
                gen.manual_seed(params.seed)
                self.runner.generators[request_id] = gen
            self._inbox.append(seq)
        return request_id

    def abort(self, request_id: str) -> None:
        """Thread-safe; the request ends with finish_reason 'abort' and its blocks are freed next step."""
        with self._lock:
            self._aborts.append(request_id)

    def has_unfinished(self) -> bool:
        with self._lock:
            return bool(self._inbox or self._aborts or self.scheduler.has_unfinished())

    # ---- the loop ------------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        outputs = self._take_inbox()
        plan = self.scheduler.schedule()
        if not plan.scheduled:
            return outputs
        now = time.perf_counter()
        for item in plan.scheduled:
            if item.seq.metrics.first_scheduled_time is None:
                item.seq.metrics.first_scheduled_time = now
        result = self.runner.run(plan.scheduled)
        self.scheduler.step_done(plan, time.perf_counter() - now)
        now = time.perf_counter()
        for idx, item in enumerate(plan.scheduled):
            seq = item.seq
            before = seq.num_computed_tokens
            seq.num_computed_tokens += item.num_new_tokens
            self.block_manager.mark_computed(seq, before)
            if idx in result.prompt_logprobs:
                seq.prompt_logprobs.extend(result.prompt_logprobs[idx])
            if before < seq.num_prompt_tokens:
                self.prompt_tokens += min(seq.num_computed_tokens, seq.num_prompt_tokens) - before
            if idx not in result.sampled:
                continue
            token = result.sampled[idx]
            new_tokens = []
            if token == NO_TOKEN:  # its logits were not finite: this sequence alone ends
                self.finisher.finish(seq, "error")
            else:
                new_tokens.append(token)
                seq.token_ids.append(token)
                self.generation_tokens += 1
                if seq.metrics.first_token_time is None:
                    seq.metrics.first_token_time = now
                seq.metrics.token_times.append(now)
                if idx in result.logprobs:
                    seq.logprobs.append(result.logprobs[idx])
                self.finisher.check(seq, token)
            if seq.is_finished:
                seq.metrics.finished_time = now
                self.scheduler.finish(seq)
            outputs.append(request_output(seq, new_tokens))
        for seq in list(self.sequences.values()):
            if seq.is_finished:
                del self.sequences[seq.request_id]
                self.runner.generators.pop(seq.request_id, None)
        return outputs

    def generate(
        self,
        prompts: str | list[str] | list[list[int]],
        params: SamplingParams | list[SamplingParams] | None = None,
        use_tqdm: bool = False,
    ) -> list[RequestOutput]:
        """Run prompts to completion with continuous batching; outputs in input order."""
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        params_list = params if isinstance(params, list) else [params or SamplingParams()] * len(prompts)
        if len(params_list) != len(prompts):
            raise ValueError("need one SamplingParams per prompt")
        ids = [self.add_request(p, sp) for p, sp in zip(prompts, params_list, strict=True)]
        finals: dict[str, RequestOutput] = {}
        bar = None
        if use_tqdm:
            from tqdm import tqdm

            bar = tqdm(total=len(ids), desc="generate", unit="req")
        while len(finals) < len(ids):
            for out in self.step():
                if out.finished:
                    finals[out.request_id] = out
                    if bar:
                        bar.update(1)
        if bar:
            bar.close()
        return [finals[i] for i in ids]

    def stream(self, prompt: str | list[int], params: SamplingParams | None = None) -> Iterator[RequestOutput]:
        """Drive the engine and yield this request's output each time it gains tokens."""
        request_id = self.add_request(prompt, params, stream_text=True)
        while True:
            for out in self.step():
                if out.request_id == request_id:
                    yield out
                    if out.finished:
                        return

    def stats(self) -> EngineStats:
        load = self.scheduler.tenant_load()
        return EngineStats(
            num_blocks=self.block_manager.num_blocks,
            used_blocks=self.block_manager.num_used_blocks,
            num_running=sum(load.running.values()),
            num_waiting=sum(load.waiting.values()) + len(self._inbox),
            num_preemptions=self.scheduler.num_preemptions,
            prefix_cache_hit_tokens=self.block_manager.prefix_cache_hit_tokens,
            prompt_tokens=self.prompt_tokens,
            generation_tokens=self.generation_tokens,
            block_size=self.block_size,
            running_by_tenant=load.running,
            waiting_by_tenant=load.waiting,
            kv_blocks_by_tenant=load.kv_blocks,
            reserved_blocks=self._reserved_blocks(),
        )

    @property
    def tenant_kv_quotas(self) -> dict[str, int]:
        return self.scheduler.tenant_max_kv_blocks

    # ---- internals -----------------------------------------------------------------------------
    def _reserved_blocks(self) -> int:
        """Blocks unfinished requests hold or will hold (prompt + max_tokens each), never below those used."""
        bm = self.block_manager
        for _ in range(5):  # the engine thread may change the dict while another thread reads it
            try:
                seqs = list(self.sequences.values())
                break
            except RuntimeError:
                continue
        else:
            seqs = []
        held = sum(bm.blocks_needed(s.num_prompt_tokens + s.params.max_tokens) for s in seqs if not s.is_finished)
        return max(held, bm.num_used_blocks)

    def _take_inbox(self) -> list[RequestOutput]:
        with self._lock:
            inbox, self._inbox = self._inbox, []
            aborts, self._aborts = self._aborts, []
        for seq in inbox:
            self.sequences[seq.request_id] = seq
            self.scheduler.add(seq)
        outputs = []
        for request_id in aborts:
            seq = self.scheduler.abort(request_id)
            if seq is None:
                continue
            seq.status, seq.finish_reason = SequenceStatus.FINISHED, "abort"
            seq.metrics.finished_time = time.perf_counter()
            self.sequences.pop(request_id, None)
            self.runner.generators.pop(request_id, None)
            outputs.append(request_output(seq, []))
        return outputs

    def _check_fits(self, prompt_len: int, max_tokens: int, tenant: str = "default") -> None:
        if prompt_len + max_tokens > self.max_model_len:
            raise ValueError(
                f"this model's maximum context length is {self.max_model_len} tokens, but the request needs "
                f"{prompt_len + max_tokens} ({prompt_len} in the prompt, {max_tokens} for max_tokens)"
            )
        need = self.block_manager.blocks_needed(prompt_len + max_tokens)
        if need > self.block_manager.num_blocks:
            raise ValueError(
                f"the request needs {need} KV blocks ({prompt_len} prompt + {max_tokens} max_tokens) but the "
                f"KV cache holds only {self.block_manager.num_blocks} blocks of {self.block_size} tokens"
            )
        quota = self.tenant_kv_quotas.get(tenant)
        if quota is not None and need > quota:  # it could never be admitted: refuse it now, not hang
            raise ValueError(
                f"the request needs {need} KV blocks ({prompt_len} prompt + {max_tokens} max_tokens) but "
                f"tenant {tenant!r} may hold at most {quota} blocks of {self.block_size} tokens"
            )

    def _blocks_for_budget(self, shape: KVCacheShape, memory_gb: float | None) -> int:
        per_block = shape.bytes_per_block(self.block_size)
        if memory_gb is None:
            if self.device.type == "cuda":
                free, _ = torch.cuda.mem_get_info(self.device)
                memory_gb = free * GPU_MEMORY_UTILIZATION / 2**30
            else:
                memory_gb = DEFAULT_CPU_KV_GB
        blocks = int(memory_gb * 2**30 // per_block)
        if blocks < 1:
            raise ValueError(f"a KV budget of {memory_gb:.3f} GB holds no block of {per_block} bytes")
        return blocks

