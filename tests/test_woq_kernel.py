"""quantgate's weight-only int8/int4 CPU kernel (serving/kernels/cpu/wo_bf16) against plain torch references, on
each of its builds this CPU runs (`amx`, `avx512bf16`): every
row-block and channel-block tail, both output dtypes, both paths of each format (x rounded to int16 and
exact integer sums for few rows, a bf16 panel for many), the layouts' round trips, clear errors, the off
switch, and a batched engine run of an int8wo variant token-identical to HF generate one prompt at a time."""

from __future__ import annotations

import pytest
import torch

from quantgate import settings
from serving.kernels.cpu import isa as isas
from serving.kernels.cpu import wo_bf16
from serving.model.quant.int4 import Int4WeightOnlyLinear, dequantize_rows, quantize_groups, unpack_nibbles
from serving.model.quant.int8 import Int8WeightOnlyLinear, quantize_per_channel

PATHS = [p for p in isas.BF16_PATHS if p in isas.supported()]
pytestmark = pytest.mark.skipif(not PATHS, reason="the kernel needs AVX-512-BF16")

SHAPES = [(48, 64), (160, 64), (16, 32), (192, 576), (576, 1536)]  # N: 1, 3 + 1/3, 1/3 panels; real shapes
ROWS = [1, 2, 3, 5, 7, 8, 9, 17, 23, 24, 33, 47, 48, 70]  # every register-block tail, both sides of each switch


def panel_rows(int4: bool, k: int = 576) -> int:
    """From here the bf16 panel paths: 24 rows for int8 and 8 for int4 where AMX takes the call or on AMD,
    never on Intel without AMX."""
    return wo_bf16.panel_rows_from(int4, k) if wo_bf16.available() else 0


def exact_rows(k: int = 576) -> int:
    """Below here int4 multiplies the exact weight (int16 rows; without AMX the raw codes' panel too), from
    here the weight rounded once to bf16."""
    return wo_bf16.int4_exact_rows_below(k) if wo_bf16.available() else 0


def int16_rows(x: torch.Tensor) -> torch.Tensor:
    """x as the few-row paths see it: each row rounded to int16 steps of absmax / 32767."""
    xf = x.float()
    absmax = xf.abs().amax(1, keepdim=True)
    steps = torch.round(xf * (32767.0 / absmax)).clamp(-32767, 32767)
    return torch.where(absmax > 0, steps * (absmax / 32767.0), xf)


def assert_close(out: torch.Tensor, reference: torch.Tensor, tolerance: float, what: str) -> None:
    assert (out - reference).abs().max() <= tolerance * reference.abs().max(), what


def test_the_kernel_builds_here():
    assert wo_bf16.available()


@pytest.fixture(autouse=True, params=PATHS or ["none"])
def path(request):
    """Every test runs on each build of the kernel this CPU runs (calls without an explicit isa take it)."""
    with isas.using(request.param):
        if "monkeypatch" not in request.fixturenames:  # the off-switch test loads it under its own env
            assert wo_bf16.available()
        yield request.param


@pytest.mark.parametrize(("n", "k"), SHAPES)
def test_int8_matches_the_scaled_integer_matmul(n, k):
    torch.manual_seed(n + k)
    q, scales = quantize_per_channel(torch.randn(n, k))
    packed = wo_bf16.pack_int8(q)
    assert torch.equal(wo_bf16.unpack_int8(packed), q)
    quads = packed.shape[3] == 4  # AMX-INT8 (and VPDPBUSD for 1-2 rows): int16 rows at every row count
    assert quads == (isas.resolve() == "amx" and k % 64 == 0)
    for rows in ROWS:
        x = torch.randn(rows, k).bfloat16()
        reference = (x.float() @ q.float().t()) * scales
        out = wo_bf16.int8_linear(x, packed, scales, torch.float32)
        assert out.shape == (rows, n) and out.dtype == torch.float32
        if rows < panel_rows(False, k) or quads:  # exact sums of x rounded to int16; that rounding costs < 1e-4
            assert_close(out, (int16_rows(x) @ q.float().t()) * scales, 3e-5, f"{rows} rows")
            assert_close(out, reference, 1e-4, f"{rows} rows")
        else:
            assert_close(out, reference, 1e-5, f"{rows} rows")
        out_bf16 = wo_bf16.int8_linear(x, packed, scales, torch.bfloat16)
        assert torch.equal(out_bf16, out.bfloat16())


@pytest.mark.parametrize(("n", "k"), SHAPES)
def test_int4_gives_exact_group_sums_for_few_rows_and_a_bf16_panel_for_many(n, k):
    torch.manual_seed(n * k)
    codes, sz = quantize_groups(torch.randn(n, k), 32)
    q = unpack_nibbles(codes)
    packed = wo_bf16.pack_int4(q)
    assert torch.equal(wo_bf16.unpack_int4(packed, n, k), q)
    exact = dequantize_rows(codes, sz, 32, torch.float32)  # (q - 8) * scale + zero in fp32
    rounded = exact.bfloat16().float()  # the panel's weight: rounded once to bf16
    for rows in ROWS:
        x = torch.randn(rows, k).bfloat16()
        out = wo_bf16.int4_linear(x, packed, sz, 32, n, torch.float32)
        if rows < panel_rows(True, k):  # exact group sums of x rounded to int16, the weight never rounded
            assert_close(out, int16_rows(x) @ exact.t(), 3e-5, f"{rows} rows")
            assert_close(out, x.float() @ exact.t(), 1e-4, f"{rows} rows")
        elif rows < exact_rows(k):  # the raw codes' panel: exact products, scaled per group
            assert_close(out, x.float() @ exact.t(), 1e-5, f"{rows} rows")
        else:
            assert_close(out, x.float() @ rounded.t(), 1e-5, f"{rows} rows")
        assert torch.equal(wo_bf16.int4_linear(x, packed, sz, 32, n, torch.bfloat16), out.bfloat16())


@pytest.mark.parametrize("rows", [7, 23, 40])
def test_each_row_is_computed_alone(rows):
    """Within a path a row's result does not depend on the rows beside it; the path follows the row count
    (where the int16 paths take every call, a row comes out the same at every batch size)."""
    torch.manual_seed(0)
    q, scales = quantize_per_channel(torch.randn(192, 576))
    codes, sz = quantize_groups(torch.randn(192, 576), 32)
    int8, int4 = wo_bf16.pack_int8(q), wo_bf16.pack_int4(unpack_nibbles(codes))
    x = torch.randn(rows, 576).bfloat16()
    together8 = wo_bf16.int8_linear(x, int8, scales, torch.float32)
    together4 = wo_bf16.int4_linear(x, int4, sz, 32, 192, torch.float32)
    for row in (0, rows // 2, rows - 1):
        alone = x[row:row + 1].contiguous()
        if rows < panel_rows(int4=False):
            assert torch.equal(wo_bf16.int8_linear(alone, int8, scales, torch.float32)[0], together8[row])
        if rows < panel_rows(int4=True):
            assert torch.equal(wo_bf16.int4_linear(alone, int4, sz, 32, 192, torch.float32)[0], together4[row])
        many = x[row:row + 1].expand(rows, -1).contiguous()  # the same row beside copies of itself
        assert torch.equal(wo_bf16.int8_linear(many, int8, scales, torch.float32)[rows - 1], together8[row])
        assert torch.equal(wo_bf16.int4_linear(many, int4, sz, 32, 192, torch.float32)[rows - 1], together4[row])


@pytest.mark.parametrize("rows", [1, 5, 16, 17, 40])
def test_amx_tiles_give_the_dpbf16_paths_results_to_rounding(rows, path):
    """Where the CPU has AMX the panel paths (every bf16 call, int4 from 8 rows) multiply on its tiles, the
    last rows zero-padded to 16: the dpbf16 paths' sums in another order, each row's its own (a bf16 row
    comes out the same at every batch size); int8, packed in quads, sums int16 rows exactly on AMX-INT8
    (VPDPBUSD for 1-2 rows), the same to the bit at every batch size."""
    if path != "amx":
        pytest.skip("the amx build against the avx512bf16 build")
    torch.manual_seed(rows)
    n, k = 192, 576
    weight = torch.randn(n, k)
    pairs = wo_bf16.pack_bf16(weight.bfloat16())
    q, scales = quantize_per_channel(weight)
    int8, int8_pairs = wo_bf16.pack_int8(q), wo_bf16.pack_int8(q, 2)
    assert int8.shape[3] == 4  # int8 is packed in quads for AMX-INT8 here
    codes, sz = quantize_groups(weight, 32)
    int4 = wo_bf16.pack_int4(unpack_nibbles(codes))
    calls = {
        "bf16": (lambda x: wo_bf16.bf16_linear(x, pairs, torch.float32),
                 lambda x: wo_bf16.bf16_linear(x, pairs, torch.float32, "avx512bf16")),
        "int8": (lambda x: wo_bf16.int8_linear(x, int8, scales, torch.float32),
                 lambda x: wo_bf16.int8_linear(x, int8_pairs, scales, torch.float32, "avx512bf16")),
        "int4": (lambda x: wo_bf16.int4_linear(x, int4, sz, 32, n, torch.float32),
                 lambda x: wo_bf16.int4_linear(x, int4, sz, 32, n, torch.float32, "avx512bf16")),
    }
    x = torch.randn(rows, k).bfloat16()
    for name, (call, pairs_call) in calls.items():
        tiles, dpbf16 = call(x), pairs_call(x)
        # without AMX int8 and int4 take int16 rows (every call on Intel): x's int16 rounding, < 1e-4; int4's
        # AMX panel (from 8 rows) holds the weight rounded to bf16 where the int16 rows keep it exact
        tolerance = 1e-5 if name == "bf16" else 4e-3 if name == "int4" and rows >= panel_rows(True, k) else 1e-4
        assert_close(tiles, dpbf16, tolerance, name)
        many = x[-1:].expand(rows, -1).contiguous()  # the last (zero-padded) row beside copies of itself
        assert torch.equal(call(many)[0], tiles[-1]), name
    for name in ("bf16", "int8"):
        call = calls[name][0]
        assert torch.equal(call(x[-1:].contiguous())[0], call(x)[-1]), name


@pytest.mark.parametrize(("n", "rows"), [(192, 32), (208, 33), (208, 300), (96, 530)])
@pytest.mark.parametrize("out", [torch.float32, torch.bfloat16])
def test_a_bf16_row_comes_out_alike_at_every_row_count(n, rows, out, path):
    """On AMX a bf16 call of any row count sums each row with the same tile products in the same order (blocks
    of 48 channels, of 32 from 96 rows, chunks of 256 rows, the last rows zero-padded to 16), bf16 or fp32 out:
    a row's bits never depend on how many rows came with it. (A 32 x 32 block that shares weight tiles between two row
    tiles would keep that, and was measured: 0.93-1.09x at SmolLM2's shapes, 0.78-0.81x at the 8B up_proj.)"""
    if path != "amx":
        pytest.skip("the avx512bf16 path's rows: test_each_row_is_computed_alone")
    torch.manual_seed(rows)
    weight = torch.randn(n, 576).bfloat16()
    pairs = wo_bf16.pack_bf16(weight)
    x = torch.randn(rows, 576).bfloat16()
    together = wo_bf16.bf16_linear(x, pairs, out)
    exact = x.float() @ weight.float().t()
    assert_close(together.float(), exact, 1e-5 if out == torch.float32 else 1e-2, "bf16")
    for row in (0, 15, 16, 31, rows - 1):
        assert torch.equal(wo_bf16.bf16_linear(x[row:row + 1].contiguous(), pairs, out)[0], together[row]), row


@pytest.mark.parametrize(("n", "k"), [(32, 32), (192, 576), (3072, 576)])
@pytest.mark.parametrize("rows", [1, 5, 17, 95, 96, 300])
def test_the_gate_up_call_with_silu_gives_silu_mul_of_its_outputs_to_the_bit(n, k, rows):
    """woq_linear_bf16_silu over a gate_up weight (gate's channels, then up's) is `F.silu(gate) * up` over the
    unfused call's bf16 outputs, bit for bit, on both sides of the 96-row switch and on each build."""
    torch.manual_seed(rows)
    packed = wo_bf16.pack_bf16((torch.randn(n, k) * 0.1).bfloat16())
    x = (torch.randn(rows, k) * 3).bfloat16()
    gate, up = wo_bf16.bf16_linear(x, packed, torch.bfloat16).split(n // 2, dim=-1)
    fused = wo_bf16._kernel(None).bf16_silu(x, packed, torch.bfloat16)
    assert torch.equal(fused.view(torch.int16), (torch.nn.functional.silu(gate) * up).view(torch.int16))


@pytest.mark.parametrize(("n", "k"), [(64, 64), (3072, 576)])
@pytest.mark.parametrize("rows", [1, 2, 3, 17, 100])
def test_the_int8_gate_up_call_with_silu_gives_silu_mul_of_its_outputs_to_the_bit(n, k, rows):
    """woq_linear_int8_silu: in the epilogue where the weight is in quads (each row scale and channel scale as the
    unfused call applies them, VPDPBUSD's 1-2 rows and AMX's 3 on) and on the bf16 panel of pairs (AMD from 24
    rows: 100 here), else the unfused call and torch's ops."""
    torch.manual_seed(rows + n)
    q, scales = quantize_per_channel(torch.randn(n, k))
    packed = wo_bf16.pack_int8(q)
    x = (torch.randn(rows, k) * 3).bfloat16()
    gate, up = wo_bf16.int8_linear(x, packed, scales, torch.bfloat16).split(n // 2, dim=-1)
    fused = wo_bf16._kernel(None).int8_silu(x, packed, scales, torch.bfloat16)
    assert torch.equal(fused.view(torch.int16), (torch.nn.functional.silu(gate) * up).view(torch.int16))


@pytest.mark.parametrize("rows", [1, 7, 8, 100, 600])
def test_the_int4_gate_up_call_with_silu_gives_silu_mul_of_its_outputs_to_the_bit(rows):
    """woq_linear_int4_silu: in the epilogue on the panel paths (each block's panel a gate tile and its up tile,
    row chunks past 512 rows), below them the unfused call and torch's ops."""
    torch.manual_seed(rows)
    n, k = 192, 576
    codes, sz = quantize_groups(torch.randn(n, k), 32)
    packed = wo_bf16.pack_int4(unpack_nibbles(codes))
    x = (torch.randn(rows, k) * 3).bfloat16()
    gate, up = wo_bf16.int4_linear(x, packed, sz, 32, n, torch.bfloat16).split(n // 2, dim=-1)
    fused = wo_bf16._kernel(None).int4_silu(x, packed, sz, 32, n, torch.bfloat16)
    assert torch.equal(fused.view(torch.int16), (torch.nn.functional.silu(gate) * up).view(torch.int16))


def test_the_silu_call_refuses_what_it_cannot_pair():
    silu = wo_bf16._kernel(None).bf16_silu
    x = torch.randn(4, 32).bfloat16()
    with pytest.raises(RuntimeError, match="whole gate and up tiles"):
        silu(x, wo_bf16.pack_bf16(torch.randn(48, 32).bfloat16()), torch.bfloat16)
    with pytest.raises(RuntimeError, match="bf16 out only"):
        silu(x, wo_bf16.pack_bf16(torch.randn(64, 32).bfloat16()), torch.float32)
    q, scales = quantize_per_channel(torch.randn(48, 64))
    with pytest.raises(RuntimeError, match="whole gate and up tiles"):
        wo_bf16._kernel(None).int8_silu(torch.randn(4, 64).bfloat16(), wo_bf16.pack_int8(q), scales, torch.bfloat16)


@pytest.mark.parametrize(("n", "k", "rows"), [(160, 128, 300), (48, 4096, 40), (96, 576, 530)])
def test_prefill_sized_calls_give_each_row_its_decode_result(n, k, rows):
    """Calls of prefill size: x rounded and split by several threads, the int8 tile sums converted between the
    next block's tile steps, int4's next panel dequantized between them; rows past the 512-row chunk. int8 on
    AMX-INT8 gives every row what a one-row call gives it; int4's panel the rounded weight's products."""
    torch.manual_seed(rows)
    weight = torch.randn(n, k)
    q, scales = quantize_per_channel(weight)
    int8 = wo_bf16.pack_int8(q)
    codes, sz = quantize_groups(weight, 32)
    int4 = wo_bf16.pack_int4(unpack_nibbles(codes))
    x = torch.randn(rows, k).bfloat16()
    y8 = wo_bf16.int8_linear(x, int8, scales, torch.float32)
    assert_close(y8, (x.float() @ q.float().t()) * scales, 1e-4, "int8")
    if int8.shape[3] == 4:  # quads: the same sums at every row count
        for row in (0, 17, rows - 1):
            assert torch.equal(wo_bf16.int8_linear(x[row:row + 1].contiguous(), int8, scales, torch.float32)[0], y8[row])
    exact = dequantize_rows(codes, sz, 32, torch.float32)
    y4 = wo_bf16.int4_linear(x, int4, sz, 32, n, torch.float32)
    if rows >= exact_rows(k):  # the panel: the weight rounded once to bf16
        assert_close(y4, x.float() @ exact.bfloat16().float().t(), 1e-5, "int4")
    else:  # int16 rows (Intel without AMX), the raw codes' panel (AMD): the exact weight
        assert_close(y4, x.float() @ exact.t(), 1e-4, "int4")


@pytest.mark.parametrize(("n", "rows"), [(96, 600), (240, 1100)])
def test_a_long_int4_call_in_row_chunks_gives_each_row_its_own_result(n, rows):
    """x too big for L2 (K = 1024): the int4 panel goes chunk by chunk of rows, each block dequantized again per
    chunk; every row, in the first chunk, across a chunk's edge or in the zero-padded last rows, comes out to the
    bit as in a call of a few rows (the panel path, all rows at once)."""
    torch.manual_seed(rows)
    k = 1024
    codes, sz = quantize_groups(torch.randn(n, k), 32)
    int4 = wo_bf16.pack_int4(unpack_nibbles(codes))
    x = torch.randn(rows, k).bfloat16()
    together = wo_bf16.int4_linear(x, int4, sz, 32, n, torch.float32)
    exact = dequantize_rows(codes, sz, 32, torch.float32)
    if rows >= panel_rows(True, k):
        assert_close(together, x.float() @ exact.bfloat16().float().t(), 1e-5, "int4")
    for row in (0, 255, 256, 511, rows - 1):
        few = x[row:row + 1].expand(max(24, exact_rows(k)), -1).contiguous()  # the rounded weight's panel too
        assert torch.equal(wo_bf16.int4_linear(few, int4, sz, 32, n, torch.float32)[0], together[row]), row


def test_bad_inputs_are_refused_with_the_reason():
    q, scales = quantize_per_channel(torch.randn(32, 64))
    packed = wo_bf16.pack_int8(q)
    with pytest.raises(RuntimeError, match="bfloat16"):
        wo_bf16.int8_linear(torch.randn(2, 64), packed, scales, torch.float32)
    with pytest.raises(RuntimeError, match="multiple of 16"):
        wo_bf16.int8_linear(torch.randn(2, 64).bfloat16(), packed[:1].contiguous(), scales[:8].contiguous(),
                        torch.float32)
    with pytest.raises(RuntimeError, match="N\\*K elements"):
        wo_bf16.int8_linear(torch.randn(2, 32).bfloat16(), packed, scales, torch.float32)
    codes, sz = quantize_groups(torch.randn(32, 64), 32)
    words = wo_bf16.pack_int4(unpack_nibbles(codes))
    with pytest.raises(RuntimeError, match="multiple of 8"):
        wo_bf16.int4_linear(torch.randn(2, 64).bfloat16(), words, sz, 12, 32, torch.float32)
    with pytest.raises(RuntimeError, match="bf16"):
        wo_bf16.int4_linear(torch.randn(2, 64).bfloat16(), words, sz.float(), 32, 32, torch.float32)
    assert wo_bf16.int8_linear(torch.empty(0, 64).bfloat16(), packed, scales, torch.float32).shape == (0, 32)


def test_layers_use_it_drop_their_plain_weights_and_the_switch_turns_it_off(monkeypatch):
    torch.manual_seed(1)
    linear = torch.nn.Linear(64, 96, bias=True)
    x = torch.randn(3, 5, 64)
    int8 = Int8WeightOnlyLinear.from_linear(linear)
    int4 = Int4WeightOnlyLinear.from_linear(linear, 32)
    y8, y4 = int8(x), int4(x)
    assert int8._woq_weight is not None and int4._woq_codes is not None and int4._packed is None
    weight8, weight4 = int8.dequantized_weight(), int4.dequantized_weight()
    int8.drop_plain()
    int4.drop_codes()
    assert int8.weight_int8.numel() == 0 and int4.codes.numel() == 0
    assert torch.equal(int8(x), y8) and torch.equal(int4(x), y4)
    assert torch.equal(int8.dequantized_weight(), weight8) and torch.equal(int4.dequantized_weight(), weight4)

    monkeypatch.setenv(settings.WOQ_KERNEL.name, "0")
    assert not wo_bf16.available()
    fresh8, fresh4 = Int8WeightOnlyLinear.from_linear(linear), Int4WeightOnlyLinear.from_linear(linear, 32)
    torch_y8, torch_y4 = fresh8(x), fresh4(x)
    assert fresh8._woq_weight is None and fresh4._woq_codes is None
    scale = y8.abs().max()
    assert (torch_y8 - y8).abs().max() < 0.02 * scale and (torch_y4 - y4).abs().max() < 0.02 * scale


def test_batched_engine_on_int8wo_matches_hf_generate_one_prompt_at_a_time(tiny_model_dir, path):
    from test_engine import random_prompts

    import quantize
    from serving import LLMEngine, SamplingParams

    variant = quantize.quantize(tiny_model_dir, "int8wo")
    engine = LLMEngine.from_pretrained(str(variant), device="cpu", dtype=torch.float32, num_kv_blocks=64,
                                       block_size=4, max_num_batched_tokens=48, isa=path)
    layer = engine.model.model.layers[0].mlp.up_proj
    assert isinstance(layer, Int8WeightOnlyLinear) and layer._woq_weight is not None
    prompts = random_prompts(8, vocab=engine.model.config.vocab_size, seed=3, hi=40)
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    outs = engine.generate(prompts, params)  # chunked prefill and decode batches of several rows
    reference = quantize.load_model(variant, "cpu", None)
    for prompt, out in zip(prompts, outs, strict=True):
        ids = torch.tensor([prompt])
        hf = reference.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=12, min_new_tokens=12,
                                do_sample=False, pad_token_id=0)
        assert out.token_ids == hf[0, len(prompt):].tolist()


def test_the_benchmark_measures_every_path(monkeypatch, tmp_path):
    import json

    import benchmarks.woq_linear as bench

    monkeypatch.setattr(bench, "SHAPES", ((32, 64), (48, 64)))
    assert len(bench.model_layers(3)) == 3 + 1  # each layer's projections, then the head
    assert bench.main(["--rows", "1,40", "--layers", "2", "--out-dir", str(tmp_path), "--no-plots"]) == 0
    report = json.loads((tmp_path / "woq_linear.json").read_text())
    rows = report["rows"]
    assert report["layers"] == 2
    assert [r["rows"] for r in rows] == [1, 40]
    for row in rows:
        assert all(row[f"{name}_ms"] > 0 for name in bench.PATHS)
        assert row["int4_ours_vs_bf16"] == pytest.approx(row["bf16_ms"] / row["int4_ours_ms"])


@pytest.mark.parametrize("method", ["int8wo", "int4wo"])
def test_a_loaded_variant_holds_one_copy_of_its_tied_table(tiny_model_dir, method):
    """The tied embedding looks rows up in the lm_head's kernel layout; the plain table is freed, and
    lookups and logits equal those of the same variant served by torch's kernels."""
    import quantize
    from quantgate.loading import resident_bytes

    variant = quantize.quantize(tiny_model_dir, method)
    ours = quantize.load_model(variant, "cpu", None)
    embed, head = ours.get_input_embeddings(), ours.get_output_embeddings()
    layout = head._woq_weight if method == "int8wo" else head._woq_codes
    assert layout is not None and (embed._packed if method == "int8wo" else embed._words) is layout
    plain = head.weight_int8 if method == "int8wo" else head.codes
    assert plain.numel() == 0
    with isas.using("torch"):
        theirs = quantize.load_model(variant, "cpu", None)
    ids = torch.tensor([[1, 17, 5, 200, 3]])
    assert torch.equal(embed(ids), theirs.get_input_embeddings()(ids))
    with torch.inference_mode():
        a, b = ours(ids).logits, theirs(ids).logits
    assert (a - b).abs().max() < 0.05 * b.abs().max()
    theirs(ids)  # torch's kernels build their layout on first use: compare what each serves from
    if method == "int8wo":  # torch's int8 kernel reads the plain table: one copy each
        assert resident_bytes(ours) == resident_bytes(theirs)
    else:  # torch's int4 layout cannot be indexed: it keeps the plain codes beside it
        assert resident_bytes(ours) < resident_bytes(theirs)


def test_the_build_cache_is_keyed_by_the_headers_beside_the_source_too(tmp_path, monkeypatch):
    from serving.kernels import cpu as kernels

    monkeypatch.setenv("QUANTGATE_KERNEL_DIR", str(tmp_path / "cache"))
    (tmp_path / "op.cpp").write_text('#include "op.h"\n')
    (tmp_path / "op.h").write_text("// one\n")
    before = kernels.build_dir(tmp_path / "op.cpp")
    assert kernels.build_dir(tmp_path / "op.cpp") == before
    (tmp_path / "op.h").write_text("// two\n")
    assert kernels.build_dir(tmp_path / "op.cpp") != before
