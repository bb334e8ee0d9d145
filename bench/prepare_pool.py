"""How many image jobs a worker can prepare a second: in its job threads (one GIL, the processor under one lock, as
worker/jobs/pipeline.py does with VLMQ_PREPARE_PROCESSES=0) against a pool of prepare processes
(worker/jobs/prepare_pool.py).

Each job: its image's GET from an S3 server (rclone's, over HTTP), decode, chat template, processor, into the
engine's PreparedInput. --threads job threads ask at once, as a worker's do. Per family's tiny checkpoint (the
processor is the family's real one; the weights do not matter here) and image size, jobs/s and the worker
process's own CPU per job (its GIL's share; the pool's processes not counted), medians of --repeats,
alternating.

    .venv/bin/python bench/prepare_pool.py [--jobs 96] [--threads 16] [--pools 1,2] [--sizes 224x224,1024x768]
"""

from __future__ import annotations

import argparse
import io
import random
import statistics
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "bench")]

from engine import cpu_name  # noqa: E402

from common.infra.settings import Settings  # noqa: E402
from common.infra.storage import S3ObjectStore, image_key  # noqa: E402
from tests.s3_server import ACCESS_KEY, SECRET_KEY, S3Server  # noqa: E402
from tests.tiny_families import FAMILIES, build_tiny  # noqa: E402
from worker.jobs.image_reader import ImageReader  # noqa: E402
from worker.jobs.request import fetch_images, generation_request  # noqa: E402

BUCKET = "prepare-bench"


def photo(width: int, height: int, seed: int) -> bytes:
    """A JPEG with a photo's entropy (noise over a gradient), so decode costs what a real photo's does."""
    from PIL import Image

    rng = random.Random(seed)
    base = Image.linear_gradient("L").resize((width, height)).convert("RGB")
    noise = Image.effect_noise((width, height), 40).convert("RGB")
    image = Image.blend(base, noise, 0.5).rotate(rng.uniform(-5, 5))
    buf = io.BytesIO()
    image.save(buf, "JPEG", quality=90)
    return buf.getvalue()


def request(image_id: str) -> dict[str, Any]:
    return {"messages": [{"role": "user", "content": [
        {"type": "image", "image_id": image_id}, {"type": "text", "text": "Describe the picture in one sentence."}]}],
        "sampling": {"max_tokens": 32, "temperature": 0.0, "top_p": 1.0, "top_k": 0, "seed": None, "stop": []}}


def in_threads(settings: Settings, image_ids: list[str], threads: int) -> tuple[float, float]:
    """The job threads' own path: fetch + decode in each thread, prepare under one lock (EngineProcess.prepare)."""
    import torch

    from worker.engine.families import get_family
    from worker.engine.model_runner import prepare_input
    from worker.inference.model_loader import load_model

    front = load_model(settings.model, dtype=torch.float32, weights=False)
    family = get_family(front.model)
    store = S3ObjectStore(BUCKET, endpoint_url=settings.s3_endpoint_url, access_key_id=ACCESS_KEY,
                          secret_access_key=SECRET_KEY, max_connections=threads + 4)
    lock = threading.Lock()

    def one(i: int) -> None:
        job = request(image_ids[i])
        images = fetch_images(job, settings, ImageReader(store).read)
        req = generation_request(f"job-{i}", job, 0, settings, images, "bench")
        with lock:
            prepare_input(front, family, req)

    return _timed(one, len(image_ids), threads)


def in_pool(pool: Any, image_ids: list[str], threads: int) -> tuple[float, float]:
    return _timed(lambda i: pool.prepare(f"job-{i}", request(image_ids[i]), 0, "bench"), len(image_ids), threads)


def _timed(one: Any, jobs: int, threads: int) -> tuple[float, float]:
    with ThreadPoolExecutor(threads) as executor:
        cpu, start = time.process_time(), time.perf_counter()
        list(executor.map(one, range(jobs)))
        return jobs / (time.perf_counter() - start), 1000 * (time.process_time() - cpu) / jobs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--jobs", type=int, default=96)
    parser.add_argument("--threads", type=int, default=16)
    parser.add_argument("--pools", default="1,2", help="processes in each pool measured")
    parser.add_argument("--sizes", default="224x224,1024x768")
    parser.add_argument("--families", default=",".join(FAMILIES))
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    from worker.jobs.prepare_pool import PreparePool

    pools = [int(n) for n in args.pools.split(",")]
    sizes = [tuple(int(v) for v in size.split("x")) for size in args.sizes.split(",")]
    print(f"CPU: {cpu_name()}; {args.jobs} jobs, {args.threads} job threads; medians of {args.repeats}")
    print(f"{'family':<14} {'image':>9} {'way':>8} {'jobs/s':>8} {'vs threads':>10} {'worker CPU/job ms':>18}")
    server = S3Server("rclone")
    try:
        with tempfile.TemporaryDirectory() as work:
            store = S3ObjectStore(BUCKET, endpoint_url=server.endpoint, access_key_id=ACCESS_KEY,
                                  secret_access_key=SECRET_KEY, create_bucket=True)
            for family in args.families.split(","):
                settings = Settings(model=str(build_tiny(Path(work) / family, family)), storage_backend="s3",
                                    s3_bucket=BUCKET, s3_endpoint_url=server.endpoint, s3_access_key_id=ACCESS_KEY,
                                    s3_secret_access_key=SECRET_KEY)
                running = {n: PreparePool(settings, n) for n in pools}
                try:
                    for width, height in sizes:
                        image_ids = [f"{family}-{width}x{height}-{i}" for i in range(args.jobs)]
                        for i, image_id in enumerate(image_ids):
                            store.put(image_key(image_id), photo(width, height, i))
                        ways: dict[str, Any] = {"threads": partial(in_threads, settings, image_ids, args.threads)}
                        for n, pool in running.items():
                            ways[f"pool {n}"] = partial(in_pool, pool, image_ids, args.threads)
                        results: dict[str, list[tuple[float, float]]] = {way: [] for way in ways}
                        for _ in range(args.repeats):
                            for way, run in ways.items():
                                results[way].append(run())
                        base = statistics.median(r[0] for r in results["threads"])
                        for way, runs in results.items():
                            rate = statistics.median(r[0] for r in runs)
                            cpu = statistics.median(r[1] for r in runs)
                            print(f"{family:<14} {f'{width}x{height}':>9} {way:>8} {rate:>8.1f} "
                                  f"{rate / base:>9.2f}x {cpu:>18.2f}", flush=True)
                finally:
                    for pool in running.values():
                        pool.close()
    finally:
        server.close()


if __name__ == "__main__":
    main()
