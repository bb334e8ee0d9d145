"""The vlmq engine on a lent GPU, with random-weight models of real shapes built in bf16 on the device (no
download): 100 jobs with one 448 px image each against the same jobs text-only, at 4 and 64 concurrent.

    python bench/gpu/run.py                       # on the GPU: internvl2-2b, then internvl2-26b if memory allows
    python bench/gpu/run.py --shape tiny --device cpu --dtype float32 --jobs 8   # the script's own check, here

Reports per shape and concurrency: jobs/s, TTFT (median, p90), the image/text throughput ratio (the report
this project answers saw 0.43 with lmdeploy 0.5.1 on an A100), vision MFU (a batched vision forward's FLOP/s
over the device's bf16 GEMM peak measured in the same run) and decode bandwidth utilisation (bytes a decode
step must read, weights + KV, over its time, against the device's copy bandwidth measured in the same run).
Budget: under 8 minutes on an H200 (bench/gpu/run.sh wraps it with a timeout).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
from PIL import Image  # noqa: E402


@dataclass(frozen=True)
class Shape:
    vision_hidden: int
    vision_layers: int
    vision_heads: int
    vision_inter: int
    text_hidden: int
    text_layers: int
    text_heads: int
    text_kv_heads: int
    text_inter: int
    vocab: int
    image_size: int = 448
    patch: int = 14


SHAPES = {
    # InternViT-300M + InternLM2-1.8B (InternVL2-2B)
    "internvl2-2b": Shape(1024, 24, 16, 4096, 2048, 24, 16, 8, 8192, 92553),
    # InternViT-6B + InternLM2-20B (InternVL2-26B)
    "internvl2-26b": Shape(3200, 45, 25, 12800, 6144, 48, 48, 8, 16384, 92553),
    # the script's own check on a CPU
    "tiny": Shape(64, 2, 4, 128, 128, 2, 4, 2, 256, 1200, image_size=56, patch=14),
}


def build(shape: Shape, device: str, dtype: torch.dtype, work: Path) -> Any:
    """An InternVL with `shape`'s sizes, random weights made on `device`, with a tokenizer and processor
    built offline; one 448 px tile per image (256 tokens after pixel shuffle)."""
    from transformers import (
        GotOcr2ImageProcessorPil,
        InternVLConfig,
        InternVLForConditionalGeneration,
        InternVLProcessor,
        InternVLVisionConfig,
        Qwen2Config,
    )

    from tests.tiny_families import INTERNVL_CHAT_TEMPLATE, INTERNVL_TOKENS, build_tiny_internvl
    from worker.inference.model_loader import LoadedModel, image_only_processor_class, load_processor

    tiny = build_tiny_internvl(work / "tokenizer-source", seed=0)  # for its tokenizer and chat template
    tokenizer = load_processor(str(tiny)).tokenizer
    tokens = (shape.image_size // shape.patch) ** 2 // 4
    vision = InternVLVisionConfig(hidden_size=shape.vision_hidden, intermediate_size=shape.vision_inter,
                                  num_hidden_layers=shape.vision_layers, num_attention_heads=shape.vision_heads,
                                  image_size=shape.image_size, patch_size=shape.patch)
    text = Qwen2Config(hidden_size=shape.text_hidden, intermediate_size=shape.text_inter,
                       num_hidden_layers=shape.text_layers, num_attention_heads=shape.text_heads,
                       num_key_value_heads=shape.text_kv_heads, vocab_size=max(shape.vocab, len(tokenizer)),
                       max_position_embeddings=4096)
    config = InternVLConfig(vision_config=vision, text_config=text, image_seq_length=tokens, downsample_ratio=0.5,
                            image_token_id=tokenizer.convert_tokens_to_ids(INTERNVL_TOKENS["context_image_token"]),
                            vision_feature_layer=-1, vision_feature_select_strategy="default")
    default = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = InternVLForConditionalGeneration(config)
    finally:
        torch.set_default_dtype(default)
    model.eval()
    processor = image_only_processor_class(InternVLProcessor)(
        image_processor=GotOcr2ImageProcessorPil(size={"height": shape.image_size, "width": shape.image_size},
                                                 crop_to_patches=False),
        tokenizer=tokenizer, image_seq_length=tokens, chat_template=INTERNVL_CHAT_TEMPLATE)
    # No end-of-sequence: every job generates exactly max_tokens, so runs compare like for like.
    return LoadedModel(model=model, processor=processor, tokenizer=tokenizer,
                       image_token_id=config.image_token_id, eos_token_ids=[], name="random")


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def gemm_peak(device: str, dtype: torch.dtype) -> float:
    n = 8192 if device.startswith("cuda") else 1024
    a, b = torch.randn(n, n, device=device, dtype=dtype), torch.randn(n, n, device=device, dtype=dtype)
    times = []
    for _ in range(10):
        sync(device)
        start = time.perf_counter()
        torch.mm(a, b)
        sync(device)
        times.append(time.perf_counter() - start)
    return 2 * n**3 / statistics.median(times[2:])


def copy_bandwidth(device: str) -> float:
    x = torch.empty(1 << (30 if device.startswith("cuda") else 26), dtype=torch.uint8, device=device)
    y = torch.empty_like(x)
    times = []
    for _ in range(10):
        sync(device)
        start = time.perf_counter()
        y.copy_(x)
        sync(device)
        times.append(time.perf_counter() - start)
    return 2 * x.numel() / statistics.median(times[2:])  # read + write


def make_jobs(n: int, with_image: bool, max_tokens: int, size: int) -> list[Any]:
    from worker.inference.generation import GenerationRequest, SamplingParams

    gen = torch.Generator().manual_seed(0)
    jobs = []
    for i in range(n):
        pixels = (torch.rand(size, size, 3, generator=gen) * 255).to(torch.uint8).numpy()
        content: list[dict[str, Any]] = [{"type": "text", "text": f"Describe image {i} in detail, please."}]
        images = []
        if with_image:
            content.insert(0, {"type": "image"})
            images = [Image.fromarray(pixels)]
        jobs.append(GenerationRequest(f"job-{i}", [{"role": "user", "content": content}], images,
                                      SamplingParams(max_tokens=max_tokens)))
    return jobs


def run_engine(loaded: Any, jobs: list[Any], concurrency: int, device: str) -> dict[str, float]:
    """All jobs submitted at once, `concurrency` sequences decoding together; TTFT from submission."""
    from worker.engine.core.config import EngineConfig
    from worker.engine.engine import Engine

    engine = Engine(loaded, EngineConfig(max_num_seqs=concurrency, max_num_batched_tokens=8192,
                                         max_encoder_items_per_step=64, kv_cache_fraction=0.5))
    execute = engine.runner.execute
    first_token: dict[str, float] = {}
    decode_steps: list[tuple[float, int]] = []  # (seconds, context tokens read) of decode-only steps

    def timed_execute(out: Any) -> dict[str, int]:
        sync(device)
        start = time.perf_counter()
        sampled = execute(out)
        sync(device)
        now = time.perf_counter()
        for request_id in sampled:
            first_token.setdefault(request_id, now)
        if out.scheduled and not out.encoder_inputs and all(s.num_tokens == 1 for s in out.scheduled):
            decode_steps.append((now - start, sum(s.start + 1 for s in out.scheduled)))
        return sampled

    engine.runner.execute = timed_execute  # type: ignore[method-assign]
    engine.generate(jobs[:2])  # warm-up (kernels, allocator), not measured
    first_token.clear()
    decode_steps.clear()
    start = time.perf_counter()
    results = engine.generate(jobs)
    seconds = time.perf_counter() - start
    ttft = sorted(first_token[j.request_id] - start for j in jobs)
    return {"seconds": seconds, "jobs_per_s": len(jobs) / seconds,
            "tokens": sum(len(r.token_ids) for r in results),
            "ttft_median": statistics.median(ttft), "ttft_p90": ttft[int(0.9 * (len(ttft) - 1))],
            "decode_steps": decode_steps}  # type: ignore[dict-item]


def vision_mfu(loaded: Any, images: list[Image.Image], peak: float, device: str) -> float:
    from torch.utils.flop_counter import FlopCounterMode

    pixels = loaded.processor.image_processor(images=images, return_tensors="pt")["pixel_values"]
    pixels = pixels.to(device=device, dtype=loaded.model.dtype)
    with torch.inference_mode():
        with FlopCounterMode(display=False) as counter:
            loaded.model.get_image_features(pixel_values=pixels[:1])
        flops = counter.get_total_flops() * len(images)
        loaded.model.get_image_features(pixel_values=pixels)  # warm-up
        sync(device)
        start = time.perf_counter()
        loaded.model.get_image_features(pixel_values=pixels)
        sync(device)
    return flops / (time.perf_counter() - start) / peak


def decode_bw(loaded: Any, steps: list[tuple[float, int]], bandwidth: float) -> float:
    """Bytes a decode step must read (all weights once, the KV of every sequence) over its time."""
    if not steps:
        return float("nan")
    model = loaded.model
    lm = model.config.text_config
    weight_bytes = sum(p.numel() for n, p in model.named_parameters() if "vision" not in n) * model.dtype.itemsize
    kv_per_token = 2 * lm.num_hidden_layers * lm.num_key_value_heads * (lm.hidden_size // lm.num_attention_heads)
    kv_per_token *= model.dtype.itemsize
    used = [(weight_bytes + kv_per_token * ctx) / t for t, ctx in steps]
    return statistics.median(used) / bandwidth


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", default="internvl2-2b,internvl2-26b")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--jobs", type=int, default=100)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--concurrency", default="4,64")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    import tempfile

    dtype = getattr(torch, args.dtype)
    device = args.device
    peak, bandwidth = gemm_peak(device, dtype), copy_bandwidth(device)
    name = torch.cuda.get_device_name() if device.startswith("cuda") else "cpu"
    print(f"device: {name}; {args.dtype} GEMM peak {peak / 1e12:.1f} TFLOP/s, copy bandwidth "
          f"{bandwidth / 1e9:.0f} GB/s (measured now); torch {torch.__version__}")
    report: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory() as tmp:
        for shape_name in args.shape.split(","):
            shape = SHAPES[shape_name]
            if device.startswith("cuda"):
                torch.cuda.empty_cache()
            try:
                loaded = build(shape, device, dtype, Path(tmp) / shape_name)
            except torch.OutOfMemoryError:
                print(f"\n## {shape_name}: does not fit in device memory; skipped")
                continue
            params = sum(p.numel() for p in loaded.model.parameters()) / 1e9
            print(f"\n## {shape_name}: {params:.2f} B parameters, {args.jobs} jobs, {args.max_tokens} tokens each")
            image_jobs = make_jobs(args.jobs, True, args.max_tokens, shape.image_size)
            text_jobs = make_jobs(args.jobs, False, args.max_tokens, shape.image_size)
            mfu = vision_mfu(loaded, [j.images[0] for j in image_jobs[:64]], peak, device)
            print(f"vision MFU (batch of {min(64, args.jobs)} images): {100 * mfu:.1f}%")
            print(f"{'concurrent':>10} {'kind':>6} {'jobs/s':>8} {'tok/s':>8} {'TTFT med':>9} {'TTFT p90':>9} "
                  f"{'decode BW':>10}")
            for concurrency in map(int, args.concurrency.split(",")):
                rows = {}
                for kind, jobs in (("image", image_jobs), ("text", text_jobs)):
                    r = run_engine(loaded, jobs, concurrency, device)
                    bw = decode_bw(loaded, r.pop("decode_steps"), bandwidth)  # type: ignore[arg-type]
                    rows[kind] = {**r, "decode_bw_util": bw}
                    print(f"{concurrency:>10} {kind:>6} {r['jobs_per_s']:>8.2f} {r['tokens'] / r['seconds']:>8.0f} "
                          f"{r['ttft_median']:>8.3f}s {r['ttft_p90']:>8.3f}s {100 * bw:>9.1f}%")
                ratio = rows["image"]["jobs_per_s"] / rows["text"]["jobs_per_s"]
                print(f"{'':>10} image/text throughput ratio: {ratio:.2f} (lmdeploy 0.5.1 on A100: 0.43)")
                report.append({"shape": shape_name, "concurrency": concurrency, "vision_mfu": mfu,
                               "image_text_ratio": ratio, **{f"{k}_{m}": v for k, row in rows.items()
                                                             for m, v in row.items()}})
            del loaded
    if args.json:
        args.json.write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
