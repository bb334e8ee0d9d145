// Decode attention straight from the paged KV pool, for the CPU backend (worker/engine/cpu_kernels.py).
//
// The pure-torch path gathers every decode sequence's blocks into a padded [B, L, kv, dim] copy, then runs
// SDPA over it: the keys and values cross memory three times (read, write, read again). Here each
// (sequence, kv head) task reads its keys and values once, from the blocks where they lie, for all the query
// heads that share that kv head (GQA), with a numerically safe softmax (max subtracted) in float.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

namespace {

template <typename scalar_t>
void decode_kernel(const float* q, const scalar_t* k_cache, const scalar_t* v_cache, const int64_t* tables,
                   const int64_t* seq_lens, float* out, int64_t batch, int64_t heads, int64_t kv_heads,
                   int64_t dim, int64_t block_size, int64_t table_width, float scale) {
  const int64_t group = heads / kv_heads;
  const int64_t row = kv_heads * dim;             // one slot of one block: every kv head's vector
  const int64_t block_stride = block_size * row;
  at::parallel_for(0, batch * kv_heads, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores;
    std::vector<float> acc(group * dim);
    for (int64_t task = begin; task < end; ++task) {
      const int64_t b = task / kv_heads, kvh = task % kv_heads;
      const int64_t len = seq_lens[b];
      const int64_t* table = tables + b * table_width;
      scores.assign(group * len, 0.f);
      const float* qb = q + (b * heads + kvh * group) * dim;
      for (int64_t pos = 0; pos < len; ++pos) {
        const scalar_t* key = k_cache + table[pos / block_size] * block_stride + (pos % block_size) * row + kvh * dim;
        for (int64_t g = 0; g < group; ++g) {
          const float* qh = qb + g * dim;
          float dot = 0.f;
#pragma omp simd reduction(+ : dot)
          for (int64_t d = 0; d < dim; ++d) dot += qh[d] * static_cast<float>(key[d]);
          scores[g * len + pos] = dot * scale;
        }
      }
      std::fill(acc.begin(), acc.end(), 0.f);
      std::vector<float> denom(group, 0.f);
      for (int64_t g = 0; g < group; ++g) {
        float* s = scores.data() + g * len;
        float m = -std::numeric_limits<float>::infinity();
        for (int64_t pos = 0; pos < len; ++pos) m = std::max(m, s[pos]);
        float total = 0.f;
        for (int64_t pos = 0; pos < len; ++pos) {
          s[pos] = std::exp(s[pos] - m);
          total += s[pos];
        }
        denom[g] = total;
      }
      for (int64_t pos = 0; pos < len; ++pos) {
        const scalar_t* value = v_cache + table[pos / block_size] * block_stride + (pos % block_size) * row + kvh * dim;
        for (int64_t g = 0; g < group; ++g) {
          const float p = scores[g * len + pos];
          float* a = acc.data() + g * dim;
#pragma omp simd
          for (int64_t d = 0; d < dim; ++d) a[d] += p * static_cast<float>(value[d]);
        }
      }
      for (int64_t g = 0; g < group; ++g) {
        float* o = out + (b * heads + kvh * group + g) * dim;
        const float inv = 1.f / denom[g];
        for (int64_t d = 0; d < dim; ++d) o[d] = acc[g * dim + d] * inv;
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
  q = q.to(torch::kFloat32).contiguous();
  k_cache = k_cache.contiguous();
  v_cache = v_cache.contiguous();
  block_tables = block_tables.to(torch::kInt64).contiguous();
  seq_lens = seq_lens.to(torch::kInt64).contiguous();
  auto out = torch::empty_like(q);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, k_cache.scalar_type(), "paged_decode_attention", [&] {
    decode_kernel<scalar_t>(q.data_ptr<float>(), k_cache.data_ptr<scalar_t>(), v_cache.data_ptr<scalar_t>(),
                            block_tables.data_ptr<int64_t>(), seq_lens.data_ptr<int64_t>(), out.data_ptr<float>(),
                            q.size(0), q.size(1), k_cache.size(2), q.size(2), k_cache.size(1), block_tables.size(1),
                            static_cast<float>(scale));
  });
  return out;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_decode_attention", &paged_decode_attention, "decode attention over a paged KV pool (CPU)");
}
