// silu(x) rounded to bf16 for every bf16 x, computed once by torch's own silu: a bf16 activation has 65 536
// values, so a lookup gives torch's result to the bit at the cost of one load (128 KB, it stays in L2).
// One entry more than the values: a 32-bit gather (store_silu_rows) reads two bytes past the last one.
#pragma once

#include <ATen/ATen.h>

#include <cstdint>
#include <vector>

namespace {

const std::vector<uint16_t>& silu_table() {
  static const std::vector<uint16_t> table = [] {
    const at::Tensor all = at::arange(0, 65536, at::kInt).to(at::kShort).view(at::kBFloat16);
    const at::Tensor silu = at::silu(all).contiguous();
    const uint16_t* bits = reinterpret_cast<const uint16_t*>(silu.data_ptr<at::BFloat16>());
    std::vector<uint16_t> values(bits, bits + 65536);
    values.push_back(0);
    return values;
  }();
  return table;
}

}  // namespace
