// Autograd of every differentiable tonp op (linear, rms_norm, silu_mul, rope, attention_varlen,
// moe_route, moe_combine, moe_experts), in C++ so that a call costs a dispatcher hop rather than
// torch.library's Python autograd wrapper (~16 us, most of a small decode step).
//
// Forward = the invariant kernel (redispatched below autograd, so fake tensors and tracing see
// the op itself). Backward = standard torch math in fp32, cast to the input dtypes: gradients
// need to be correct, not invariant (CONTRACT.md).
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

using LinearSig = Tensor(const Tensor&, const Tensor&, const std::optional<Tensor>&, int64_t, std::optional<at::ScalarType>);
using RmsSig = Tensor(const Tensor&, const Tensor&, double);
using SiluSig = Tensor(const Tensor&, const Tensor&);
using RouteSig = std::tuple<Tensor, Tensor>(const Tensor&, int64_t, bool);
using CombineSig = Tensor(const Tensor&, const Tensor&);
using ExpertsSig = Tensor(const Tensor&, const Tensor&, const Tensor&, const Tensor&, int64_t, int64_t);
using RopeSig = Tensor(const Tensor&, const Tensor&, const Tensor&, const Tensor&);
using AttnSig = Tensor(const Tensor&, const Tensor&, const Tensor&, const Tensor&, double, int64_t);
using ExpertsBwdSig = std::tuple<Tensor, Tensor, Tensor>(const Tensor&, const Tensor&, const Tensor&, const Tensor&,
                                                         const Tensor&, int64_t, std::array<bool, 3>);

bool any_requires_grad(std::initializer_list<const Tensor*> ts) {
  if (!at::GradMode::is_enabled()) return false;
  for (const Tensor* t : ts)
    if (t->defined() && t->requires_grad()) return true;
  return false;
}

Tensor cast_like(const Tensor& g, const Tensor& like) { return g.to(like.scalar_type()); }

// --- linear ----------------------------------------------------------------------------------
struct LinearFn : torch::autograd::Function<LinearFn> {
  static Tensor forward(AutogradContext* ctx, const Tensor& x, const Tensor& w, const std::optional<Tensor>& bias,
                        int64_t chunks, std::optional<at::ScalarType> out_dtype) {
    static const Below<LinearSig> k("tonp::linear");
    ctx->save_for_backward({x, w});
    ctx->saved_data["has_bias"] = bias.has_value() && bias->defined();
    if (bias.has_value() && bias->defined()) ctx->saved_data["bias_dtype"] = bias->scalar_type();
    return k(x, w, bias, chunks, out_dtype);
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    // fp32 GEMMs (MKL) even for bf16 tensors: stock bf16 GEMM on these CPUs is ~400x slower.
    const auto saved = ctx->get_saved_variables();
    const Tensor &x = saved[0], &w = saved[1];
    const Tensor g = grads[0].to(at::kFloat);
    Tensor gx, gw, gb;
    if (ctx->needs_input_grad(0)) gx = cast_like(at::matmul(g, w.to(at::kFloat)), x);
    if (ctx->needs_input_grad(1)) gw = cast_like(at::matmul(g.t(), x.to(at::kFloat)), w);
    const bool has_bias = ctx->saved_data["has_bias"].toBool();
    if (has_bias && ctx->needs_input_grad(2)) gb = g.sum(0).to(ctx->saved_data["bias_dtype"].toScalarType());
    return {gx, gw, gb, Tensor(), Tensor()};
  }
};

Tensor linear_ad(const Tensor& x, const Tensor& w, const std::optional<Tensor>& bias, int64_t chunks,
                 std::optional<at::ScalarType> out_dtype) {
  const Tensor none;
  if (!any_requires_grad({&x, &w, bias.has_value() ? &*bias : &none})) {
    static const Below<LinearSig> k("tonp::linear");
    return k(x, w, bias, chunks, out_dtype);
  }
  return LinearFn::apply(x, w, bias, chunks, out_dtype);
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
    const double eps = ctx->saved_data["eps"].toDouble();
    const Tensor xf = x.to(at::kFloat), g = grads[0].to(at::kFloat);
    const Tensor r = at::rsqrt(xf.pow(2).mean(-1, true) + eps);
    const Tensor xhat = xf * r;
    Tensor gx, gw;
    if (ctx->needs_input_grad(1)) gw = cast_like((g * xhat).reshape({-1, x.size(-1)}).sum(0), w);
    if (ctx->needs_input_grad(0)) {
      const Tensor gh = g * w.to(at::kFloat);
      gx = cast_like(r * (gh - xhat * (gh * xhat).mean(-1, true)), x);
    }
    return {gx, gw, Tensor()};
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
std::pair<Tensor, Tensor> silu_mul_grads(const Tensor& gate, const Tensor& up, const Tensor& grad) {
  const Tensor g = gate.to(at::kFloat), u = up.to(at::kFloat), d = grad.to(at::kFloat);
  const Tensor s = at::sigmoid(g);
  const Tensor dg = d * u * (s * (1 + g * (1 - s)));
  const Tensor du = d * (g * s);
  return {dg, du};
}

struct SiluMulFn : torch::autograd::Function<SiluMulFn> {
  static Tensor forward(AutogradContext* ctx, const Tensor& gate, const Tensor& up) {
    static const Below<SiluSig> k("tonp::silu_mul");
    ctx->save_for_backward({gate, up});
    return k(gate, up);
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    auto [dg, du] = silu_mul_grads(saved[0], saved[1], grads[0]);
    return {cast_like(dg, saved[0]), cast_like(du, saved[1])};
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
    const Tensor &logits = saved[0], &ids = saved[1], &w = saved[2];
    const Tensor gw = grads[1].to(at::kFloat);
    const Tensor p = at::softmax(logits.to(at::kFloat), -1);
    Tensor dpk = gw;
    if (ctx->saved_data["normalize"].toBool()) {  // w = pk / S: d pk_j = (gw_j - sum_i gw_i w_i) / S
      const Tensor S = p.gather(-1, ids).sum(-1, true);
      dpk = (gw - (gw * w).sum(-1, true)) / S;
    }
    const Tensor dp = at::zeros_like(p).scatter_(-1, ids, dpk);
    const Tensor dl = p * (dp - (dp * p).sum(-1, true));
    return {cast_like(dl, logits), Tensor(), Tensor()};
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
    const Tensor &w = saved[0], &y = saved[1];
    const Tensor g = grads[0].to(at::kFloat).unsqueeze(1);  // [M, 1, H]
    Tensor gw, gy;
    if (ctx->needs_input_grad(0)) gw = cast_like((g * y.to(at::kFloat)).sum(-1), w);
    if (ctx->needs_input_grad(1)) gy = cast_like(w.to(at::kFloat).unsqueeze(-1) * g, y);
    return {gw, gy};
  }
};

Tensor moe_combine_ad(const Tensor& w, const Tensor& y) {
  if (!any_requires_grad({&w, &y})) {
    static const Below<CombineSig> k("tonp::moe_combine");
    return k(w, y);
  }
  return MoeCombineFn::apply(w, y);
}

// The backward of moe_experts (tonp::moe_experts_backward, for CPU and accelerator tensors): per expert, in fp32,
// recomputing gate_up (one GEMM) rather than keeping [rows, 2I] alive. Weight gradients are
// written expert by expert into tensors of the weights' dtype (an fp32 [E, 2I, H] scratch would
// be gigabytes at 128 experts); experts without rows get zeros. Unwanted gradients come back
// as empty tensors.
std::tuple<Tensor, Tensor, Tensor> moe_experts_backward(const Tensor& grad, const Tensor& x, const Tensor& ids,
                                                        const Tensor& gate_up, const Tensor& down, int64_t first,
                                                        std::array<bool, 3> want) {
  const int64_t Kk = ids.size(1), H = x.size(1), E = gate_up.size(0), I = down.size(2);
  const Tensor xf = x.to(at::kFloat), gy = grad.to(at::kFloat).reshape({-1, H});
  const Tensor flat = ids.reshape({-1}) - first;
  const Tensor order = std::get<1>(flat.sort(/*stable=*/true, 0, false));
  const Tensor count_t = at::bincount(flat, {}, E).to(at::kCPU);  // read on the host, whatever the device
  const int64_t* counts = count_t.data_ptr<int64_t>();
  Tensor gx = want[0] ? at::zeros_like(xf) : Tensor();
  Tensor ggu = want[1] ? at::empty(gate_up.sizes(), gate_up.options()) : Tensor();
  Tensor gdn = want[2] ? at::empty(down.sizes(), down.options()) : Tensor();
  auto store = [](Tensor dst, const Tensor& a, const Tensor& b) {  // dst = a @ b
    if (dst.scalar_type() == at::kFloat)
      at::mm_out(dst, a, b);
    else
      dst.copy_(at::mm(a, b));
  };
  int64_t s = 0;
  for (int64_t e = 0; e < E; ++e) {
    const int64_t n = counts[e];
    if (n == 0) {
      if (want[1]) ggu[e].zero_();
      if (want[2]) gdn[e].zero_();
      continue;
    }
    const Tensor rows = order.slice(0, s, s + n), tok = rows.div(Kk, "floor");
    s += n;
    const Tensor xe = xf.index_select(0, tok), ge = gy.index_select(0, rows);
    const Tensor wgu = gate_up[e].to(at::kFloat), wdn = down[e].to(at::kFloat);
    const Tensor gu = at::mm(xe, wgu.t());
    const Tensor g = gu.slice(1, 0, I), u = gu.slice(1, I, 2 * I);
    if (want[2]) store(gdn[e], ge.t(), at::silu(g) * u);
    auto [dg, du] = silu_mul_grads(g, u, at::mm(ge, wdn));
    const Tensor dgu = at::cat({dg, du}, 1);
    if (want[1]) store(ggu[e], dgu.t(), xe);
    if (want[0]) gx.index_add_(0, tok, at::mm(dgu, wgu));
  }
  return {want[0] ? cast_like(gx, x) : x.new_empty({0}), want[1] ? ggu : gate_up.new_empty({0}),
          want[2] ? gdn : down.new_empty({0})};
}

// --- moe_experts: y[m, k] = down_e(silu(gate_e(x[m])) * up_e(x[m])), e = ids[m, k] -------------
struct MoeExpertsFn : torch::autograd::Function<MoeExpertsFn> {
  static Tensor forward(AutogradContext* ctx, const Tensor& x, const Tensor& ids, const Tensor& gate_up,
                        const Tensor& down, int64_t first_expert, int64_t chunks) {
    static const Below<ExpertsSig> k("tonp::moe_experts");
    ctx->save_for_backward({x, ids, gate_up, down});
    ctx->saved_data["first"] = first_expert;
    return k(x, ids, gate_up, down, first_expert, chunks);
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    // An op of its own (tonp::moe_experts_backward, below): its per-expert loop depends on the
    // routing, so traced graphs must see it as one opaque call with a fake implementation.
    static const Below<ExpertsBwdSig> k("tonp::moe_experts_backward");
    const auto saved = ctx->get_saved_variables();
    const std::array<bool, 3> want{ctx->needs_input_grad(0), ctx->needs_input_grad(2), ctx->needs_input_grad(3)};
    auto [gx, ggu, gdn] = k(grads[0], saved[0], saved[1], saved[2], saved[3], ctx->saved_data["first"].toInt(), want);
    return {want[0] ? gx : Tensor(), Tensor(), want[1] ? ggu : Tensor(), want[2] ? gdn : Tensor(), Tensor(), Tensor()};
  }
};

Tensor moe_experts_ad(const Tensor& x, const Tensor& ids, const Tensor& gate_up, const Tensor& down, int64_t first_expert,
                      int64_t chunks) {
  if (!any_requires_grad({&x, &gate_up, &down})) {
    static const Below<ExpertsSig> k("tonp::moe_experts");
    return k(x, ids, gate_up, down, first_expert, chunks);
  }
  return MoeExpertsFn::apply(x, ids, gate_up, down, first_expert, chunks);
}

// --- rope: out = x * c + R(x) * s, R(x) = cat(-x2, x1); so dx = g * c + R^T(g * s), R^T(y) = cat(y2, -y1)
struct RopeFn : torch::autograd::Function<RopeFn> {
  static Tensor forward(AutogradContext* ctx, const Tensor& x, const Tensor& cos, const Tensor& sin, const Tensor& pos) {
    static const Below<RopeSig> k("tonp::rope");
    ctx->save_for_backward({cos, sin, pos});
    ctx->saved_data["dtype"] = x.scalar_type();
    return k(x, cos, sin, pos);
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    const auto dt = ctx->saved_data["dtype"].toScalarType();
    const Tensor c = saved[0].index_select(0, saved[2]).to(dt).to(at::kFloat).unsqueeze(1);  // [T, 1, D]
    const Tensor s = saved[1].index_select(0, saved[2]).to(dt).to(at::kFloat).unsqueeze(1);
    const Tensor g = grads[0].to(at::kFloat), gs = g * s;
    const int64_t half = g.size(-1) / 2;
    const Tensor rt = at::cat({gs.slice(-1, half), -gs.slice(-1, 0, half)}, -1);
    return {(g * c + rt).to(dt), Tensor(), Tensor(), Tensor()};
  }
};

Tensor rope_ad(const Tensor& x, const Tensor& cos, const Tensor& sin, const Tensor& pos) {
  if (!any_requires_grad({&x})) {
    static const Below<RopeSig> k("tonp::rope");
    return k(x, cos, sin, pos);
  }
  return RopeFn::apply(x, cos, sin, pos);
}

// --- attention_varlen: backward = autograd of per-sequence causal SDPA in fp32 ----------------
// (torch's fused attention backward is several times faster than differentiating dense math).
Tensor attention_math(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& cu_seqlens, double scale) {
  const Tensor qf = q.to(at::kFloat), kf = k.to(at::kFloat), vf = v.to(at::kFloat);
  Tensor out = at::empty_like(qf);
  const Tensor cu = cu_seqlens.to(at::kCPU).to(at::kLong).contiguous();  // offsets read on the host
  const int64_t* c = cu.data_ptr<int64_t>();
  for (int64_t s = 0; s + 1 < cu.numel(); ++s) {
    if (c[s + 1] <= c[s]) continue;
    auto seq = [&](const Tensor& t) { return t.slice(0, c[s], c[s + 1]).transpose(0, 1); };  // [heads, L, D]
    out.slice(0, c[s], c[s + 1]).copy_(at::scaled_dot_product_attention(seq(qf), seq(kf), seq(vf), {}, 0.0,
                                                                         /*is_causal=*/true, scale, /*enable_gqa=*/true)
                                           .transpose(0, 1));
  }
  return out.to(q.scalar_type());
}

struct AttentionVarlenFn : torch::autograd::Function<AttentionVarlenFn> {
  static Tensor forward(AutogradContext* ctx, const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& cu,
                        double scale, int64_t block) {
    static const Below<AttnSig> kern("tonp::attention_varlen");
    ctx->save_for_backward({q, k, v, cu});
    ctx->saved_data["scale"] = scale;
    return kern(q, k, v, cu, scale, block);
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    at::AutoGradMode enable(true);
    variable_list ins, want;
    for (int i = 0; i < 3; ++i) {
      ins.push_back(saved[i].detach().requires_grad_(ctx->needs_input_grad(i)));
      if (ctx->needs_input_grad(i)) want.push_back(ins.back());
    }
    variable_list res(6);
    if (want.empty()) return res;
    const Tensor out = attention_math(ins[0], ins[1], ins[2], saved[3], ctx->saved_data["scale"].toDouble());
    const auto got = torch::autograd::grad({out}, want, {grads[0]}, std::nullopt, false, /*allow_unused=*/true);
    for (int i = 0, j = 0; i < 3; ++i)
      if (ctx->needs_input_grad(i)) res[i] = got[j++];
    return res;
  }
};

Tensor attention_varlen_ad(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& cu, double scale, int64_t block) {
  if (!any_requires_grad({&q, &k, &v})) {
    static const Below<AttnSig> kern("tonp::attention_varlen");
    return kern(q, k, v, cu, scale, block);
  }
  return AttentionVarlenFn::apply(q, k, v, cu, scale, block);
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

TORCH_LIBRARY_IMPL(tonp, CPU, m) { m.impl("moe_experts_backward", &moe_experts_backward); }
// The same torch math on accelerator tensors (the forward there is the Triton kernel).
TORCH_LIBRARY_IMPL(tonp, CUDA, m) { m.impl("moe_experts_backward", &moe_experts_backward); }
TORCH_LIBRARY_IMPL(tonp, PrivateUse1, m) { m.impl("moe_experts_backward", &moe_experts_backward); }

}  // namespace tonp
