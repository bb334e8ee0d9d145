// RMSNorm, SiLU-and-multiply and rotary position embedding in one pass each, for the CPU backend
// (worker/engine/cpu_fused.py, worker/engine/cpu_rope.py).
//
// HF's RMSNorm is seven ops (a cast to float, pow, mean, add, rsqrt, mul, a cast back, mul by the weight) and
// its MLP's act_fn(gate) * up two, each a pass over memory with its own dispatch and thread start: on 256 rows
// of 512 in bf16 the norm took ~0.6 ms where its data is 256 KB. Here each row is read once and written once.
// The arithmetic follows HF's order and roundings: the norm in float, rounded to the input's dtype, then
// multiplied by the weight and rounded again; silu rounded to the dtype before the product. Only the sum of
// squares is added in another order, and the sigmoid's exp is exp_nonpositive's (within 2 ulp of expf).
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <cmath>
#include <cstdint>
#include <cstring>

#include "exp_nonpositive.h"

namespace {

using vlmq::exp_nonpositive;

// Conversions the compiler can vectorise: c10's own for bfloat16 branch per element (NaN), which kept these
// loops scalar (SiLU-and-multiply 8x slower than torch's two ops, the norm 3.7x slower than with these). Round
// to nearest even, a NaN kept a (quiet) NaN, as c10 does.
template <typename scalar_t>
inline float to_float(scalar_t x) {
  return static_cast<float>(x);
}

template <>
inline float to_float<at::BFloat16>(at::BFloat16 x) {
  const uint32_t bits = static_cast<uint32_t>(x.x) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}

template <typename scalar_t>
inline scalar_t from_float(float x) {
  return static_cast<scalar_t>(x);
}

template <>
inline at::BFloat16 from_float<at::BFloat16>(float x) {
  uint32_t bits;
  std::memcpy(&bits, &x, sizeof bits);
  const uint32_t rounded = (bits + 0x7FFFu + ((bits >> 16) & 1u)) >> 16;
  const bool nan = (bits & 0x7FFFFFFFu) > 0x7F800000u;
  return at::BFloat16(static_cast<uint16_t>(nan ? 0x7FC0u : rounded), at::BFloat16::from_bits());
}

template <typename scalar_t>
inline float round_to(float x) {
  return to_float<scalar_t>(from_float<scalar_t>(x));
}

template <typename scalar_t>
void rms_norm_kernel(const scalar_t* x, const scalar_t* weight, scalar_t* out, int64_t rows, int64_t n,
                     float eps) {
  at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const scalar_t* xr = x + r * n;
      scalar_t* o = out + r * n;
      float squares = 0.f;
#pragma omp simd reduction(+ : squares)
      for (int64_t i = 0; i < n; ++i) {
        const float v = to_float<scalar_t>(xr[i]);
        squares += v * v;
      }
      const float inv = 1.f / std::sqrt(squares / static_cast<float>(n) + eps);
#pragma omp simd
      for (int64_t i = 0; i < n; ++i) {
        const float normed = round_to<scalar_t>(to_float<scalar_t>(xr[i]) * inv);
        o[i] = from_float<scalar_t>(to_float<scalar_t>(weight[i]) * normed);
      }
    }
  });
}

template <typename scalar_t>
void silu_and_mul_kernel(const scalar_t* gate, const scalar_t* up, scalar_t* out, int64_t rows, int64_t n,
                         int64_t gate_stride, int64_t up_stride) {
  at::parallel_for(0, rows, 4, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const scalar_t* g = gate + r * gate_stride;
      const scalar_t* u = up + r * up_stride;
      scalar_t* o = out + r * n;
#pragma omp simd
      for (int64_t i = 0; i < n; ++i) {
        const float v = to_float<scalar_t>(g[i]);
        const float e = exp_nonpositive(-std::fabs(v));  // exp(-|v|) <= 1: no overflow either side
        const float sigmoid = (v >= 0.f ? 1.f : e) / (1.f + e);
        o[i] = from_float<scalar_t>(round_to<scalar_t>(v * sigmoid) * to_float<scalar_t>(u[i]));
      }
    }
  });
}

// One row of HF's rotary embedding, q * cos + rotate_half(q) * sin, with rotate_half(q) = cat(-q2, q1): each
// product rounded to the dtype, then the sum. Not contracted into fused multiply-adds, which round once where
// HF rounds twice: with them fp32 results part from HF's in the last bit.
template <typename scalar_t>
__attribute__((optimize("fp-contract=off"))) void rotary_row(const scalar_t* x, const scalar_t* cos,
                                                             const scalar_t* sin, scalar_t* out, int64_t half) {
#pragma omp simd
  for (int64_t i = 0; i < half; ++i) {
    const float a = round_to<scalar_t>(to_float<scalar_t>(x[i]) * to_float<scalar_t>(cos[i]));
    const float b = round_to<scalar_t>(-to_float<scalar_t>(x[i + half]) * to_float<scalar_t>(sin[i]));
    out[i] = from_float<scalar_t>(a + b);
  }
#pragma omp simd
  for (int64_t i = half; i < 2 * half; ++i) {
    const float a = round_to<scalar_t>(to_float<scalar_t>(x[i]) * to_float<scalar_t>(cos[i]));
    const float b = round_to<scalar_t>(to_float<scalar_t>(x[i - half]) * to_float<scalar_t>(sin[i]));
    out[i] = from_float<scalar_t>(a + b);
  }
}

// x [T, heads, dim] (any token and head strides, contiguous dim); cos, sin [T, dim]; out [T, heads, dim].
template <typename scalar_t>
void rotary_kernel(const torch::Tensor& x, const torch::Tensor& cos, const torch::Tensor& sin, torch::Tensor& out) {
  const int64_t tokens = x.size(0), heads = x.size(1), dim = x.size(2);
  const int64_t token_stride = x.stride(0), head_stride = x.stride(1), cos_stride = cos.stride(0);
  const scalar_t* xp = x.data_ptr<scalar_t>();
  const scalar_t* cp = cos.data_ptr<scalar_t>();
  const scalar_t* sp = sin.data_ptr<scalar_t>();
  scalar_t* op = out.data_ptr<scalar_t>();
  at::parallel_for(0, tokens * heads, 64, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const int64_t t = r / heads, h = r % heads;
      rotary_row<scalar_t>(xp + t * token_stride + h * head_stride, cp + t * cos_stride, sp + t * cos_stride,
                           op + r * dim, dim / 2);
    }
  });
}

void check_rows(const torch::Tensor& t, const char* name) {
  TORCH_CHECK(t.device().is_cpu(), name, " must be on the CPU");
  TORCH_CHECK(t.dim() == 2 && t.stride(1) == 1, name, " must be rows with contiguous columns");
}

}  // namespace

// x [rows, n], weight [n], both of one floating dtype. Returns weight * rms_normalised(x), as HF's RMSNorm.
torch::Tensor rms_norm(torch::Tensor x, torch::Tensor weight, double eps) {
  x = x.contiguous();
  check_rows(x, "x");
  TORCH_CHECK(weight.dim() == 1 && weight.size(0) == x.size(1), "weight must be [n]");
  TORCH_CHECK(weight.scalar_type() == x.scalar_type(), "x and weight must share a dtype");
  weight = weight.contiguous();
  auto out = torch::empty_like(x);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "rms_norm", [&] {
    rms_norm_kernel<scalar_t>(x.data_ptr<scalar_t>(), weight.data_ptr<scalar_t>(), out.data_ptr<scalar_t>(),
                              x.size(0), x.size(1), static_cast<float>(eps));
  });
  return out;
}

// gate, up [rows, n] of one dtype (row strides may differ: halves of one fused projection). Returns
// silu(gate) * up, as HF's Llama-style MLP computes it.
torch::Tensor silu_and_mul(torch::Tensor gate, torch::Tensor up) {
  check_rows(gate, "gate");
  check_rows(up, "up");
  TORCH_CHECK(gate.sizes() == up.sizes(), "gate and up must have one shape");
  TORCH_CHECK(gate.scalar_type() == up.scalar_type(), "gate and up must share a dtype");
  auto out = torch::empty(gate.sizes(), gate.options());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, gate.scalar_type(), "silu_and_mul", [&] {
    silu_and_mul_kernel<scalar_t>(gate.data_ptr<scalar_t>(), up.data_ptr<scalar_t>(), out.data_ptr<scalar_t>(),
                                  gate.size(0), gate.size(1), gate.stride(0), up.stride(0));
  });
  return out;
}

// x [T, heads, dim] (a view of a projection's output: strides of tokens and heads free, dim contiguous), cos and
// sin [T, dim] of x's dtype. Returns x rotated as HF's apply_rotary_pos_emb does, [T, heads, dim] contiguous.
torch::Tensor rotary_embedding(torch::Tensor x, torch::Tensor cos, torch::Tensor sin) {
  TORCH_CHECK(x.device().is_cpu() && cos.device().is_cpu() && sin.device().is_cpu(), "tensors must be on the CPU");
  TORCH_CHECK(x.dim() == 3 && x.stride(2) == 1, "x must be [tokens, heads, dim] with contiguous dim");
  TORCH_CHECK(x.size(2) % 2 == 0, "dim must be even");
  TORCH_CHECK(cos.dim() == 2 && cos.size(0) == x.size(0) && cos.size(1) == x.size(2) && cos.sizes() == sin.sizes(),
              "cos and sin must be [tokens, dim]");
  TORCH_CHECK(cos.scalar_type() == x.scalar_type() && sin.scalar_type() == x.scalar_type(),
              "x, cos and sin must share a dtype");
  cos = cos.contiguous();
  sin = sin.contiguous();
  auto out = torch::empty(x.sizes(), x.options());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "rotary_embedding", [&] {
    rotary_kernel<scalar_t>(x, cos, sin, out);
  });
  return out;
}
