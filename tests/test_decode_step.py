"""The decode step as one compiled call (serving/model/decode_step.py, serving/kernels/cpu/decode_step.cpp): the
same tokens and the same logprobs, bit for bit, as the Python loop over the same ops, on every kernel path
this CPU runs; taken only for decode-only steps over a cache in the model's dtype."""

from __future__ import annotations

import pytest

import quantize
from serving import LLMEngine, SamplingParams
from serving.kernels.cpu import decoder_ops
from serving.kernels.cpu import isa as isas
from serving.model.decode_step import DecodeStep

PATHS = [i for i in isas.supported() if i != "torch"]
pytestmark = pytest.mark.skipif(decoder_ops.decode_plan_class() is None, reason="no C++ compiler for the kernels")


class Counting:
    """The engine's DecodeStep, counting the steps it serves."""

    def __init__(self, step: DecodeStep):
        self.step, self.calls = step, 0

    def serves(self, ctx, tokens: int) -> bool:
        return self.step.serves(ctx, tokens)

    def __call__(self, *args):
        self.calls += 1
        return self.step(*args)


def _engine(model_dir, isa: str, **kwargs) -> LLMEngine:
    kwargs = {"max_num_seqs": 4, "block_size": 4, "num_kv_blocks": 64, "enable_prefix_caching": False, **kwargs}
    return LLMEngine.from_pretrained(str(model_dir), device="cpu", isa=isa, **kwargs)


def _generate(engine: LLMEngine):
    prompts = [[100 + (7 * i + 13 * j) % 3000 for j in range(3 + 5 * i)] for i in range(3)]
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, logprobs=2)
    outs = engine.generate(prompts, params)
    return [o.token_ids for o in outs], [[(lp.logprob, lp.top) for lp in o.logprobs] for o in outs]


# fp32 weights stay torch's nn.Linear, called as aten::linear; int4wo leaves k_proj here (too narrow for int4)
VARIANTS = [("baseline", "float32"), ("baseline", "bfloat16"), ("int8wo", "float32"), ("int8wo", "bfloat16"),
            ("int4wo", "float32"), ("int4wo", "bfloat16"), ("w8a8", "float32"), ("w8a8", "bfloat16")]


@pytest.mark.parametrize("isa", PATHS)
@pytest.mark.parametrize("variant,dtype", VARIANTS, ids=[f"{v}-{d}" for v, d in VARIANTS])
def test_the_plan_decodes_bit_for_bit_as_the_python_loop(tiny_model_dir, isa, variant, dtype):
    model_dir = tiny_model_dir if variant == "baseline" else quantize.quantize(str(tiny_model_dir), variant)
    engine = _engine(model_dir, isa, dtype=dtype)
    forward = engine.runner.fast_forward
    assert forward is not None and forward.step is not None, "every projection here is a compiled call"
    counting = Counting(forward.step)
    forward.step = counting
    with_plan = _generate(engine)
    assert counting.calls >= 10  # the decode steps of three sequences
    forward.step = None
    assert _generate(engine) == with_plan


def test_steps_with_prefill_rows_or_an_8bit_cache_keep_the_python_loop(tiny_model_dir):
    engine = _engine(quantize.quantize(str(tiny_model_dir), "int8wo"), PATHS[0], kv_cache_dtype="int8")
    forward = engine.runner.fast_forward
    assert forward.step is not None
    counting = Counting(forward.step)
    forward.step = counting
    _generate(engine)
    assert counting.calls == 0

    engine = _engine(tiny_model_dir, PATHS[0], dtype="bfloat16")
    forward = engine.runner.fast_forward
    assert forward.step is not None
    counting = Counting(forward.step)
    forward.step = counting
    engine.generate([[5, 6, 7]], SamplingParams(max_tokens=1, temperature=0, ignore_eos=True))
    assert counting.calls == 0  # one token: the prefill step produced it


def test_no_plan_where_a_projection_is_not_a_compiled_call_or_when_switched_off(tiny_model_dir, monkeypatch):
    engine = _engine(tiny_model_dir, "torch")
    assert engine.runner.fast_forward is None or engine.runner.fast_forward.step is None
    engine = _engine(tiny_model_dir, PATHS[0], dtype="float16")  # a half-precision nn.Linear: not a kernel call
    assert engine.runner.fast_forward is None or engine.runner.fast_forward.step is None
    monkeypatch.setenv("QUANTGATE_DECODE_STEP", "0")
    engine = _engine(tiny_model_dir, PATHS[0], dtype="bfloat16")
    assert engine.runner.fast_forward.step is None


def test_the_benchmark_pairs_plan_and_python_rounds(tiny_model_dir, tmp_path):
    from benchmarks import decode_step as bench

    report = bench.main(["--model", str(tiny_model_dir), "--variants", "baseline", "--dtype", "bfloat16",
                         "--batches", "1,2", "--rounds", "2", "--tokens", "4", "--out-dir", str(tmp_path)])
    row = report["rows"][0]
    assert row["plan"] and row["b1"]["rounds"] == 2 and row["b2"]["ci_low"] <= row["b2"]["speedup"]
    assert 0 < row["b1"]["plan_bandwidth_share"] and (tmp_path / "decode_step.json").is_file()
