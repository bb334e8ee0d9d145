"""One job type, the whole path: HTTP -> Postgres/S3 -> Redis -> a real `vlmq worker` process -> S3/SQL.

Twenty jobs with different images and prompts must all succeed, and each answer must be exactly what HF
`generate` gives for that job alone, although the worker ran them together in batches; with the images
prepared in the job threads and in a pool of prepare processes alike.
"""

from __future__ import annotations

import io
import os
import random
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
import torch
from PIL import Image

from tests.api.test_jobs_api import data_url
from tests.common.images.test_structure import png_with_checked_but_broken_pixels
from tests.conftest import ApiServer, settings_from_env
from tests.fault_stack import free_port
from tests.hf_reference import hf_messages, hf_reference_answer
from tests.stack import metric_values
from worker.inference.model_loader import load_model

WORDS = "what colour is the shape describe this picture briefly how many things can you see here".split()


def make_image(rng: random.Random) -> bytes:
    size = (rng.randint(20, 120), rng.randint(20, 120))
    img = Image.new("RGB", size, tuple(rng.randint(0, 255) for _ in range(3)))
    px = img.load()
    assert px is not None
    for _ in range(60):
        px[rng.randrange(size[0]), rng.randrange(size[1])] = tuple(rng.randint(0, 255) for _ in range(3))
    buf = io.BytesIO()
    img.save(buf, format=rng.choice(["PNG", "JPEG", "WEBP"]))
    return buf.getvalue()


def make_jobs(n: int, seed: int = 1) -> list[dict]:
    rng = random.Random(seed)
    bodies = []
    for i in range(n):
        images = [make_image(rng) for _ in range(2 if i == 5 else 1)]
        text = " ".join(rng.choice(WORDS) for _ in range(rng.randint(2, 12)))
        content = [{"type": "image_url", "image_url": {"url": data_url(b)}} for b in images]
        content.append({"type": "text", "text": text})
        messages: list[dict] = [{"role": "user", "content": content}]
        if i % 4 == 0:
            messages.insert(0, {"role": "system", "content": "You are terse."})
        bodies.append({"messages": messages, "max_tokens": rng.randint(4, 16)})
    return bodies


def wait_terminal(client: httpx.Client, ids: list[str], timeout: float) -> dict[str, dict]:
    deadline = time.monotonic() + timeout
    jobs: dict[str, dict] = {}
    while time.monotonic() < deadline:
        jobs = {i: client.get(f"/v1/jobs/{i}").json() for i in ids}
        if all(j["status"] not in ("queued", "running") for j in jobs.values()):
            return jobs
        time.sleep(0.5)
    raise TimeoutError(f"jobs not finished: { {i: j['status'] for i, j in jobs.items()} }")


@pytest.mark.slow
@pytest.mark.parametrize("prepare_processes", ["0", "2"], ids=["prepared-in-job-threads", "prepare-pool"])
def test_twenty_jobs_through_the_service_match_hf(service_env: dict[str, str], tiny_llava_path: Path,
                                                   tmp_path: Path, prepare_processes: str) -> None:
    env = {**os.environ, **service_env, "VLMQ_MODEL": str(tiny_llava_path), "VLMQ_WORKER_CONCURRENCY": "24",
           "VLMQ_MAX_BATCH_SIZE": "24", "VLMQ_BATCH_WAIT_MS": "300", "OMP_NUM_THREADS": "2",
           "VLMQ_PREPARE_PROCESSES": prepare_processes, "VLMQ_METRICS_PORT": str(metrics_port := free_port())}
    log_path = tmp_path / "worker.log"
    with log_path.open("wb") as log:
        worker = subprocess.Popen([sys.executable, "-m", "cli.main", "worker", "--loglevel", "WARNING"],
                                  env=env, stdout=log, stderr=subprocess.STDOUT)
    settings = settings_from_env(service_env,
                        model=str(tiny_llava_path))
    bodies = make_jobs(20)
    try:
        with ApiServer(settings) as server, server.client() as client:
            ids = []
            for body in bodies:
                response = client.post("/v1/jobs", json=body)
                assert response.status_code == 202, response.text
                ids.append(response.json()["id"])
            # Its container is whole, so submission (which reads PNG containers, not pixels) accepts it; only
            # the worker's decode finds its pixel data broken, and the job fails with a clear error.
            broken = client.post("/v1/jobs", json={"messages": [{"role": "user", "content": [
                {"type": "image_url", "image_url": {"url": data_url(png_with_checked_but_broken_pixels())}},
                {"type": "text", "text": "what is this"}]}], "max_tokens": 4})
            assert broken.status_code == 202, broken.text
            jobs = wait_terminal(client, [*ids, broken.json()["id"]], timeout=300)
            failed = jobs.pop(broken.json()["id"])
            results = {i: client.get(f"/v1/jobs/{i}/result").json() for i in ids}
            assert len(_spawned_children(worker.pid)) == int(prepare_processes)
            metrics = metric_values(httpx.get(f"http://127.0.0.1:{metrics_port}/metrics", timeout=30).text)
    finally:
        worker.terminate()
        worker.wait(30)
    assert failed["status"] == "failed" and failed["attempts"] == 1, failed
    assert failed["error"]["code"] == "invalid_input", failed
    assert failed["error"]["message"].startswith("image is truncated or corrupt"), failed
    assert all(j["status"] == "succeeded" for j in jobs.values()), log_path.read_text()[-3000:]
    assert all(j["attempts"] == 1 for j in jobs.values())
    # Every job here has images: with the pool, none was fetched or decoded in a job thread (the broken image
    # fails in the pool's prepare; in the job thread, in its inputs, before any prepare).
    stage_calls = {stage: metrics.get(("vlmq_worker_stage_calls_total", (("stage", stage),)), 0.0)
                   for stage in ("inputs", "prepare")}
    if prepare_processes == "0":
        assert stage_calls == {"inputs": 21, "prepare": 20}, stage_calls
        assert ("vlmq_worker_prepare_processes", ()) not in metrics
    else:
        assert stage_calls == {"inputs": 0, "prepare": 21}, stage_calls
        assert metrics[("vlmq_worker_prepare_processes", ())] == int(prepare_processes)
        assert metrics[("vlmq_worker_prepare_pool_restarts_total", ())] == 0

    loaded = load_model(str(tiny_llava_path))
    torch.manual_seed(0)
    ties = 0
    for job_id, body in zip(ids, bodies, strict=True):
        job = jobs[job_id]
        images = [Image.open(io.BytesIO(_decode(p["image_url"]["url"]))).convert("RGB")
                  for m in body["messages"] if isinstance(m["content"], list)
                  for p in m["content"] if p["type"] == "image_url"]
        text, n_completion, n_prompt, near_tie = hf_reference_answer(
            loaded, hf_messages(body["messages"]), images, body["max_tokens"])
        assert job["result"]["usage"]["prompt_tokens"] == n_prompt
        if near_tie and job["result"]["text"] != text:
            ties += 1  # HF itself was at a float-noise tie on some step; see tests/hf_reference.py
            continue
        assert job["result"]["text"] == text, job_id
        assert job["result"]["usage"]["completion_tokens"] == n_completion
        # The full response object in S3 is the OpenAI chat.completion the row summarises.
        stored = results[job_id]
        assert stored["object"] == "chat.completion" and stored["choices"][0]["message"]["content"] == text
        assert stored["usage"]["total_tokens"] == n_prompt + n_completion

    assert ties <= 1

    # Jobs ran together, not one at a time: some were running at the same moment.
    spans = sorted((j["started_at"], j["finished_at"]) for j in jobs.values())
    overlapping = max(sum(1 for s, f in spans if s <= start < f) for start, _ in spans)
    assert overlapping >= 4


def _decode(url: str) -> bytes:
    import base64

    return base64.b64decode(url.split(",", 1)[1])


def _spawned_children(pid: int) -> list[int]:
    """The processes multiprocessing spawned for `pid` (the prepare pool's), from /proc."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            ppid = int((entry / "stat").read_text().split(") ", 1)[1].split()[1])
            command = (entry / "cmdline").read_bytes()
        except (FileNotFoundError, ProcessLookupError, IndexError):
            continue
        if ppid == pid and b"multiprocessing.spawn" in command:
            found.append(int(entry.name))
    return found
