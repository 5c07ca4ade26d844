// Autograd of the differentiable tonp ops (linear, rms_norm, silu_mul, moe_route, moe_combine,
// moe_experts, rope, attention_varlen), in C++ so that a call costs a dispatcher hop rather than
// torch.library's Python autograd wrapper (~16 us, most of a small decode step).
//
// Forward = the invariant kernel (redispatched below autograd, so fake tensors and tracing see
// the op itself). Backward = an op of its own per op (tonp::*_backward, *_grad: grad_kernels.cpp,
// moe_backward.cpp, attention_grad.cpp; fake impls in _fakes.py): standard math with fp32 sums,
// in the input dtypes, in fixed orders (gradients need to be correct, not invariant: CONTRACT.md;
// and deterministic for any thread count).
#include <ATen/ATen.h>
#include <array>
#include <torch/autograd.h>
#include <torch/library.h>

namespace tonp {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;
using at::Tensor;

// The CPU kernel of a tonp op, called below autograd (the forward of every Function here).
template <typename Sig>
struct Below {
  c10::TypedOperatorHandle<Sig> handle;
  explicit Below(const char* name) : handle(c10::Dispatcher::singleton().findSchemaOrThrow(name, "").typed<Sig>()) {}
  template <typename... Args>
  auto operator()(Args&&... args) const {
    at::AutoDispatchBelowADInplaceOrView guard;
    return handle.call(std::forward<Args>(args)...);
  }
};

using LinearSig = Tensor(const Tensor&, const Tensor&, const std::optional<Tensor>&, int64_t, std::optional<at::ScalarType>,
                         const std::optional<Tensor>&);
using RmsSig = Tensor(const Tensor&, const Tensor&, double);
using SiluSig = Tensor(const Tensor&, const Tensor&);
using RouteSig = std::tuple<Tensor, Tensor>(const Tensor&, int64_t, bool);
using CombineSig = Tensor(const Tensor&, const Tensor&);
using ExpertsSig = Tensor(const Tensor&, const Tensor&, const Tensor&, const Tensor&, int64_t, int64_t,
                          const std::optional<Tensor>&, const std::optional<Tensor>&);
using RopeSig = Tensor(const Tensor&, const Tensor&, const Tensor&, const Tensor&);
using LinearBwdSig = std::tuple<Tensor, Tensor, Tensor>(const Tensor&, const Tensor&, const Tensor&, std::array<bool, 3>,
                                                        std::optional<at::ScalarType>);
using RmsBwdSig = std::tuple<Tensor, Tensor>(const Tensor&, const Tensor&, const Tensor&, double, std::array<bool, 2>);
using SiluBwdSig = std::tuple<Tensor, Tensor>(const Tensor&, const Tensor&, const Tensor&);
using RouteBwdSig = Tensor(const Tensor&, const Tensor&, const Tensor&, const Tensor&, bool);
using CombineBwdSig = std::tuple<Tensor, Tensor>(const Tensor&, const Tensor&, const Tensor&, std::array<bool, 2>);
using RopeBwdSig = Tensor(const Tensor&, const Tensor&, const Tensor&, const Tensor&, at::ScalarType);
using AttnSig = Tensor(const Tensor&, const Tensor&, const Tensor&, const Tensor&, double, int64_t);
using AttnBwdSig = std::tuple<Tensor, Tensor, Tensor>(const Tensor&, const Tensor&, const Tensor&, const Tensor&,
                                                      const Tensor&, const Tensor&, double);
using ExpertsTrainSig = std::tuple<Tensor, Tensor>(const Tensor&, const Tensor&, const Tensor&, const Tensor&, int64_t,
                                                    int64_t);
using ExpertsGradSig = std::tuple<Tensor, Tensor, Tensor>(const Tensor&, const Tensor&, const Tensor&, const Tensor&,
                                                          const Tensor&, const std::optional<Tensor>&, int64_t, int64_t,
                                                          std::array<bool, 3>);

bool any_requires_grad(std::initializer_list<const Tensor*> ts) {
  if (!at::GradMode::is_enabled()) return false;
  for (const Tensor* t : ts)
    if (t->defined() && t->requires_grad()) return true;
  return false;
}

// --- linear ----------------------------------------------------------------------------------
struct LinearFn : torch::autograd::Function<LinearFn> {
  static Tensor forward(AutogradContext* ctx, const Tensor& x, const Tensor& w, const std::optional<Tensor>& bias,
                        int64_t chunks, std::optional<at::ScalarType> out_dtype) {
    static const Below<LinearSig> k("tonp::linear");
    ctx->save_for_backward({x, w});
    ctx->saved_data["has_bias"] = bias.has_value() && bias->defined();
    if (bias.has_value() && bias->defined()) ctx->saved_data["bias_dtype"] = bias->scalar_type();
    return k(x, w, bias, chunks, out_dtype, std::nullopt);
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    // The backward GEMM over fixed tiles (grad_kernels.cpp): bf16 operands stay bf16 (vdpbf16ps
    // where the CPU has it), nothing is widened in a copy of its own.
    static const Below<LinearBwdSig> k("tonp::linear_backward");
    const auto saved = ctx->get_saved_variables();
    const bool has_bias = ctx->saved_data["has_bias"].toBool();
    const std::array<bool, 3> want{ctx->needs_input_grad(0), ctx->needs_input_grad(1), has_bias && ctx->needs_input_grad(2)};
    const std::optional<at::ScalarType> bdt =
        has_bias ? std::optional<at::ScalarType>(ctx->saved_data["bias_dtype"].toScalarType()) : std::nullopt;
    auto [gx, gw, gb] = k(grads[0], saved[0], saved[1], want, bdt);
    return {want[0] ? gx : Tensor(), want[1] ? gw : Tensor(), want[2] ? gb : Tensor(), Tensor(), Tensor()};
  }
};

// weight_groups (a caller's column groups of the weight): the inference forward reads them; the
// training forward reads the weight in place (the same bits).
Tensor linear_ad(const Tensor& x, const Tensor& w, const std::optional<Tensor>& bias, int64_t chunks,
                 std::optional<at::ScalarType> out_dtype, const std::optional<Tensor>& weight_groups) {
  const Tensor none;
  if (!any_requires_grad({&x, &w, bias.has_value() ? &*bias : &none})) {
    static const Below<LinearSig> k("tonp::linear");
    return k(x, w, bias, chunks, out_dtype, weight_groups);
  }
  return LinearFn::apply(x, w, bias, chunks, out_dtype);  // weight_groups not read: W in place
}

// --- rms_norm: y = w * round(x * r), r = rsqrt(mean(x^2) + eps) -------------------------------
struct RmsNormFn : torch::autograd::Function<RmsNormFn> {
  static Tensor forward(AutogradContext* ctx, const Tensor& x, const Tensor& w, double eps) {
    static const Below<RmsSig> k("tonp::rms_norm");
    ctx->save_for_backward({x, w});
    ctx->saved_data["eps"] = eps;
    return k(x, w, eps);
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    const Tensor &x = saved[0], &w = saved[1];
    static const Below<RmsBwdSig> k("tonp::rms_norm_backward");
    const std::array<bool, 2> want{ctx->needs_input_grad(0), ctx->needs_input_grad(1)};
    auto [gx, gw] = k(grads[0], x, w, ctx->saved_data["eps"].toDouble(), want);
    return {want[0] ? gx : Tensor(), want[1] ? gw : Tensor(), Tensor()};
  }
};

Tensor rms_norm_ad(const Tensor& x, const Tensor& w, double eps) {
  if (!any_requires_grad({&x, &w})) {
    static const Below<RmsSig> k("tonp::rms_norm");
    return k(x, w, eps);
  }
  return RmsNormFn::apply(x, w, eps);
}

// --- silu_mul: silu(g) * u --------------------------------------------------------------------
struct SiluMulFn : torch::autograd::Function<SiluMulFn> {
  static Tensor forward(AutogradContext* ctx, const Tensor& gate, const Tensor& up) {
    static const Below<SiluSig> k("tonp::silu_mul");
    ctx->save_for_backward({gate, up});
    return k(gate, up);
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    static const Below<SiluBwdSig> k("tonp::silu_mul_backward");
    auto [dg, du] = k(grads[0], saved[0], saved[1]);
    return {dg, du};
  }
};

Tensor silu_mul_ad(const Tensor& gate, const Tensor& up) {
  if (!any_requires_grad({&gate, &up})) {
    static const Below<SiluSig> k("tonp::silu_mul");
    return k(gate, up);
  }
  return SiluMulFn::apply(gate, up);
}

// --- moe_route: the weights are softmax(logits)[ids] (renormalised); the ids are a choice ------
struct MoeRouteFn : torch::autograd::Function<MoeRouteFn> {
  static variable_list forward(AutogradContext* ctx, const Tensor& logits, int64_t top_k, bool normalize) {
    static const Below<RouteSig> k("tonp::moe_route");
    auto [ids, w] = k(logits, top_k, normalize);
    ctx->save_for_backward({logits, ids, w});
    ctx->saved_data["normalize"] = normalize;
    ctx->mark_non_differentiable({ids});
    return {ids, w};
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    if (!grads[1].defined()) return {Tensor(), Tensor(), Tensor()};
    static const Below<RouteBwdSig> k("tonp::moe_route_backward");
    return {k(grads[1], saved[0], saved[1], saved[2], ctx->saved_data["normalize"].toBool()), Tensor(), Tensor()};
  }
};

std::tuple<Tensor, Tensor> moe_route_ad(const Tensor& logits, int64_t top_k, bool normalize) {
  if (!any_requires_grad({&logits})) {
    static const Below<RouteSig> k("tonp::moe_route");
    return k(logits, top_k, normalize);
  }
  auto out = MoeRouteFn::apply(logits, top_k, normalize);
  return {out[0], out[1]};
}

// --- moe_combine: out = sum_k w_k y_k ---------------------------------------------------------
struct MoeCombineFn : torch::autograd::Function<MoeCombineFn> {
  static Tensor forward(AutogradContext* ctx, const Tensor& w, const Tensor& y) {
    static const Below<CombineSig> k("tonp::moe_combine");
    ctx->save_for_backward({w, y});
    return k(w, y);
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    static const Below<CombineBwdSig> k("tonp::moe_combine_backward");
    const std::array<bool, 2> want{ctx->needs_input_grad(0), ctx->needs_input_grad(1)};
    auto [gw, gy] = k(grads[0], saved[0], saved[1], want);
    return {want[0] ? gw : Tensor(), want[1] ? gy : Tensor()};
  }
};

Tensor moe_combine_ad(const Tensor& w, const Tensor& y) {
  if (!any_requires_grad({&w, &y})) {
    static const Below<CombineSig> k("tonp::moe_combine");
    return k(w, y);
  }
  return MoeCombineFn::apply(w, y);
}

// --- moe_experts: y[m, k] = down_e(silu(gate_e(x[m])) * up_e(x[m])), e = ids[m, k] -------------
struct MoeExpertsFn : torch::autograd::Function<MoeExpertsFn> {
  static Tensor forward(AutogradContext* ctx, const Tensor& x, const Tensor& ids, const Tensor& gate_up,
                        const Tensor& down, int64_t first_expert, int64_t chunks) {
    // The training forward also hands back the gate_up rows (moe_backward.cpp), so the backward
    // recomputes no GEMM; y's bits are moe_experts'.
    static const Below<ExpertsTrainSig> k("tonp::moe_experts_train");
    auto [y, gub] = k(x, ids, gate_up, down, first_expert, chunks);
    ctx->save_for_backward({x, ids, gate_up, down, gub});
    ctx->saved_data["first"] = first_expert;
    ctx->saved_data["chunks"] = chunks;
    return y;
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    // An op of its own (tonp::moe_experts_grad): its grouping depends on the routing, so traced
    // graphs see it as one opaque call with a fake implementation.
    static const Below<ExpertsGradSig> k("tonp::moe_experts_grad");
    const auto s = ctx->get_saved_variables();
    const std::array<bool, 3> want{ctx->needs_input_grad(0), ctx->needs_input_grad(2), ctx->needs_input_grad(3)};
    auto [gx, ggu, gdn] = k(grads[0], s[0], s[1], s[2], s[3], s[4], ctx->saved_data["first"].toInt(),
                            ctx->saved_data["chunks"].toInt(), want);
    return {want[0] ? gx : Tensor(), Tensor(), want[1] ? ggu : Tensor(), want[2] ? gdn : Tensor(), Tensor(), Tensor()};
  }
};

// gate_up_groups / down_groups (a caller's column groups of the weights): the inference forward
// reads them; the training forward reads the weights in place (the same bits).
Tensor moe_experts_ad(const Tensor& x, const Tensor& ids, const Tensor& gate_up, const Tensor& down, int64_t first_expert,
                      int64_t chunks, const std::optional<Tensor>& gate_up_groups,
                      const std::optional<Tensor>& down_groups) {
  if (!any_requires_grad({&x, &gate_up, &down})) {
    static const Below<ExpertsSig> k("tonp::moe_experts");
    return k(x, ids, gate_up, down, first_expert, chunks, gate_up_groups, down_groups);
  }
  return MoeExpertsFn::apply(x, ids, gate_up, down, first_expert, chunks);
}

// --- attention_varlen: causal attention over packed sequences --------------------------------
struct AttentionFn : torch::autograd::Function<AttentionFn> {
  static Tensor forward(AutogradContext* ctx, const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& cu,
                        double scale, int64_t block) {
    static const Below<AttnSig> op("tonp::attention_varlen");
    Tensor out = op(q, k, v, cu, scale, block);
    ctx->save_for_backward({q, k, v, out, cu});
    ctx->saved_data["scale"] = scale;
    return out;
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    static const Below<AttnBwdSig> op("tonp::attention_varlen_backward");
    const auto s = ctx->get_saved_variables();
    auto [dq, dk, dv] = op(grads[0], s[0], s[1], s[2], s[3], s[4], ctx->saved_data["scale"].toDouble());
    return {dq, dk, dv, Tensor(), Tensor(), Tensor()};
  }
};

Tensor attention_varlen_ad(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& cu, double scale,
                           int64_t block) {
  if (!any_requires_grad({&q, &k, &v})) {
    static const Below<AttnSig> op("tonp::attention_varlen");
    return op(q, k, v, cu, scale, block);
  }
  return AttentionFn::apply(q, k, v, cu, scale, block);
}

// --- rope: out = x c + R(x) s (backward: rope_backward, grad_kernels.cpp) ----------------------
struct RopeFn : torch::autograd::Function<RopeFn> {
  static Tensor forward(AutogradContext* ctx, const Tensor& x, const Tensor& cos, const Tensor& sin, const Tensor& pos) {
    static const Below<RopeSig> k("tonp::rope");
    ctx->save_for_backward({cos, sin, pos});
    ctx->saved_data["dtype"] = x.scalar_type();
    return k(x, cos, sin, pos);
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    static const Below<RopeBwdSig> k("tonp::rope_backward");
    const auto saved = ctx->get_saved_variables();
    return {k(grads[0], saved[0], saved[1], saved[2], ctx->saved_data["dtype"].toScalarType()), Tensor(), Tensor(),
            Tensor()};
  }
};

Tensor rope_ad(const Tensor& x, const Tensor& cos, const Tensor& sin, const Tensor& pos) {
  if (!any_requires_grad({&x})) {
    static const Below<RopeSig> k("tonp::rope");
    return k(x, cos, sin, pos);
  }
  return RopeFn::apply(x, cos, sin, pos);
}

}  // namespace

TORCH_LIBRARY_IMPL(tonp, Autograd, m) {
  m.impl("attention_varlen", &attention_varlen_ad);
  m.impl("linear", &linear_ad);
  m.impl("rms_norm", &rms_norm_ad);
  m.impl("silu_mul", &silu_mul_ad);
  m.impl("moe_route", &moe_route_ad);
  m.impl("moe_combine", &moe_combine_ad);
  m.impl("moe_experts", &moe_experts_ad);
  m.impl("rope", &rope_ad);
}

}  // namespace tonp
