// A Llama-family decode step's decoder stack in one call: the same ops the Python forward
// (serving/model/llama_forward.py) calls for every layer, in the same order on the same tensors, called from C++.
// At batch 1 the Python and argument parsing around a layer's dozen ops cost about as much as its kernels
// (figures: benchmarks/decode_step.py); here each op costs one boxed dispatcher call. The plan holds, per layer, the projection ops (whichever
// kernel build serves each: woq_linear, wo_linear; looked up by name once) with their weights, the norms and
// the KV caches; `run` takes what changes per step. Results are bit-identical to the Python loop: the ops
// are the same ones, and silu * up is the same call (fused_ops' silu_mul for bf16 rows where the plan was given
// it, else ATen's, as F.silu(gate) * up is).

#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/custom_class.h>
#include <torch/library.h>

#include <array>
#include <optional>
#include <string>
#include <vector>

namespace {

using Stack = std::vector<c10::IValue>;

c10::OperatorHandle find_op(const std::string& qualified) {
  return c10::Dispatcher::singleton().findSchemaOrThrow(qualified.c_str(), "");
}

at::Tensor call_first(const c10::OperatorHandle& op, Stack stack) {
  op.callBoxed(&stack);
  return stack.at(0).toTensor();
}

// One projection: an op taking the rows first, then its fixed arguments in schema order.
struct Projection {
  std::optional<c10::OperatorHandle> op;  // set by add_projection (the handle has no empty state)
  Stack fixed;                            // everything after the rows
  bool bf16_rows = false;  // woq_linear reads bf16 rows and takes an out dtype; wo_linear reads fp32 rows

  at::Tensor operator()(const at::Tensor& x) const {
    Stack stack;
    stack.reserve(fixed.size() + 1);
    stack.emplace_back(x.to(bf16_rows ? at::kBFloat16 : at::kFloat).contiguous());
    stack.insert(stack.end(), fixed.begin(), fixed.end());
    if (bf16_rows) {  // the out dtype: the rows' own where the kernel writes it
      const auto dtype = x.scalar_type() == at::kBFloat16 ? at::kBFloat16 : at::kFloat;
      stack.back() = static_cast<int64_t>(dtype);
    }
    return call_first(*op, std::move(stack)).to(x.scalar_type());
  }
};

// A layer's projections by slot: q/k/v and gate/up either fused (one call, split by columns) or apart.
enum Slot { kQkv, kO, kGateUp, kDown, kQ, kK, kV, kGate, kUp, kSlots };

struct Layer {
  at::Tensor input_norm, post_norm;
  std::array<std::optional<Projection>, kSlots> proj;
  double scaling = 1.0;
  int64_t window = 0;  // 0: the whole context
};

class DecodePlan : public torch::CustomClassHolder {
 public:
  // add_rms_norm, rotary_store, paged_decode: qualified names ("ns::op") of the builds serving this model
  DecodePlan(std::string add_rms_norm, std::string rotary_store, std::string paged_decode, int64_t heads,
             int64_t kv_heads, int64_t head_dim, double eps, at::Tensor final_norm)
      : add_rms_norm_(find_op(add_rms_norm)), rotary_store_(find_op(rotary_store)),
        paged_decode_(find_op(paged_decode)), heads_(heads), kv_heads_(kv_heads), head_dim_(head_dim),
        eps_(eps), final_norm_(std::move(final_norm)) {}

  // One projection's op and fixed arguments: `tensors` and `ints` fill the schema's Tensor and int
  // parameters after the rows, in order (a woq_linear op's last, its out dtype, is set per call).
  // `slot`: a `Slot`.
  void add_projection(int64_t layer, int64_t slot, std::string op_name, std::vector<at::Tensor> tensors,
                      std::vector<int64_t> ints, bool bf16_rows) {
    TORCH_CHECK(layer >= 0 && layer <= static_cast<int64_t>(layers_.size()), "layers are added in order");
    if (layer == static_cast<int64_t>(layers_.size())) layers_.emplace_back();
    Projection p{find_op(op_name), {}, bf16_rows};
    const auto& args = p.op->schema().arguments();
    const size_t last = args.size() - (bf16_rows ? 1 : 0);  // woq_linear's out dtype is set per call
    size_t t = 0, i = 0;
    for (size_t a = 1; a < last; ++a) {
      const auto kind = args[a].type()->kind();
      if (kind == c10::TypeKind::TensorType) {
        TORCH_CHECK(t < tensors.size(), op_name, ": too few tensors");
        p.fixed.emplace_back(tensors[t++]);
      } else if (kind == c10::TypeKind::OptionalType) {  // aten::linear's bias: none
        p.fixed.emplace_back();
      } else {
        TORCH_CHECK(i < ints.size(), op_name, ": too few ints");
        p.fixed.emplace_back(ints[i++]);
      }
    }
    TORCH_CHECK(t == tensors.size() && i == ints.size(), op_name, ": arguments left over");
    if (bf16_rows) p.fixed.emplace_back(int64_t{0});
    TORCH_CHECK(slot >= 0 && slot < kSlots, "no projection slot ", slot);
    layers_[layer].proj[slot] = std::move(p);
  }

  void set_layer(int64_t layer, at::Tensor input_norm, at::Tensor post_norm, double scaling, int64_t window) {
    Layer& l = layers_.at(layer);
    l.input_norm = std::move(input_norm);
    l.post_norm = std::move(post_norm);
    l.scaling = scaling;
    l.window = window;
  }

  // silu(gate) * up for bf16 rows (fused_ops' silu_mul: torch's result in one pass); unset, ATen's ops.
  void set_silu_mul(std::string op_name) { silu_mul_ = find_op(op_name); }

  int64_t num_layers() const { return static_cast<int64_t>(layers_.size()); }

  // Every layer has o, down, and q/k/v and gate/up fused or apart.
  bool complete() const {
    for (const Layer& l : layers_) {
      const auto& p = l.proj;
      if (!p[kO] || !p[kDown] || !(p[kQkv] || (p[kQ] && p[kK] && p[kV])) || !(p[kGateUp] || (p[kGate] && p[kUp])))
        return false;
    }
    return !layers_.empty();
  }

  // x: the first layer's normed input; residual [tokens, hidden] is updated in place. Returns the final
  // norm's output. One decode token per sequence: q rows are the sequences.
  at::Tensor run(at::Tensor x, at::Tensor residual, at::Tensor cos, at::Tensor sin, at::Tensor slots,
                 at::Tensor block_tables, at::Tensor context_lens, int64_t block_size,
                 std::vector<at::Tensor> k_cache, std::vector<at::Tensor> v_cache) {
    const int64_t tokens = x.size(0), q_width = heads_ * head_dim_, kv_width = kv_heads_ * head_dim_;
    TORCH_CHECK(k_cache.size() == layers_.size() && v_cache.size() == layers_.size(), "one cache per layer");
    for (size_t i = 0; i < layers_.size(); ++i) {
      const Layer& l = layers_[i];
      at::Tensor q, k, v;
      if (l.proj[kQkv]) {
        at::Tensor qkv = (*l.proj[kQkv])(x);
        q = qkv.narrow(1, 0, q_width), k = qkv.narrow(1, q_width, kv_width);
        v = qkv.narrow(1, q_width + kv_width, kv_width);
      } else {
        q = (*l.proj[kQ])(x), k = (*l.proj[kK])(x), v = (*l.proj[kV])(x);
      }
      Stack rotary{q, k, v, cos, sin, head_dim_, k_cache[i], v_cache[i], slots};
      rotary_store_.callBoxed(&rotary);
      at::Tensor rows = q.view({tokens, heads_, head_dim_}).to(k_cache[i].scalar_type()).contiguous();
      at::Tensor attn = call_first(paged_decode_, Stack{rows, k_cache[i], v_cache[i], block_tables, context_lens,
                                                        block_size, l.scaling, c10::IValue(), c10::IValue(),
                                                        int64_t{0}, l.window});
      at::Tensor out = (*l.proj[kO])(attn.to(x.scalar_type()).reshape({tokens, -1}));
      x = call_first(add_rms_norm_, Stack{residual, out.contiguous(), l.post_norm, eps_});
      at::Tensor gate, up;
      if (l.proj[kGateUp]) {
        at::Tensor gate_up = (*l.proj[kGateUp])(x);
        const int64_t inter = gate_up.size(1) / 2;
        gate = gate_up.narrow(1, 0, inter), up = gate_up.narrow(1, inter, inter);
      } else {
        gate = (*l.proj[kGate])(x), up = (*l.proj[kUp])(x);
      }
      const bool fused = silu_mul_ && gate.scalar_type() == at::kBFloat16;
      out = (*l.proj[kDown])(fused ? call_first(*silu_mul_, Stack{gate, up}) : at::silu(gate) * up);
      const at::Tensor& next = i + 1 < layers_.size() ? layers_[i + 1].input_norm : final_norm_;
      x = call_first(add_rms_norm_, Stack{residual, out.contiguous(), next, eps_});
    }
    return x;
  }

 private:
  c10::OperatorHandle add_rms_norm_, rotary_store_, paged_decode_;
  std::optional<c10::OperatorHandle> silu_mul_;
  int64_t heads_, kv_heads_, head_dim_;
  double eps_;
  at::Tensor final_norm_;
  std::vector<Layer> layers_;
};

}  // namespace

TORCH_LIBRARY(quantgate_step, m) {
  m.class_<DecodePlan>("DecodePlan")
      .def(torch::init<std::string, std::string, std::string, int64_t, int64_t, int64_t, double, at::Tensor>())
      .def("add_projection", &DecodePlan::add_projection)
      .def("set_layer", &DecodePlan::set_layer)
      .def("set_silu_mul", &DecodePlan::set_silu_mul)
      .def("num_layers", &DecodePlan::num_layers)
      .def("complete", &DecodePlan::complete)
      .def("run", &DecodePlan::run);
}
