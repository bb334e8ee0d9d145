"""The demo model's accuracy on held-out pictures through a running vlmq API, in each layout of the user's turn:
`vlmq submit` (multipart: the images, then the prompt), and JSON chat-completions bodies with the question
before the picture and after it.

    VLMQ_DATA_DIR=/tmp/layouts vlmq api --port 8765 &     # embedded defaults: the demo model, auth off
    python bench/demo_layouts.py --api-url http://127.0.0.1:8765 --n 200 --seed 7

The pictures come from worker/demo/shapes.py with a seed the model was never trained or chosen on. `vlmq submit`
runs as its own process per picture, as a user runs it.
"""

from __future__ import annotations

import argparse
import base64
import subprocess
import tempfile
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx

from worker.demo.shapes import Sample, samples


def by_cli(api_url: str, picture: Path, sample: Sample) -> str:
    proc = subprocess.run(["vlmq", "submit", "-i", str(picture), sample.question, "--wait", "--api-url", api_url],
                          capture_output=True, text=True, timeout=600)
    return proc.stdout.strip() if proc.returncode == 0 else f"error: {proc.stderr[-300:]}"


def by_json(client: httpx.Client, picture: Path, sample: Sample, image_first: bool) -> str:
    url = "data:image/png;base64," + base64.b64encode(picture.read_bytes()).decode()
    parts = [{"type": "text", "text": sample.question}, {"type": "image_url", "image_url": {"url": url}}]
    body = {"messages": [{"role": "user", "content": parts[::-1] if image_first else parts}], "max_tokens": 8}
    response = client.post("/v1/jobs", json=body)
    response.raise_for_status()
    job = response.json()
    while job["status"] in ("queued", "running"):
        time.sleep(0.3)
        job = client.get(f"/v1/jobs/{job['id']}").json()
    return str(job["result"]["text"]).strip() if job["status"] == "succeeded" else f"error: {job}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--api-url", default="http://127.0.0.1:8765")
    parser.add_argument("--n", type=int, default=200)
    parser.add_argument("--seed", type=int, default=7)
    parser.add_argument("--concurrency", type=int, default=8)
    args = parser.parse_args()
    held_out = samples(args.n, args.seed)
    with tempfile.TemporaryDirectory() as folder, httpx.Client(base_url=args.api_url, timeout=60) as client:
        pictures = [Path(folder) / f"{i:04d}.png" for i in range(args.n)]
        for sample, picture in zip(held_out, pictures, strict=True):
            sample.image.save(picture)
        layouts: dict[str, Callable[[Path, Sample], str]] = {
            "vlmq submit (multipart)": lambda p, s: by_cli(args.api_url, p, s),
            "JSON, question first": lambda p, s: by_json(client, p, s, image_first=False),
            "JSON, picture first": lambda p, s: by_json(client, p, s, image_first=True),
        }
        for name, ask in layouts.items():
            started = time.perf_counter()
            with ThreadPoolExecutor(args.concurrency) as pool:
                got = list(pool.map(ask, pictures, held_out))
            wrong = [(s.question, s.answer, g) for g, s in zip(got, held_out, strict=True) if g != s.answer]
            print(f"{name}: {args.n - len(wrong)}/{args.n} right ({time.perf_counter() - started:.0f} s)"
                  + (f"; wrong, e.g.: {wrong[:3]}" if wrong else ""), flush=True)


if __name__ == "__main__":
    main()
