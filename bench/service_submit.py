"""The two ways a user hands jobs to a deployed vlmq, for bench/compare.py's service runs.

- `JobSubmission` ("service"): one `POST /v1/jobs` per job, over a few keep-alive connections at once, as a
  client with many jobs would; done when every job is `succeeded` in SQL; each job's text from its row.
- `BatchSubmission` ("service_batch"): the OpenAI Batch API, the path built for thousands of jobs: one JSONL
  file upload (`POST /v1/files`), one `POST /v1/batches`; the ingest worker writes the rows in bulk and
  dispatches them, the model worker runs them, finalization writes the output file. Done when the batch is
  `completed` (its output file is written); each job's text from the output file, by custom_id.

Both are timed from the first byte sent to done, polled in SQL every 20 ms (polling the API would charge the
API for the harness).
"""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from sqlalchemy import Connection, text


class JobSubmission:
    system = "service"

    def __init__(self, stack: Any, bodies: list[dict[str, Any]], custom_ids: list[str], connections: int = 8) -> None:
        self.bodies, self.custom_ids = bodies, custom_ids
        self.clients = [stack.client() for _ in range(connections)]
        self.pool = ThreadPoolExecutor(connections)
        self.ids: list[str] = []

    def _post(self, i: int) -> str:
        response = self.clients[i % len(self.clients)].post("/v1/jobs", json=self.bodies[i])
        assert response.status_code == 202, response.text
        return str(response.json()["id"])

    def submit(self) -> None:
        self.ids = list(self.pool.map(self._post, range(len(self.bodies))))

    def done(self, conn: Connection) -> bool:
        return conn.execute(text("SELECT count(*) FROM jobs WHERE status = 'succeeded' AND id = ANY(:ids)"),
                            {"ids": self.ids}).scalar_one() >= len(self.ids)

    def texts(self) -> dict[str, str]:
        return {custom_id: self.clients[0].get(f"/v1/jobs/{job_id}").json()["result"]["text"]
                for custom_id, job_id in zip(self.custom_ids, self.ids, strict=True)}

    def close(self) -> None:
        self.pool.shutdown()
        for client in self.clients:
            client.close()


class BatchSubmission:
    system = "service_batch"

    def __init__(self, stack: Any, bodies: list[dict[str, Any]], custom_ids: list[str]) -> None:
        self.client = stack.client()
        self.lines = "".join(json.dumps({"custom_id": custom_id, "method": "POST", "url": "/v1/chat/completions",
                                         "body": body}) + "\n"
                             for custom_id, body in zip(custom_ids, bodies, strict=True))
        self.batch_id = ""

    def submit(self) -> None:
        upload = self.client.post("/v1/files", data={"purpose": "batch"},
                                  files={"file": ("jobs.jsonl", self.lines.encode(), "application/jsonl")})
        assert upload.status_code == 200, upload.text
        batch = self.client.post("/v1/batches", json={"input_file_id": upload.json()["id"],
                                                      "endpoint": "/v1/chat/completions", "completion_window": "24h"})
        assert batch.status_code == 200, batch.text
        self.batch_id = batch.json()["id"]

    def done(self, conn: Connection) -> bool:
        status = conn.execute(text("SELECT status FROM batches WHERE id = :id"), {"id": self.batch_id}).scalar_one()
        if status in ("failed", "expired", "cancelled"):
            batch = self.client.get(f"/v1/batches/{self.batch_id}").text
            raise RuntimeError(f"batch {self.batch_id} ended {status}: {batch}")
        return bool(status == "completed")

    def texts(self) -> dict[str, str]:
        batch = self.client.get(f"/v1/batches/{self.batch_id}").json()
        counts = batch["request_counts"]
        assert counts["completed"] == counts["total"] and not batch["error_file_id"], batch
        output = self.client.get(f"/v1/files/{batch['output_file_id']}/content")
        assert output.status_code == 200, output.text
        rows = [json.loads(line) for line in output.text.splitlines()]
        return {row["custom_id"]: row["response"]["body"]["choices"][0]["message"]["content"] for row in rows}

    def close(self) -> None:
        self.client.close()
