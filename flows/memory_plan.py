"""The release's memory plan (issue 45): each stage's peak memory, from the source's config.json and its
safetensors headers alone (no model is loaded), beside what this machine has available.

`plan(inputs, machine)` is pure: dataclasses in, a `MemoryPlan` out (its `table()` is Markdown), so a
70B-shaped config can be planned on a laptop and tests craft their own. The stages and what each holds at
its peak:

- `quantize <method>`: a child process (flows/stage_process.py) beside the flow's. A streamed int8wo /
  int4wo build (quantize/streaming.py) holds one row block of the largest tensor (CHUNK_ELEMENTS, cast to
  fp32, with quantize_groups' temporaries) and that tensor's scales; a streamed int4-awq / int4-gptq build
  (quantize/calibrated_stream.py) one decoder layer in the build dtype (fp32) twice for GPTQ (the probe runs
  the source layer beside the quantized one), AWQ_LAYER_COPIES times for AWQ (its scale search's copies too),
  the calibration hidden states in and out and the widest linear's inputs, and GPTQ's Hessian of its widest
  input (then the head and its Hessian, whichever is more); a streamed w8a8 build (quantize/w8a8_stream.py) one
  layer in the build dtype, its int8 codes twice, the smoothing search's copies of its widest input set
  (W8A8_SEARCH_BYTES a parameter) and the calibration hidden states. A
  source without safetensors builds in memory: ~12 bytes per parameter (streaming.py's docstring).
- `measure <model>`: one engine at a time (flows/measuring.py): its weights as served, the KV cache
  (MeasureConfig.kv_cache_memory_gb) and the activations of one scheduler step.
- `speed`: the baseline and the largest variant resident together (flows/speed_rounds.py's pairs), each
  with the KV blocks of the largest speed point.
- `canary`: champion and challenger served together (flows/canary_stage.py, CANARY_KV_GB each); before a
  release the champion is planned as the baseline and the challenger as the largest variant.

Weights as served: the baseline at the engine's dtype on this machine (serving/model/device.py: bf16 where
the kernel path takes bf16 rows, else fp32; QUANTGATE_DTYPE overrides), int8wo ~1 byte per parameter plus a
fp32 scale per row, int4wo / int4-awq / int4-gptq ~0.5 byte plus a bf16 scale and zero per group of 32,
embeddings and head included, the norms at the serving dtype (quantize.capacity.estimate_weight_bytes;
as served = as stored for these, docs/results/2026-12-01-amd-epyc.md). Every stage adds RUNTIME_BYTES, the measure
stages EVAL_BYTES, and ENGINE_BYTES per resident engine; activations are one step's or a load's
transient (`load_bytes`), the more. Left out: a first run's kernel builds (flows compile the engine's C++ kernels
on first use; measured +2.1 GB for ~40 s in the first measure stage: serving/kernels/cpu/build.py).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from quantize.capacity import DTYPE_BYTES, ModelShape, estimate_weight_bytes, split_variant

GIB = 1 << 30
# What the flow's own processes hold beside the models, measured by `quantgate bench release-memory` (the AMX
# Xeon, 2026-12-05, SmolLM2-135M and Qwen2.5-Coder-0.5B): the flow's process with torch, transformers, Prefect
# and MLflow imported (0.43-0.44 GB anonymous) and Prefect's local API server (0.22 GB).
RUNTIME_BYTES = 6 * GIB // 10
# A measure stage's evals: lm-eval's tasks and their datasets, the tokenizer (measured: a measure stage 0.9-1.0 GB
# above the flow, its engine and its KV, with its step's logits).
EVAL_BYTES = GIB // 2
CHILD_RUNTIME_BYTES = 3 * GIB // 10  # the quantize stage's child interpreter: torch and transformers imported (0.3 GB)
# Each resident engine beside its weights and KV: anonymous memory after load minus both, 0.22 GB (int8wo,
# int4wo) to 0.40 GB (bf16 baseline of an fp32 source), SmolLM2-135M on the AMX Xeon, 2026-12-05
ENGINE_BYTES = 3 * GIB // 10
ENGINE_TOKENS = 2048  # serving.core.scheduler.MAX_NUM_BATCHED_TOKENS: the most tokens one engine step runs
# Rows of logits one eval step holds: fidelity and perplexity score every prompt row of a full step, and lm-eval's
# continuations can fill most of one (PIQA's solutions: +0.9 GB over the engine on Qwen2.5-Coder-0.5B, perplexity
# +1.0 GB); the engine log-softmaxes them in fp32 LOGSOFTMAX_ROWS at a time (serving/model/model_runner.py)
LOGIT_ROWS = ENGINE_TOKENS
LOGSOFTMAX_ROWS = 256
STREAM_BLOCK_BYTES = 4 * (8 << 20) * 4  # quantize.streaming.CHUNK_ELEMENTS as fp32, with ~3 temporaries
IN_MEMORY_BYTES_PER_PARAM = 12  # a build that cannot stream: the whole model in fp32, quantized in place
CALIBRATED = ("int4-awq", "int4-gptq")
# An AWQ layer in the build dtype: the source's, its quantized copy, and the scale search's scaled and bf16 copies
# (measured: the build's working set over the runtime is 0.32 / 0.93 / 3.5 GB at 0.5B / 1.5B / 8B-shaped,
# docs/results/2026-12-06-release-memory.md; one layer 0.06 / 0.19 / 0.87 GB in fp32)
AWQ_LAYER_COPIES = 4
# w8a8's smoothing search over one input set (quantize/w8a8.py `_error_sum`), per parameter of the set: its fp32
# weights, their smoothed copy, the codes and the codes widened to fp32
W8A8_SEARCH_BYTES = 13
CAPACITY_HEADROOM_GB = 1.0  # the capacity budget: the baseline as served + this much KV, at least the default
WAYS_OUT = ("fewer methods (--methods)", "serve in bfloat16 (QUANTGATE_DTYPE=bfloat16; --dtype bfloat16 where "
            "the verb has it)", "a smaller KV budget (the policy's speed points and long_context lengths; "
            "MeasureConfig.kv_cache_memory_gb)", "a machine with more memory")


@dataclass(frozen=True)
class Inputs:
    """What the plan needs: the config, the methods as the release names them, and the stages' settings."""

    config: dict[str, Any]
    methods: tuple[str, ...]
    serving_dtype: str = "bfloat16"  # the engine's on this machine
    stored_dtype: str = "bfloat16"  # the source's safetensors (what a streamed build reads)
    streamable: bool = True  # the source has safetensors
    measure_kv_bytes: int = GIB // 2  # MeasureConfig.kv_cache_memory_gb
    speed_kv_tokens: int = 16 * 28  # flows.speed_rounds.kv_blocks x BLOCK_SIZE, per engine
    canary_kv_bytes: int = GIB // 4  # flows.canary_stage.CANARY_KV_GB, per engine
    calibration_tokens: int = 2048  # quantize.methods' int4-awq / int4-gptq default
    build_dtype: str = "float32"  # quantize.methods' default `dtype` option


@dataclass(frozen=True)
class Machine:
    available_bytes: int
    source: str  # where the figure comes from
    device_bytes: int | None = None  # a GPU's free memory: the served stages' room on CUDA (None: the host's)

    def room(self, stage: Stage) -> int:
        """The memory a stage must fit in: a GPU's for the served stages of a CUDA release, else the host's."""
        served = not stage.name.startswith("quantize ")
        return self.device_bytes if served and self.device_bytes is not None else self.available_bytes


@dataclass(frozen=True)
class Stage:
    name: str
    models: tuple[str, ...]
    weights: int  # weights as served (quantize: the build's working set)
    kv: int
    activations: int
    runtime: int

    @property
    def total(self) -> int:
        return self.weights + self.kv + self.activations + self.runtime


@dataclass(frozen=True)
class MemoryPlan:
    stages: list[Stage]
    machine: Machine
    served: dict[str, int] = field(default_factory=dict)  # model -> weights as served
    serving_dtype: str = "bfloat16"
    capacity_budget_gb: float = 2.0
    not_planned: str = ""  # why there is no plan (a config the shapes cannot be read from): nothing is refused

    def unfit(self) -> list[Stage]:
        return [s for s in self.stages if s.total > self.machine.room(s)]

    def table(self) -> str:
        lines = ["## Memory per stage (planned from config.json, no model loaded)", "",
                 "| stage | resident | weights GB | KV GB | activations GB | runtime GB | peak GB | fits |",
                 "| --- | --- | ---: | ---: | ---: | ---: | ---: | --- |"]
        avail = self.machine.available_bytes
        if self.not_planned:
            return f"{lines[0]}\n\n- not planned: {self.not_planned}\n"
        for s in self.stages:
            lines.append(f"| {s.name} | {' + '.join(s.models)} | {gb(s.weights)} | {gb(s.kv)} | {gb(s.activations)} "
                         f"| {gb(s.runtime)} | **{gb(s.total)}** | {'yes' if s.total <= self.machine.room(s) else '**no**'} |")
        served = ", ".join(f"{m} {gb(b)} GB" for m, b in self.served.items())
        gpu = self.machine.device_bytes
        lines += ["", f"- available: **{gb(avail)} GB** ({self.machine.source})"
                  + (f"; the GPU's free memory {gb(gpu)} GB for every stage but quantize" if gpu is not None else ""),
                  f"- weights as served ({self.serving_dtype} engine): {served}",
                  f"- runtime: {gb(RUNTIME_BYTES)} GB per stage (the flow's processes; flows/memory_plan.py), "
                  f"{gb(EVAL_BYTES)} GB more in a measure stage (lm-eval's tasks and datasets), "
                  f"{gb(ENGINE_BYTES)} GB more per resident engine, the quantize child's interpreter "
                  f"{gb(CHILD_RUNTIME_BYTES)} GB more; activations: one engine step's or a load's transient",
                  f"- capacity budget (capacity/max_seqs): {self.capacity_budget_gb:g} GiB of weights + KV"]
        if self.unfit():
            lines.append(f"- **the release refuses** before quantizing: {', '.join(s.name for s in self.unfit())} "
                         f"cannot fit; ways out: {'; '.join(self.ways_out(self.unfit()[0]))}")
        return "\n".join(lines) + "\n"

    def ways_out(self, stage: Stage | None = None) -> list[str]:
        """WAYS_OUT that can help `stage`: bf16 only where the engine is wider, fewer methods only where a variant
        is resident (for a pair: without its variant, the next largest pairs with the baseline)."""
        ways = [w for w in WAYS_OUT if self.serving_dtype != "bfloat16" or "bfloat16" not in w]
        if stage is not None and stage.models == ("baseline",):
            ways = ways[1:]
        elif stage is not None and stage.name in ("speed", "canary"):
            variant = stage.models[1].removeprefix("challenger (").removesuffix(")")
            ways[0] = f"fewer methods (--methods without {variant}: the next largest variant pairs with the baseline)"
        return ways

    def check(self) -> None:
        """Raise MemoryRefused naming the first stage that cannot fit (the flow calls it before any work)."""
        unfit = self.unfit()
        if not unfit:
            return
        s, ways = unfit[0], self.ways_out(unfit[0])
        avail = self.machine.room(s)
        raise MemoryRefused(
            f"stage {s.name!r} ({' + '.join(s.models)}) needs {s.total:,} bytes ({gb(s.total)} GB) at its peak; "
            f"this machine has {avail:,} bytes ({gb(avail)} GB) available ({self.machine.source}): refused before "
            f"anything was built. Ways out: {'; '.join(ways)}.\n\n{self.table()}", s.name, s.total, avail)


class MemoryRefused(ValueError):
    """A stage the plan says cannot fit in this machine's memory; refused before anything is built."""

    def __init__(self, message: str, stage: str, predicted: int, available: int):
        super().__init__(message)
        self.stage, self.predicted, self.available = stage, predicted, available

    def __reduce__(self):
        return (MemoryRefused, (str(self), self.stage, self.predicted, self.available))

    def tags(self) -> dict[str, str]:
        from flows.stage_process import TAG_FAILED_STAGE

        return {TAG_FAILED_STAGE: self.stage, "quantgate.memory_plan_bytes": str(self.predicted),
                "quantgate.memory_available_bytes": str(self.available)}


def gb(n: int | float) -> str:
    return f"{n / 1e9:.2f}"


def weight_method(name: str) -> str:
    """A release method or recipe (KV suffix allowed) -> the method whose layout it is served in."""
    from flows.recipes import parse

    weights, _ = split_variant(name)
    if weights == "baseline":
        return "baseline"
    method = parse(weights).method
    return "int4wo" if method in CALIBRATED else method


def served_bytes(shape: ModelShape, method: str, serving_dtype: str) -> int:
    return estimate_weight_bytes(shape, method, DTYPE_BYTES[serving_dtype])


def activation_bytes(shape: ModelShape, tokens: int, logit_rows: int, dtype_bytes: int) -> int:
    """One engine step: the hidden states, q/k/v and the MLP's gate and up of `tokens` tokens in the serving
    dtype, and `logit_rows` rows of logits in dtype, LOGSOFTMAX_ROWS of them at a time as fp32 and log-softmaxed."""
    q, kv = shape.num_heads * shape.head_dim, shape.num_kv_heads * shape.head_dim
    per_token = (3 * shape.hidden_size + q + 2 * kv + 3 * shape.intermediate_size) * dtype_bytes
    logits = logit_rows * dtype_bytes + min(logit_rows, LOGSOFTMAX_ROWS) * 8
    return tokens * per_token + logits * shape.vocab_size


def load_bytes(shape: ModelShape, method: str, inputs: Inputs) -> int:
    """A model's transient while it loads (before its first step): an int4 layout repacks each tensor for the
    kernel (its codes unpacked to bytes and int32: ~5 bytes per parameter of the largest); a baseline's linears
    are packed one at a time, each copy beside its source (the largest's, at the serving width). A source stored
    wider is read through the page cache (file pages, not anonymous): measured, Qwen2.5-Coder-1.5B's fp32 source
    loads as a bf16 engine at 4.64 GB anonymous, weights 3.55 + KV 0.54 GB (docs/results/2026-12-06-release-memory.md)."""
    largest = max([o * i for o, i in shape.layer_linears()] + [shape.vocab_size * shape.hidden_size])
    if method == "int4wo":
        return 5 * largest
    if method == "baseline":
        return largest * DTYPE_BYTES[inputs.serving_dtype]
    return 0


def build_bytes(shape: ModelShape, method: str, inputs: Inputs) -> tuple[int, int]:
    """The quantize stage's (working set, calibration activations)."""
    base = split_variant(method)[0]
    from flows.recipes import parse

    algo = parse(base).method
    if not inputs.streamable or algo not in ("int8wo", "int4wo", "w8a8", *CALIBRATED):
        return IN_MEMORY_BYTES_PER_PARAM * shape.num_params(), 0
    b = DTYPE_BYTES[inputs.build_dtype]
    largest = max([o * i for o, i in shape.layer_linears()] + [shape.vocab_size * shape.hidden_size])
    block = min(largest * 4 * 4, STREAM_BLOCK_BYTES)
    scales = 4 * largest // 32  # the largest tensor's scales (int4's groups of 32; int8's rows are fewer)
    if algo not in (*CALIBRATED, "w8a8"):
        return block + scales, 0
    layer_params = sum(o * i for o, i in shape.layer_linears())
    layer = layer_params * b
    t, widest = inputs.calibration_tokens, max(i for _, i in shape.layer_linears())
    acts = t * (2 * shape.hidden_size + widest) * b
    if algo == "w8a8":  # the layer, its codes twice (as saved, and the probe's packed quads), the widest set's search
        widest_set = max(2 * shape.intermediate_size * shape.hidden_size, sum(o for o, _ in shape.layer_linears()[:3])
                         * shape.hidden_size)
        return layer_params * (b + 2) + W8A8_SEARCH_BYTES * widest_set + block + scales, acts
    if algo == "int4-awq":  # its head is round-to-nearest from row blocks: only the layer's copies count
        return AWQ_LAYER_COPIES * layer + block + scales, acts
    hessian = widest * widest * 4 if algo == "int4-gptq" else 0
    head = shape.vocab_size * shape.hidden_size * b + (shape.hidden_size ** 2 * 4 if algo == "int4-gptq" else 0)
    return max(2 * layer + hessian, head) + block + scales, acts


def plan(inputs: Inputs, machine: Machine) -> MemoryPlan:
    """Every stage's peak (see the module's docstring) and the capacity budget the measure stage uses."""
    shape = ModelShape.from_config(inputs.config)
    db = DTYPE_BYTES[inputs.serving_dtype]
    served = {"baseline": served_bytes(shape, "baseline", inputs.serving_dtype)}
    for m in inputs.methods:  # baseline+kv8 is the baseline's weights
        served[m] = served_bytes(shape, weight_method(m), inputs.serving_dtype)
    stages = []
    for m in dict.fromkeys(split_variant(m)[0] for m in inputs.methods):
        if m != "baseline":
            work, acts = build_bytes(shape, m, inputs)
            stages.append(Stage(f"quantize {m}", (m,), work, 0, acts, RUNTIME_BYTES + CHILD_RUNTIME_BYTES))
    eval_acts = activation_bytes(shape, ENGINE_TOKENS, LOGIT_ROWS, db)
    loads = {m: load_bytes(shape, "baseline" if m == "baseline" else weight_method(m), inputs) for m in served}
    for name, w in served.items():  # a step's activations come after the load's transient is gone
        stages.append(Stage(f"measure {name}", (name,), w, inputs.measure_kv_bytes, max(eval_acts, loads[name]),
                            RUNTIME_BYTES + EVAL_BYTES + ENGINE_BYTES))
    largest = max(inputs.methods, key=served.get, default=None)
    kv_token = shape.kv_bytes_per_token(db)
    if largest is not None:
        pair, weights = ("baseline", largest), served["baseline"] + served[largest]
        step = activation_bytes(shape, ENGINE_TOKENS // 4, 16, db)
        # the baseline loads first, alone: its transient is held beside its own weights, not the variant's
        acts = max(step, loads[largest], loads["baseline"] - served[largest])
        # no EVAL_BYTES: what the evals leave is handed back between stages now (quantgate.allocator); measured
        # (2026-12-06) 3.43 GB at 0.5B and 7.09 GB at 1.5B against 3.31 and 6.89 GB planned so
        stages.append(Stage("speed", pair, weights, 2 * inputs.speed_kv_tokens * kv_token, acts,
                            RUNTIME_BYTES + 2 * ENGINE_BYTES))
        stages.append(Stage("canary", ("champion (baseline)", f"challenger ({largest})"), weights,
                            2 * inputs.canary_kv_bytes, max(2 * step, acts), RUNTIME_BYTES + 2 * ENGINE_BYTES))
    budget = max(2.0, float(math.ceil(served["baseline"] / GIB + CAPACITY_HEADROOM_GB)))
    return MemoryPlan(stages, machine, served, inputs.serving_dtype, budget)


# ---- this machine and this source (read, never loaded) ----------------------------------------------


def _cgroup_room() -> tuple[int, str] | None:
    """What the cgroup's memory.max leaves (v2, else v1), when one is set."""
    for limit, usage in (("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory.current"),
                         ("/sys/fs/cgroup/memory/memory.limit_in_bytes", "/sys/fs/cgroup/memory/memory.usage_in_bytes")):
        try:
            text = Path(limit).read_text().strip()
            if text == "max" or int(text) >= 1 << 60:
                return None
            return int(text) - int(Path(usage).read_text().strip()), f"cgroup {limit} {gb(int(text))} GB"
        except (OSError, ValueError):
            continue
    return None


def _own_rss() -> int:
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def available_memory() -> Machine:
    """MemAvailable (/proc/meminfo), the cgroup's room if that is less, plus this process's own resident
    memory (the plan's runtime counts it already)."""
    from quantize.capacity import device_free_bytes

    avail, source = device_free_bytes("cpu"), "MemAvailable, /proc/meminfo"
    room = _cgroup_room()
    if room is not None and room[0] < avail:
        avail, source = room[0], room[1]
    own = _own_rss()
    return Machine(avail + own, f"{source}, + {gb(own)} GB this process holds")


def source_dtype(path: Path) -> tuple[str | None, int]:
    """The dtype most of the source's safetensors bytes are stored in, and their total (None, 0: none)."""
    from serving.model.quant.integrity import weight_bytes

    total, by_dtype = weight_bytes(Path(path))
    names = {"BF16": "bfloat16", "F16": "float16", "F32": "float32"}
    if not total:
        return None, 0
    return names.get(max(by_dtype, key=by_dtype.get), "float32"), total


def inputs_for(source: str | Path, methods: list[str], config, policy, serving_dtype: str) -> Inputs:
    """The plan's inputs for a release of `source` (an HF directory) with the flow's MeasureConfig and policy."""
    import json

    from flows.data import SpeedPlan
    from flows.speed_rounds import BLOCK_SIZE, kv_blocks

    stored, _ = source_dtype(Path(source))
    return Inputs(config=json.loads((Path(source) / "config.json").read_text()), methods=tuple(methods),
                  serving_dtype=serving_dtype, stored_dtype=stored or "float32", streamable=stored is not None,
                  measure_kv_bytes=int(config.kv_cache_memory_gb * GIB),
                  speed_kv_tokens=kv_blocks(SpeedPlan.from_policy(policy, config.device)) * BLOCK_SIZE)


def serving_dtype(device: str) -> str:
    """The engine's dtype for `device` on this machine (serving/model/device.py)."""
    from flows.machine import engine_placement
    from serving.model.device import resolve_dtype

    return str(resolve_dtype(None, engine_placement(device)["device"])).removeprefix("torch.")


def for_release(source: str | Path, methods: list[str], config, policy) -> MemoryPlan:
    """The plan the release flow runs first (and `quantgate release --plan` prints); a source whose shapes cannot
    be read (not a Llama-style decoder config) gets no plan, said so, and is refused nothing. A CUDA release's
    served stages fit in the GPU's free memory (its runtime still counted: conservative)."""
    from dataclasses import replace

    from flows.machine import engine_placement

    machine, placed = available_memory(), engine_placement(config.device)["device"]
    if placed.startswith("cuda"):
        from quantize.capacity import device_free_bytes

        machine = replace(machine, device_bytes=device_free_bytes(placed))
    try:
        return plan(inputs_for(source, methods, config, policy, serving_dtype(config.device)), machine)
    except (ValueError, KeyError, OSError) as exc:
        from flows.progress import note

        note(f"memory plan: none for {source} ({exc}); no stage is refused up front")
        return MemoryPlan([], machine, capacity_budget_gb=config.capacity_budget_gb, not_planned=str(exc))


def plan_for(model: str, methods: list[str], policy, device: str | None = None) -> MemoryPlan:
    """`quantgate release --plan`'s: the release's plan for a model reference, with the MeasureConfig the release
    builds from the policy, so --plan prints what the flow checks."""
    from dataclasses import replace

    from flows.fidelity_stage import measure_config
    from flows.machine import resolve_device
    from quantgate.models import resolve_model

    config = replace(measure_config(policy, methods, None, None), device=resolve_device(device))
    return for_release(resolve_model(model), methods, config, policy)
