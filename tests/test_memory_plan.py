"""The release's memory plan (issue 45, flows/memory_plan.py): each stage's peak from config.json and the
safetensors headers alone, a stage that cannot fit refused by the flow before anything is built, and a KV
capacity that cannot be measured said so instead of a silent 0."""

from __future__ import annotations

import pytest

from flows import memory_plan as P
from quantize.capacity import ModelShape

GB = 10**9
# Llama-3-8B's shape (bf16, untied head): 8.03B parameters
LLAMA_8B = {"model_type": "llama", "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32,
            "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128, "vocab_size": 128256,
            "max_position_embeddings": 8192, "tie_word_embeddings": False, "torch_dtype": "bfloat16"}


def _stage(plan: P.MemoryPlan, name: str) -> P.Stage:
    return next(s for s in plan.stages if s.name == name)


def test_an_8b_shaped_release_on_24_gb_refuses_the_speed_pair():
    plan = P.plan(P.Inputs(LLAMA_8B, ("int8wo", "int4wo"), serving_dtype="bfloat16"), P.Machine(24 * GB, "pretend"))
    params = ModelShape.from_config(LLAMA_8B).num_params()
    assert 8.02e9 < params < 8.04e9
    assert plan.served["baseline"] == pytest.approx(2 * params, rel=1e-6)  # 16.06 GB at bf16
    assert 8.0 * GB < plan.served["int8wo"] < 8.6 * GB  # a byte per parameter + fp32 row scales
    assert 4.5 * GB < plan.served["int4wo"] < 5.3 * GB  # half a byte + a bf16 scale and zero per 32
    speed = _stage(plan, "speed")
    assert speed.models == ("baseline", "int8wo")  # the largest variant beside the baseline
    assert speed.weights == plan.served["baseline"] + plan.served["int8wo"] > 24 * GB
    assert speed.total > 24 * GB and speed.runtime == P.RUNTIME_BYTES + 2 * P.ENGINE_BYTES
    assert [s.name for s in plan.unfit()] == ["speed", "canary"]
    assert _stage(plan, "measure baseline").total < 24 * GB  # one model at a time fits
    assert _stage(plan, "quantize int8wo").total < 3 * GB  # streamed: a row block, not the model
    with pytest.raises(P.MemoryRefused) as caught:
        plan.check()
    refused = caught.value
    assert (refused.stage, refused.predicted, refused.available) == ("speed", speed.total, 24 * GB)
    text = str(refused)
    assert "'speed'" in text and f"{speed.total:,} bytes" in text and "24,000,000,000 bytes" in text
    assert "--methods without int8wo" in text and "KV budget" in text and "more memory" in text
    assert "QUANTGATE_DTYPE=bfloat16" not in text  # already bf16: not a way out
    assert "| speed | baseline + int8wo |" in text and "**no**" in text  # the table comes with it
    assert plan.capacity_budget_gb == 16.0  # the baseline as served (14.96 GiB) + 1 GiB of KV, whole GiB


def test_an_fp32_engine_doubles_the_baseline_and_names_bfloat16_as_a_way_out():
    plan = P.plan(P.Inputs(LLAMA_8B, ("int4wo",), serving_dtype="float32"), P.Machine(24 * GB, "pretend"))
    assert plan.served["baseline"] == pytest.approx(4 * ModelShape.from_config(LLAMA_8B).num_params(), rel=1e-6)
    with pytest.raises(P.MemoryRefused, match="measure baseline") as caught:
        plan.check()
    assert "QUANTGATE_DTYPE=bfloat16" in str(caught.value)
    assert "fewer methods" not in str(caught.value).split("\n")[0]  # the baseline alone: methods do not help


def test_a_cuda_release_serves_in_the_gpu_memory_and_quantizes_in_the_host():
    inputs = P.Inputs(LLAMA_8B, ("int8wo", "int4wo"))
    on_gpu = P.plan(inputs, P.Machine(24 * GB, "host", device_bytes=80 * GB))
    assert on_gpu.unfit() == [] and "GPU's free memory 80.00 GB" in on_gpu.table()
    small_gpu = P.plan(inputs, P.Machine(200 * GB, "host", device_bytes=12 * GB))
    assert [s.name for s in small_gpu.unfit()] == ["measure baseline", "speed", "canary"]
    with pytest.raises(P.MemoryRefused, match="12,000,000,000 bytes"):
        small_gpu.check()


def test_the_calibrated_build_holds_a_layer_and_gptq_its_hessian():
    inputs = P.Inputs(LLAMA_8B, ("int4-awq", "int4-gptq"))
    plan = P.plan(inputs, P.Machine(64 * GB, "pretend"))
    awq, gptq = _stage(plan, "quantize int4-awq"), _stage(plan, "quantize int4-gptq")
    layer_fp32 = 4 * sum(o * i for o, i in ModelShape.from_config(LLAMA_8B).layer_linears())  # 0.87 GB
    assert awq.weights >= P.AWQ_LAYER_COPIES * layer_fp32 and awq.activations == 2048 * (2 * 4096 + 14336) * 4
    assert awq.weights < P.AWQ_LAYER_COPIES * layer_fp32 + P.STREAM_BLOCK_BYTES + 128256 * 4096  # no fp32 head
    assert gptq.weights >= 2 * layer_fp32 + 14336**2 * 4  # + the down projection's Hessian
    assert gptq.weights >= 128256 * 4096 * 4  # GPTQ's head from its Hessian: its fp32 rows (2.1 GB)
    assert plan.served["int4-awq"] == plan.served["int4-gptq"]  # served in int4wo's layout
    in_memory = P.plan(P.Inputs(LLAMA_8B, ("int8wo",), streamable=False), P.Machine(64 * GB, "pretend"))
    assert _stage(in_memory, "quantize int8wo").weights == 12 * ModelShape.from_config(LLAMA_8B).num_params()


def test_a_streamed_w8a8_build_holds_a_layer_and_fits_an_8b_where_in_memory_cannot():
    shape = ModelShape.from_config(LLAMA_8B)
    layer_params = sum(o * i for o, i in shape.layer_linears())
    plan = P.plan(P.Inputs(LLAMA_8B, ("w8a8",)), P.Machine(24 * GB, "pretend"))
    w8a8 = _stage(plan, "quantize w8a8")
    gate_up = 2 * 14336 * 4096
    assert w8a8.weights >= 6 * layer_params + P.W8A8_SEARCH_BYTES * gate_up  # fp32 layer, codes twice, the search
    assert w8a8.weights < 4 * GB and w8a8.total < 24 * GB
    in_memory = P.plan(P.Inputs(LLAMA_8B, ("w8a8",), streamable=False), P.Machine(24 * GB, "pretend"))
    assert _stage(in_memory, "quantize w8a8").weights == 12 * shape.num_params()
    assert "quantize w8a8" in [s.name for s in in_memory.unfit()]


def test_predicted_weights_match_the_safetensors_bytes(tiny_model_dir, default_model_dir):
    import json

    for path in (tiny_model_dir, default_model_dir):
        stored, actual = P.source_dtype(path)
        shape = ModelShape.from_config(json.loads((path / "config.json").read_text()))
        assert P.served_bytes(shape, "baseline", stored) == pytest.approx(actual, rel=0.05)


def test_the_default_model_fits_with_its_default_budget(default_model_dir):
    import json

    config = json.loads((default_model_dir / "config.json").read_text())
    plan = P.plan(P.Inputs(config, ("int8wo", "int4-awq")), P.Machine(24 * GB, "pretend"))
    assert plan.unfit() == [] and plan.check() is None
    assert plan.served["baseline"] == pytest.approx(269e6, rel=0.01)  # 256.6 MiB as served (docs/results)
    assert plan.served["int8wo"] == pytest.approx(129.5 * 2**20, rel=0.03)
    assert plan.served["int4-awq"] == pytest.approx(80.2 * 2**20, rel=0.03)
    assert all(s.total < 3.5 * GB for s in plan.stages)
    assert plan.capacity_budget_gb == 2.0  # unchanged: the demo's measurement keys stay


def test_a_config_without_the_shapes_gets_no_plan_and_refuses_nothing(tmp_path, default_model_dir):
    import json

    from flows.data import MeasureConfig
    from gates.judging.policy import load_policy

    config = json.loads((default_model_dir / "config.json").read_text())
    del config["intermediate_size"]
    (tmp_path / "config.json").write_text(json.dumps(config))
    plan = P.for_release(tmp_path, ["int8wo"], MeasureConfig(), load_policy(None))
    assert plan.stages == [] and "intermediate_size" in plan.not_planned and plan.check() is None
    assert "not planned" in plan.table() and plan.capacity_budget_gb == MeasureConfig().capacity_budget_gb


def test_available_memory_reads_meminfo():
    machine = P.available_memory()
    assert machine.available_bytes > 0 and ("MemAvailable" in machine.source or "cgroup" in machine.source)


# ---- capacity: never a silent 0 ----------------------------------------------------------------------


def test_weights_over_the_capacity_budget_are_recorded_as_unmeasured(tiny_model_dir):
    from flows import measuring
    from flows.data import MeasureConfig, Variant
    from gates import metric_names as M

    variant = Variant("baseline", None, str(tiny_model_dir), "x")
    config = MeasureConfig(capacity_budget_gb=0.001)
    over = measuring.capacity(variant, 2 * 2**20, config, 2, "auto", 16)
    assert M.CAPACITY_MAX_SEQS not in over and over[measuring.CAPACITY_UNMEASURED] > 2 * 2**20 - 0.001 * 2**30
    fits = measuring.capacity(variant, 2**20, MeasureConfig(), 2, "auto", 16)
    assert fits[M.CAPACITY_MAX_SEQS] > 0 and measuring.CAPACITY_UNMEASURED not in fits
    assert measuring.capacity_gain(fits, over) == {measuring.CAPACITY_UNMEASURED: over[measuring.CAPACITY_UNMEASURED]}
    assert measuring.capacity_gain(fits, fits) == {M.CAPACITY_GAIN: 1.0}


# ---- the release flow refuses before quantizing ------------------------------------------------------


@pytest.fixture(scope="module")
def prefect_api():
    from prefect.testing.utilities import prefect_test_harness

    with prefect_test_harness(server_startup_timeout=120):
        yield


def test_the_release_refuses_a_stage_that_cannot_fit_before_building(prefect_api, store, tiny_model_dir,
                                                                     monkeypatch):
    from flows.release import model_name, release_flow
    from flows.stage_process import TAG_FAILED_STAGE
    from gates.records.orphans import TAG_FAILURE
    from gates.records.tracking import experiment_name, get_client
    from quantize.variant import variants_root

    monkeypatch.setattr(P, "available_memory", lambda: P.Machine(10**6, "a pretend 1 MB machine"))
    with pytest.raises(P.MemoryRefused, match="stage 'quantize int8wo'") as caught:
        release_flow(model=str(tiny_model_dir), methods=["int8wo"], limit=2, suites=["facts_mc"], approve="auto",
                     fresh=True)
    assert caught.value.available == 10**6 and caught.value.predicted > P.RUNTIME_BYTES
    assert "1,000,000 bytes" in str(caught.value) and "fewer methods" in str(caught.value)
    root = variants_root()
    assert not root.exists() or [p.name for p in root.iterdir() if p.is_dir()] == []  # no variant was built
    # (the source hashes' memo, .source-hashes.json, is resolve-source's)
    client = get_client()
    experiment = client.get_experiment_by_name(experiment_name(model_name(str(tiny_model_dir), tiny_model_dir)))
    (run,) = client.search_runs([experiment.experiment_id], filter_string="tags.`quantgate.kind` = 'release'")
    assert run.info.status == "FAILED"
    assert run.data.tags[TAG_FAILED_STAGE] == "quantize int8wo" and "refused" in run.data.tags[TAG_FAILURE]
    assert [m.name for m in client.search_registered_models() if m.aliases] == []  # no alias moved


def test_eval_logits_are_counted_as_the_engine_holds_them():
    from serving.model.model_runner import LOGSOFTMAX_ROWS

    assert P.LOGSOFTMAX_ROWS == LOGSOFTMAX_ROWS
    shape = ModelShape(hidden_size=896, intermediate_size=4864, num_layers=24, num_heads=14, num_kv_heads=2,
                       head_dim=64, vocab_size=151936, tie_word_embeddings=True)
    base = P.activation_bytes(shape, 2048, 0, 2)
    # every row of a full step in bf16, 256 of them at a time as fp32 logits and log-probs
    assert P.activation_bytes(shape, 2048, 2048, 2) - base == (2048 * 2 + 256 * 8) * 151936
    assert P.activation_bytes(shape, 2048, 16, 2) - base == 16 * 10 * 151936


def test_the_speed_stage_holds_the_baseline_load_transient_beside_its_own_weights_only():
    bf16 = dict(LLAMA_8B)  # an fp32 source served in bf16: the baseline loads first, while it is the only engine
    shape = ModelShape.from_config(LLAMA_8B)
    wide = P.plan(P.Inputs(bf16, ("int8wo",), stored_dtype="float32"), P.Machine(64 * GB, "pretend"))
    speed, load = _stage(wide, "speed"), P.load_bytes(shape, "baseline", P.Inputs(bf16, (), stored_dtype="float32"))
    step = P.activation_bytes(shape, P.ENGINE_TOKENS // 4, 16, 2)
    assert speed.activations == max(step, load - wide.served["int8wo"])
