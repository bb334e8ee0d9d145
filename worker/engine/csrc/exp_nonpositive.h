// Shared by the CPU kernels (paged_decode_attention.cpp, fused_elementwise.cpp).
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

namespace vlmq {

// exp(x) for the max-subtracted scores of a softmax (x <= 0), written so that the compiler vectorises it (the
// C library's expf is a call per element unless built with -ffast-math, which would also change the rest of
// the file's arithmetic): exp(x) = 2^n * exp(r), n = round(x / ln 2), |r| <= ln 2 / 2, exp(r) by Cephes'
// expf polynomial (within 2 ulp of expf). Below -87 the result is clamped to exp(-87), ~1.6e-38, which a
// softmax cannot tell from 0.
inline float exp_nonpositive(float x) {
  x = std::max(x, -87.f);
  const float n = std::floor(x * 1.44269504088896341f + 0.5f);
  const float r = x - n * 0.693359375f + n * 2.12194440e-4f;  // ln 2 in two parts, for an exact reduction
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.f;
  const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;  // 2^n; n in [-126, 0] after the clamp
  float two_n;
  std::memcpy(&two_n, &bits, sizeof two_n);
  return p * two_n;
}

}  // namespace vlmq
