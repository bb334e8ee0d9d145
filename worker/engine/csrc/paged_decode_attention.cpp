// Decode attention straight from the paged KV pool, for the CPU backend (worker/engine/cpu_kernels.py).
//
// The pure-torch path gathers every decode sequence's blocks into a padded [B, L, kv, dim] copy, then runs
// SDPA over it: the keys and values cross memory three times (read, write, read again). Here each task reads
// one sequence's keys and values once, slot by slot as they lie in its blocks (every kv head of a slot is
// contiguous, so a task covering all of them streams whole blocks), for all the query heads that share each
// kv head (GQA), with a max-subtracted softmax in float. A task per sequence streamed 2-2.5x faster than a
// task per (sequence, kv head), which read each slot in 256-byte pieces; kv heads are split across tasks only
// when there are too few sequences to keep every thread busy.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "exp_nonpositive.h"

namespace {

using vlmq::exp_nonpositive;

template <typename scalar_t>
void decode_kernel(const float* q, const scalar_t* k_cache, const scalar_t* v_cache, const int64_t* tables,
                   const int64_t* seq_lens, float* out, int64_t batch, int64_t heads, int64_t kv_heads,
                   int64_t dim, int64_t block_size, int64_t table_width, float scale) {
  const int64_t group = heads / kv_heads;
  const int64_t row = kv_heads * dim;  // one slot of one block: every kv head's vector
  const int64_t block_stride = block_size * row;
  const int64_t want_tasks = 4 * static_cast<int64_t>(at::get_num_threads());
  const int64_t chunks = std::min(kv_heads, std::max<int64_t>(1, (want_tasks + batch - 1) / batch));
  const int64_t per_chunk = (kv_heads + chunks - 1) / chunks;
  at::parallel_for(0, batch * chunks, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores, acc, denom;
    for (int64_t task = begin; task < end; ++task) {
      const int64_t b = task / chunks, chunk = task % chunks;
      const int64_t kv0 = chunk * per_chunk, kv1 = std::min(kv_heads, kv0 + per_chunk);
      if (kv0 >= kv1) continue;
      const int64_t h0 = kv0 * group, nh = (kv1 - kv0) * group;  // the query heads of this task
      const int64_t len = seq_lens[b];
      const int64_t* table = tables + b * table_width;
      const float* qb = q + (b * heads + h0) * dim;
      scores.resize(nh * len);
      for (int64_t pos = 0; pos < len; ++pos) {
        const scalar_t* keys = k_cache + table[pos / block_size] * block_stride + (pos % block_size) * row;
        for (int64_t h = 0; h < nh; ++h) {
          const scalar_t* key = keys + (kv0 + h / group) * dim;
          const float* qh = qb + h * dim;
          float dot = 0.f;
#pragma omp simd reduction(+ : dot)
          for (int64_t d = 0; d < dim; ++d) dot += qh[d] * static_cast<float>(key[d]);
          scores[h * len + pos] = dot * scale;
        }
      }
      denom.assign(nh, 0.f);
      for (int64_t h = 0; h < nh; ++h) {
        float* s = scores.data() + h * len;
        float m = s[0];
#pragma omp simd reduction(max : m)
        for (int64_t pos = 1; pos < len; ++pos) m = std::max(m, s[pos]);
        float total = 0.f;
#pragma omp simd reduction(+ : total)
        for (int64_t pos = 0; pos < len; ++pos) {
          s[pos] = exp_nonpositive(s[pos] - m);
          total += s[pos];
        }
        denom[h] = total;
      }
      acc.assign(nh * dim, 0.f);
      for (int64_t pos = 0; pos < len; ++pos) {
        const scalar_t* values = v_cache + table[pos / block_size] * block_stride + (pos % block_size) * row;
        for (int64_t h = 0; h < nh; ++h) {
          const scalar_t* value = values + (kv0 + h / group) * dim;
          const float p = scores[h * len + pos];
          float* a = acc.data() + h * dim;
#pragma omp simd
          for (int64_t d = 0; d < dim; ++d) a[d] += p * static_cast<float>(value[d]);
        }
      }
      for (int64_t h = 0; h < nh; ++h) {
        float* o = out + (b * heads + h0 + h) * dim;
        const float inv = 1.f / denom[h];
        for (int64_t d = 0; d < dim; ++d) o[d] = acc[h * dim + d] * inv;
      }
    }
  });
}

}  // namespace

// q [B, heads, dim] float32; k_cache, v_cache [blocks, block_size, kv_heads, dim]; block_tables [B, width]
// int64; seq_lens [B] int64 (keys per sequence, at least 1). Returns [B, heads, dim] float32.
torch::Tensor paged_decode_attention(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache,
                                     torch::Tensor block_tables, torch::Tensor seq_lens, double scale) {
  TORCH_CHECK(q.device().is_cpu() && k_cache.device().is_cpu(), "paged_decode_attention runs on the CPU");
  TORCH_CHECK(q.dim() == 3 && k_cache.dim() == 4 && v_cache.sizes() == k_cache.sizes(), "bad shapes");
  TORCH_CHECK(q.size(1) % k_cache.size(2) == 0, "query heads must be a multiple of kv heads");
  TORCH_CHECK(q.size(2) == k_cache.size(3), "query and key head sizes differ");
  TORCH_CHECK(block_tables.size(0) == q.size(0) && seq_lens.size(0) == q.size(0), "one table and length per query");
  q = q.to(torch::kFloat32).contiguous();
  k_cache = k_cache.contiguous();
  v_cache = v_cache.contiguous();
  block_tables = block_tables.to(torch::kInt64).contiguous();
  seq_lens = seq_lens.to(torch::kInt64).contiguous();
  TORCH_CHECK(seq_lens.numel() == 0 || seq_lens.min().item<int64_t>() >= 1, "every sequence needs a key");
  TORCH_CHECK(seq_lens.numel() == 0 ||
              seq_lens.max().item<int64_t>() <= block_tables.size(1) * k_cache.size(1), "a length beyond its table");
  auto out = torch::empty_like(q);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, k_cache.scalar_type(), "paged_decode_attention", [&] {
    decode_kernel<scalar_t>(q.data_ptr<float>(), k_cache.data_ptr<scalar_t>(), v_cache.data_ptr<scalar_t>(),
                            block_tables.data_ptr<int64_t>(), seq_lens.data_ptr<int64_t>(), out.data_ptr<float>(),
                            q.size(0), q.size(1), k_cache.size(2), q.size(2), k_cache.size(1), block_tables.size(1),
                            static_cast<float>(scale));
  });
  return out;
}
