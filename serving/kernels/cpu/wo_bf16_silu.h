// The MLP's first half in one call: each weight format's linear over a gate_up weight (the gate's N/2 channels,
// then the up's) with silu(gate) * up in its epilogue (store_silu_rows), [M, N/2] bf16. A block pairs a gate tile
// with the up tile of the same channels, so the call writes half the bytes and nothing reads gate and up back:
// at 2,048 rows of SmolLM2 the bf16 gate_up call and fused_ops' silu_mul took 7.4 + 1.3 ms in the engine, this
// call 4.4 ms. Included by wo_bf16.cpp after the calls it reuses.
#pragma once

#include "silu_table.h"

namespace {

// The MLP's first half over a gate_up weight (the gate's N/2 channels, then the up's): silu(gate) * up,
// [M, N/2] bf16, to the bit what woq_linear_bf16 and `F.silu(gate) * up` give.
at::Tensor woq_linear_bf16_silu(const at::Tensor& x, const at::Tensor& packed, at::ScalarType out_dtype) {
  TORCH_CHECK(out_dtype == at::kBFloat16, "woq_linear_bf16_silu: bf16 out only");
  TORCH_CHECK(packed.dim() == 4 && packed.size(0) % 2 == 0, "woq_linear_bf16_silu: a gate_up weight of whole gate "
              "and up tiles, got ", packed.sizes());
  Problem p{};
  auto out = bf16_problem(x, packed, packed.size(0) * kTile / 2, out_dtype, p);
  p.silu = silu_table().data();
  if (p.m) run_bf16(p);
  return out;
}

// Where no epilogue pairs the tiles: silu(gate) * up over the unfused call's [M, N] output, by torch's own ops.
at::Tensor silu_mul_halves(const at::Tensor& gate_up) {
  const int64_t half = gate_up.size(1) / 2;
  return at::silu(gate_up.narrow(1, 0, half)) * gate_up.narrow(1, half, half);
}

// The MLP's first half over an int8 gate_up weight (the gate's N/2 channels, then the up's): silu(gate) * up,
// [M, N/2] bf16, to the bit what woq_linear_int8 then `F.silu(gate) * up` give. In the epilogue where the weight
// is in quads (AMX-INT8) and on the bf16 panel (each block's panel a gate tile and its up tile); below the panel
// (the int16 rows of a few-row call) those two ops.
at::Tensor woq_linear_int8_silu(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scales,
                                at::ScalarType out_dtype) {
  TORCH_CHECK(out_dtype == at::kBFloat16, "woq_linear_int8_silu: bf16 out only");
  TORCH_CHECK(scales.numel() % (2 * kTile) == 0, "woq_linear_int8_silu: a gate_up weight of whole gate and up "
              "tiles, got N=", scales.numel());
  Problem p{};
  at::Tensor out;
  const bool quads = int8_problem(x, packed, scales, scales.numel() / 2, out_dtype, p, out);
  if (!quads && p.m < panel_rows_from(false, p.k)) return silu_mul_halves(woq_linear_int8(x, packed, scales, out_dtype));
  p.silu = silu_table().data();
  if (!p.m) return out;
#ifdef QUANTGATE_AMX_INT8
  if (quads) return run_int8_amx(p), out;
#endif
  run_int8(p);
  return out;
}

// The MLP's first half over an int4 gate_up weight: silu(gate) * up, [M, N/2] bf16, to the bit what
// woq_linear_int4 then `F.silu(gate) * up` give. In the epilogue on the panel paths; below them (the int16 rows of
// a few-row call) those two ops.
at::Tensor woq_linear_int4_silu(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scales_zeros,
                                int64_t group_size, int64_t n, at::ScalarType out_dtype) {
  TORCH_CHECK(out_dtype == at::kBFloat16, "woq_linear_int4_silu: bf16 out only");
  TORCH_CHECK(n % (2 * kTile) == 0, "woq_linear_int4_silu: a gate_up weight of whole gate and up tiles, got N=", n);
  if (x.dim() == 2 && x.size(0) < panel_rows_from(true, x.size(1))) {
    return silu_mul_halves(woq_linear_int4(x, packed, scales_zeros, group_size, n, out_dtype));
  }
  Problem p{};
  auto out = int4_problem(x, packed, scales_zeros, group_size, n, n / 2, out_dtype, p);
  p.silu = silu_table().data();
  if (p.m) run_int4(p);
  return out;
}

}  // namespace
