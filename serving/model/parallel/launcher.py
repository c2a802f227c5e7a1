"""Starting a tensor- or pipeline-parallel engine: rank 0 in this process, the others as processes.

Rank 0 holds the LLMEngine (scheduler, block manager, sampling) with its own shard or first stage;
ranks 1..N-1 are `torch.multiprocessing` processes that load the same model, keep their shard or stage,
and follow rank 0's per-step plan. A monitor thread watches them: if one dies, the group is marked
failed (the next step raises `RankFailedError` naming the rank), the others are stopped, and
`on_failure` runs (the server uses it to shut down). Workers exit on their own if rank 0 goes away.
"""

from __future__ import annotations

import atexit
import logging
import multiprocessing.connection
import os
import threading
import time
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
from pydantic import BaseModel, Field, model_validator
from torch.distributed.distributed_c10d import _set_pg_timeout  # public in all but name since torch 2.4

from quantgate.ports import free_port
from serving.model.parallel.ranks import (
    PipelineDriver,
    RankFailedError,
    TensorParallelDriver,
    WorkerRunner,
    broadcast,
    serve_rank,
)
from serving.model.parallel.sharding import StageState, cut_stage, drop_other_stages_kv, shard_model

log = logging.getLogger("quantgate.parallel")


class ParallelConfig(BaseModel):
    tensor_parallel_size: int = Field(1, ge=1)
    pipeline_parallel_size: int = Field(1, ge=1)
    num_microbatches: int | None = Field(None, ge=1)  # pipeline: default one per stage
    threads_per_rank: int | None = Field(None, ge=1)
    timeout_s: float = Field(120.0, gt=0)  # any one collective while serving
    # Rendezvous and every rank loading its part: a first kernel build or a slow disk may take minutes
    startup_timeout_s: float = Field(600.0, gt=0)

    @model_validator(mode="after")
    def _one_kind(self) -> ParallelConfig:
        if self.tensor_parallel_size > 1 and self.pipeline_parallel_size > 1:
            raise ValueError("combine tensor and pipeline parallelism is not supported: set one of them to 1")
        return self

    @property
    def world_size(self) -> int:
        return self.tensor_parallel_size * self.pipeline_parallel_size

    @property
    def mode(self) -> str:
        return "pp" if self.pipeline_parallel_size > 1 else "tp"

    @property
    def microbatches(self) -> int:
        return self.num_microbatches or self.pipeline_parallel_size


class ParallelGroup:
    """The ranks of one parallel engine, from rank 0's side: liveness, failure, shutdown."""

    def __init__(self, config: ParallelConfig, procs: list, device: torch.device):
        self.config, self.procs, self.device = config, procs, device
        self.failure: str | None = None
        self.on_failure: Callable[[str], None] | None = None
        self._stopping = False
        self._lock = threading.Lock()
        self._monitor = threading.Thread(target=self._watch, name="quantgate-rank-monitor", daemon=True)

    def start_monitor(self) -> None:
        self._monitor.start()

    def check(self) -> None:
        if self.failure:
            raise RankFailedError(self.failure)

    def mark_failed(self, why: str) -> None:
        with self._lock:
            if self.failure or self._stopping:
                return
            self.failure = f"parallel engine stopped: {why}"
        log.error(self.failure)
        self._terminate()
        if self.on_failure:
            self.on_failure(self.failure)

    def collective_failed(self, exc: BaseException) -> None:
        """A collective raised: name the rank that died if one did (its exit may lag the broken socket)."""
        deadline = time.monotonic() + 2.0
        while self.failure is None and time.monotonic() < deadline:
            dead = [(rank, p) for rank, p in enumerate(self.procs, start=1) if not p.is_alive()]
            if dead:
                return self.mark_failed(_exit_message(*dead[0]))
            time.sleep(0.05)
        self.mark_failed(f"a collective failed: {exc}")

    def shutdown(self) -> None:
        """Stop every rank: a stop message if all are healthy, then join; terminate what is left."""
        with self._lock:
            if self._stopping:
                return
            self._stopping = True
        if self.failure is None and all(p.is_alive() for p in self.procs) and dist.is_initialized():
            try:
                from serving.model.parallel.plan import STOP

                broadcast((STOP,), self.device)
            except RuntimeError:
                pass
        for p in self.procs:
            p.join(timeout=10)
        self._terminate()
        if dist.is_initialized():
            dist.destroy_process_group()

    def _terminate(self) -> None:
        for p in self.procs:
            if p.is_alive():
                p.terminate()
        for p in self.procs:
            p.join(timeout=5)
            if p.is_alive():
                p.kill()
                p.join(timeout=5)

    def _watch(self) -> None:
        sentinels = {p.sentinel: (rank, p) for rank, p in enumerate(self.procs, start=1)}
        ready = multiprocessing.connection.wait(list(sentinels))
        if self._stopping:
            return
        self.mark_failed(_exit_message(*sentinels[ready[0]]))


def _exit_message(rank: int, proc) -> str:
    """Name a dead rank and its exit code. Two threads may reap the same child (the monitor and a failed
    collective), and the loser's poll sees no code until the winner has stored it: wait for that."""
    deadline = time.monotonic() + 2.0
    while proc.exitcode is None and time.monotonic() < deadline:
        proc.join(timeout=0.05)
    return f"rank {rank} (pid {proc.pid}) exited with code {proc.exitcode}"


def launch(model: str | Path, config: ParallelConfig, *, engine_cls: type, device: str | None = None,
           dtype: torch.dtype | str | None = None, **engine_kwargs):
    """An LLMEngine (`engine_cls`, handed in: serving.core.engine imports this module, not the other way) whose
    forward passes run over `config.world_size` ranks (this process is rank 0)."""
    from transformers import AutoTokenizer

    from quantgate.env import apply_defaults
    from quantgate.models import resolve_model
    from serving.model.device import default_device, resolve_dtype

    apply_defaults()
    model_dir = resolve_model(model)
    device_ = torch.device(device or default_device())
    isa = engine_kwargs.get("isa")  # every rank loads and runs on the kernel path rank 0 does
    dtype_ = resolve_dtype(dtype, device_, isa)
    if dist.is_initialized():
        raise RuntimeError("a parallel engine is already running in this process (one process group each)")
    if config.threads_per_rank:
        torch.set_num_threads(config.threads_per_rank)
    init = f"tcp://127.0.0.1:{free_port()}"
    ctx = torch.multiprocessing.get_context("spawn")
    procs = [ctx.Process(target=_worker_main, name=f"quantgate-rank{r}", daemon=True,
                         args=(r, config, init, str(model_dir), device_.type, dtype_, isa, os.getpid()))
             for r in range(1, config.world_size)]
    for p in procs:
        p.start()
    group = ParallelGroup(config, procs, _rank_device(device_, 0))
    group.start_monitor()  # a rank that dies while loading is reported at once
    try:
        _init_rank0(group, config, init, device_.type)
        hf_model, state = _load_rank(str(model_dir), device_, dtype_, isa, 0, config)
        engine_kwargs.setdefault("model_name", str(model))
        engine = engine_cls(hf_model, AutoTokenizer.from_pretrained(model_dir), device=device_, **engine_kwargs)
        runner = engine.runner
        broadcast((runner.block_size, runner.num_blocks, runner.shape.dtype, runner.shape.cache_dtype), group.device)
        if config.mode == "tp":
            engine.runner = TensorParallelDriver(runner, group)
        else:
            hidden = _hidden_size(hf_model)
            drop_other_stages_kv(runner, state.layers)
            engine.runner = PipelineDriver(runner, group, state, config.microbatches, hidden)
        _started(config)
    except BaseException:
        group.mark_failed("startup failed")
        group.shutdown()
        raise
    engine.parallel = group
    atexit.register(group.shutdown)
    return engine


def _worker_main(rank: int, config: ParallelConfig, init: str, model_dir: str, device_type: str,
                 dtype: torch.dtype, isa: str | None, parent_pid: int) -> None:
    threading.Thread(target=_exit_with_parent, args=(parent_pid,), daemon=True).start()
    if config.threads_per_rank:
        torch.set_num_threads(config.threads_per_rank)
    device = _rank_device(torch.device(device_type), rank)
    _init_group(rank, config, init, device_type)
    try:
        model, state = _load_rank(model_dir, device, dtype, isa, rank, config)
        block_size, num_blocks, kv_dtype, kv_cache_dtype = broadcast(None, device)
        runner = WorkerRunner(model, device, block_size, num_blocks, kv_dtype, kv_cache_dtype,
                              isa if device.type == "cpu" else None)
        if state is not None:
            drop_other_stages_kv(runner, state.layers)
        _started(config)
        with torch.inference_mode():
            serve_rank(runner, config.mode, state, _hidden_size(model))
    except (RuntimeError, ConnectionError) as exc:  # rank 0 went away mid-collective: nothing to serve
        log.warning("rank %d stopping: %s", rank, exc)
        os._exit(1)
    dist.destroy_process_group()


def _load_rank(model_dir: str, device: torch.device, dtype: torch.dtype, isa: str | None, rank: int,
               config: ParallelConfig):
    """This rank's part of the model. Shards are cut before the engine packs its weights for the kernel path
    (packed layouts have no rows to slice); stages keep layers whole, so they are cut from the packed model."""
    from serving.model.model_runner import load_model

    if config.mode == "tp":
        return load_model(Path(model_dir), device, dtype, isa,
                          prepare=lambda model: shard_model(model, rank, config.tensor_parallel_size)), None
    model = load_model(Path(model_dir), device, dtype, isa)
    state = StageState()
    cut_stage(model, rank, config.pipeline_parallel_size, state)
    return model, state


def _init_rank0(group: ParallelGroup, config: ParallelConfig, init: str, device_type: str) -> None:
    """Rendezvous in a thread, so that a rank dying while it loads fails the launch at once instead of
    after the whole timeout."""
    errors: list[BaseException] = []

    def init_group() -> None:
        try:
            _init_group(0, config, init, device_type)
        except BaseException as exc:  # noqa: BLE001 (re-raised in the caller)
            errors.append(exc)

    thread = threading.Thread(target=init_group, name="quantgate-rendezvous", daemon=True)
    thread.start()
    while thread.is_alive():
        thread.join(0.1)
        group.check()
    if errors:
        raise errors[0]


def _init_group(rank: int, config: ParallelConfig, init: str, device_type: str) -> None:
    backend = "nccl" if device_type == "cuda" else "gloo"
    dist.init_process_group(backend, init_method=init, rank=rank, world_size=config.world_size,
                            timeout=timedelta(seconds=config.startup_timeout_s))


def _started(config: ParallelConfig) -> None:
    """Every rank is loaded: from here on a collective that waits longer than `timeout_s` means a stuck rank."""
    dist.barrier()
    _set_pg_timeout(timedelta(seconds=config.timeout_s))


def _rank_device(device: torch.device, rank: int) -> torch.device:
    if device.type != "cuda":
        return device
    torch.cuda.set_device(rank)
    return torch.device("cuda", rank)


def _hidden_size(model) -> int:
    config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    return config.hidden_size


def _exit_with_parent(parent_pid: int) -> None:
    while True:
        if os.getppid() != parent_pid:
            os._exit(1)  # rank 0 died without stopping us: no orphan ranks
        time.sleep(0.5)


def from_pretrained_parallel(engine_cls: type, model: str | Path, device: str | None, dtype,
                             tensor_parallel_size: int, pipeline_parallel_size: int, **kwargs):
    """`LLMEngine.from_pretrained(..., tensor_parallel_size=N | pipeline_parallel_size=N)`; the parallel
    options (`num_microbatches`, `threads_per_rank`, `parallel_timeout_s`, `parallel_startup_timeout_s`) are
    taken out of kwargs."""
    options = {"num_microbatches": kwargs.pop("num_microbatches", None),
               "threads_per_rank": kwargs.pop("threads_per_rank", None)}
    if "parallel_timeout_s" in kwargs:
        options["timeout_s"] = kwargs.pop("parallel_timeout_s")
    if "parallel_startup_timeout_s" in kwargs:
        options["startup_timeout_s"] = kwargs.pop("parallel_startup_timeout_s")
    config = ParallelConfig(tensor_parallel_size=tensor_parallel_size, pipeline_parallel_size=pipeline_parallel_size,
                            **options)
    return launch(model, config, engine_cls=engine_cls, device=device, dtype=dtype, **kwargs)
