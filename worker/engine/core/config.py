"""Engine configuration: memory and batching limits. No torch."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class EngineConfig:
    block_size: int = 16                 # tokens per KV block
    num_kv_blocks: int | None = None     # KV pool size in blocks; None: derive from kv_cache_fraction
    kv_cache_fraction: float = 0.3       # of free device memory (or of RAM on CPU) when num_kv_blocks is None
    max_num_seqs: int = 64               # requests running at once
    max_num_batched_tokens: int = 2048   # tokens (prefill chunks + decodes) per step
    max_encoder_items_per_step: int = 64  # images through the vision tower per step
    encoder_cache_tokens: int = 32768    # image embeddings kept, counted in LM positions
    enable_prefix_caching: bool = True
    overlap_vision: bool | None = None   # vision on its own CUDA stream; None: on when the device is CUDA
    cpu_attention_kernel: bool = True    # on CPU, decode attention by the C++ kernel where it builds
    cpu_packed_linear: bool = True       # on CPU (fp32), linear layers with oneDNN pre-packed weights
    cpu_fused_elementwise: bool = True   # on CPU, RMSNorm and SiLU-and-multiply by one-pass C++ kernels
    # Decoder layers compiled by torch.compile (worker/engine/layer_compiler.py); cpu_packed_linear then
    # applies outside them only (vision tower, projector, head). Compiling takes seconds at the first steps.
    compile_layers: bool = False
    # While requests still arrive (one came within this many seconds) and the batch has room, the service
    # waits up to this long for the next before stepping: fewer, fuller steps under a trickle. 0: never.
    step_linger_seconds: float = 0.005

    def __post_init__(self) -> None:
        if self.block_size < 1 or self.max_num_seqs < 1 or self.max_num_batched_tokens < 1:
            raise ValueError("block_size, max_num_seqs and max_num_batched_tokens must be >= 1")
        if self.num_kv_blocks is not None and self.num_kv_blocks < 1:
            raise ValueError("num_kv_blocks must be >= 1")
        if not 0 < self.kv_cache_fraction <= 0.95:
            raise ValueError("kv_cache_fraction must be in (0, 0.95]")
        if self.max_encoder_items_per_step < 1 or self.encoder_cache_tokens < 1:
            raise ValueError("encoder budgets must be >= 1")
        if not 0 <= self.step_linger_seconds <= 1:
            raise ValueError("step_linger_seconds must be in [0, 1]")
