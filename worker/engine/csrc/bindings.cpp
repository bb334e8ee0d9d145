// The CPU kernels' Python module (worker/engine/cpu_kernels.py). One extension built from each kernel's own
// source, so that ninja compiles them side by side on first use (66 s on 2 CPUs, where the two as extensions of
// their own took 55 + 60 s one after the other).
#include <torch/extension.h>

torch::Tensor paged_decode_attention(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache,
                                     torch::Tensor block_tables, torch::Tensor seq_lens, double scale);
torch::Tensor rms_norm(torch::Tensor x, torch::Tensor weight, double eps);
torch::Tensor silu_and_mul(torch::Tensor gate, torch::Tensor up);
torch::Tensor rotary_embedding(torch::Tensor x, torch::Tensor cos, torch::Tensor sin);

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_decode_attention", &paged_decode_attention, "decode attention over a paged KV pool (CPU)");
  m.def("rms_norm", &rms_norm, "HF-style RMSNorm of rows, in one pass (CPU)");
  m.def("silu_and_mul", &silu_and_mul, "silu(gate) * up in one pass (CPU)");
  m.def("rotary_embedding", &rotary_embedding, "HF-style rotary position embedding in one pass (CPU)");
}
