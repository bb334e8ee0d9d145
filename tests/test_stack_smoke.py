"""The compose stack's own commands, run as local processes (tests/stack.py), complete a batch end to end; the
worker's and the API's Prometheus metrics and the JSON logs show what happened.
"""

from __future__ import annotations

import json
import time
from typing import Any

import httpx

from tests.api.test_jobs_api import data_url
from tests.stack import LocalStack, metric_values
from tests.test_end_to_end import make_jobs

FINAL = ("completed", "failed", "cancelled", "expired")


def batch_line(custom_id: str, body: dict[str, Any]) -> str:
    return json.dumps({"custom_id": custom_id, "method": "POST", "url": "/v1/chat/completions", "body": body})


def too_long_body() -> dict[str, Any]:
    """Accepted at submission, refused by the engine: its text (~480 tokens) fits the tiny model's 512
    positions, which submission checks, but not with its 8 images' 16 tokens each, which only the worker
    counts."""
    image = {"type": "image_url", "image_url": {"url": data_url(_png())}}
    return {"messages": [{"role": "user", "content": [image] * 8 + [{"type": "text", "text": "describe " * 470}]}],
            "max_tokens": 4}


def too_long_text_body() -> dict[str, Any]:
    """Refused at submission: the text alone is over the tiny model's 512 positions."""
    return {"messages": [{"role": "user", "content": "describe " * 600}], "max_tokens": 4}


def run_batch(client: httpx.Client, lines: list[str], wait: bool = True, timeout: float = 120) -> dict[str, Any]:
    upload = client.post("/v1/files", files={"file": ("in.jsonl", ("\n".join(lines) + "\n").encode())},
                         data={"purpose": "batch"})
    assert upload.status_code == 200, upload.text
    created = client.post("/v1/batches", json={"input_file_id": upload.json()["id"], "completion_window": "24h",
                                               "endpoint": "/v1/chat/completions"})
    assert created.status_code == 200, created.text
    batch = created.json()
    deadline = time.monotonic() + timeout
    while wait and batch["status"] not in FINAL:
        assert time.monotonic() < deadline, f"batch still {batch['status']}: {batch['request_counts']}"
        time.sleep(0.3)
        batch = client.get(f"/v1/batches/{batch['id']}").json()
    return batch



def test_the_compose_commands_complete_a_batch(compose_stack: LocalStack) -> None:
    stack = compose_stack
    key = stack.api_key("smoke")
    bodies = make_jobs(6, seed=3)
    lines = [batch_line(f"req-{i}", b) for i, b in enumerate(bodies)]
    lines += [batch_line("too-long", too_long_body()), batch_line("too-long-text", too_long_text_body())]
    with httpx.Client(base_url=stack.url, headers={"Authorization": f"Bearer {key}"}, timeout=60) as client:
        batch = run_batch(client, lines)
        assert batch["status"] == "completed", batch
        assert batch["request_counts"] == {"total": 8, "completed": 6, "failed": 2}
        output = [json.loads(x) for x in client.get(f"/v1/files/{batch['output_file_id']}/content").text.splitlines()]
        errors = [json.loads(x) for x in client.get(f"/v1/files/{batch['error_file_id']}/content").text.splitlines()]
    assert sorted(o["custom_id"] for o in output) == [f"req-{i}" for i in range(6)]
    by_id = {e["custom_id"]: e for e in errors}
    assert sorted(by_id) == ["too-long", "too-long-text"] and "prompt tokens" in json.dumps(by_id["too-long"])
    # The ingest worker (the API image: tokenizers, no torch) measured this one against the model's context.
    assert by_id["too-long-text"]["error"]["code"] == "context_length_exceeded", by_id["too-long-text"]

    # The worker's own /metrics: the engine's counters after real work.
    worker = metric_values(httpx.get(f"http://127.0.0.1:{stack.metrics_port}/metrics", timeout=30).text)
    assert worker[("vlmq_worker_jobs_total", (("status", "succeeded"),))] >= 6
    assert worker[("vlmq_worker_jobs_total", (("status", "failed"),))] >= 1
    assert worker[("vlmq_engine_generated_tokens_total", ())] > 0
    assert worker[("vlmq_engine_vision_batch_size_count", ())] >= 1
    assert worker[("vlmq_engine_vision_batch_size_sum", ())] >= 6  # 7 images over some vision forwards
    assert worker[("vlmq_engine_encoder_cache_misses_total", ())] >= 1
    assert worker[("vlmq_engine_prefill_step_seconds_total", ())] > 0  # every prompt was computed in some step
    assert ("vlmq_engine_decode_step_seconds_total", ()) in worker
    for name in ("vlmq_engine_requests_running", "vlmq_engine_requests_waiting", "vlmq_engine_kv_blocks_used",
                 "vlmq_engine_kv_blocks_free", "vlmq_engine_prefix_cache_hit_rate",
                 "vlmq_engine_encoder_cache_hit_rate", "vlmq_engine_generated_tokens_per_second"):
        assert (name, ()) in worker, name
    assert worker[("vlmq_engine_kv_blocks_free", ())] > 0
    # Where the job threads' CPU went, stage by stage: a job passes the stages in order and stops at the one that
    # fails it (the "too-long" one while its prompt is prepared), every succeeded job passed all five, and each
    # stage's own work took some CPU. A batch row never enters `persist`: its result is its row, no object.
    stages = ("claim", "inputs", "prepare", "engine", "finish")
    calls = [worker[("vlmq_worker_stage_calls_total", (("stage", stage),))] for stage in stages]
    assert calls == sorted(calls, reverse=True) and calls[-1] >= 6 and calls[0] > calls[-1], calls
    assert worker.get(("vlmq_worker_stage_calls_total", (("stage", "persist"),)), 0.0) == 0.0
    for stage in ("prepare", "finish"):
        assert worker[("vlmq_worker_stage_cpu_seconds_total", (("stage", stage),))] > 0, stage

    # The API's /metrics: jobs by status from SQL, every process of the stack alive.
    api = metric_values(httpx.get(stack.url + "/metrics", timeout=30).text)
    assert api[("vlmq_jobs", (("status", "succeeded"),))] >= 6
    # Both processes say how long their garbage collections stopped them: the young generation has run.
    for process in (worker, api):
        assert process[("vlmq_gc_pauses_total", (("generation", "0"),))] >= 1
        assert all(process[("vlmq_gc_pause_seconds_total", (("generation", g),))] >= 0 for g in "012")
    for role in ("worker", "ingest", "beat"):
        assert api[("vlmq_processes", (("role", role),))] == 1, role


def test_logs_are_json_lines_with_job_and_batch_ids(compose_stack: LocalStack) -> None:
    key = compose_stack.api_key("logs")
    with httpx.Client(base_url=compose_stack.url, headers={"Authorization": f"Bearer {key}"}, timeout=60) as client:
        body = {"messages": [{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": data_url(_png())}}, {"type": "text", "text": "hi"}]}],
            "max_tokens": 2}
        batch = run_batch(client, [batch_line("one", body)])
    assert batch["status"] == "completed"
    time.sleep(0.5)
    records = {}
    for name in ("worker", "ingest", "beat", "api"):
        lines = [x for x in compose_stack.log(name).splitlines() if x.strip()]
        records[name] = [json.loads(x) for x in lines if x.startswith("{")]
        # Every line is a JSON object: no banner, no plain-text log or warning line.
        assert len(records[name]) == len(lines), (name, [x for x in lines if not x.startswith("{")][:5])
        assert all({"ts", "level", "logger", "message"} <= set(r) for r in records[name])
    assert any(r.get("job_id") for r in records["worker"]), records["worker"][-5:]
    assert any(r.get("batch_id") == batch["id"] for r in records["ingest"]), records["ingest"][-5:]


def _png() -> bytes:
    import io

    from PIL import Image

    buf = io.BytesIO()
    Image.new("RGB", (32, 24), (10, 200, 90)).save(buf, format="PNG")
    return buf.getvalue()
