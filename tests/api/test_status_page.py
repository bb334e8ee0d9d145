"""The status page in headless Chromium against the running stack (compose's commands as local processes):
what a person opening /status sees after a batch with a failure ran and while another one runs.

Set VLMQ_UPDATE_SCREENSHOT=1 to also write the screenshot to docs/status.png.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from html.parser import HTMLParser
from pathlib import Path

import httpx

from tests.stack import ROOT, LocalStack
from tests.test_end_to_end import make_jobs
from tests.test_stack_smoke import batch_line, run_batch, too_long_body

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser") or "chromium"


def chromium(args: list[str], profile: Path) -> str:
    # --virtual-time-budget lets the page's fetches and first render finish before the DOM is read.
    out = subprocess.run([CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                          f"--user-data-dir={profile}", "--virtual-time-budget=6000", *args],
                         capture_output=True, timeout=120)
    assert out.returncode == 0, out.stderr.decode(errors="replace")[-2000:]
    return out.stdout.decode()


class _Text(HTMLParser):
    """The visible text of a page, one table row or block per line."""

    def __init__(self) -> None:
        super().__init__()
        self.parts: list[str] = []
        self._skip = 0

    def handle_starttag(self, tag: str, attrs: object) -> None:
        if tag in ("script", "style"):
            self._skip += 1
        if tag in ("tr", "p", "h2", "section", "header"):
            self.parts.append("\n")

    def handle_endtag(self, tag: str) -> None:
        if tag in ("script", "style"):
            self._skip -= 1

    def handle_data(self, data: str) -> None:
        if not self._skip and data.strip():
            self.parts.append(data.strip() + " ")


def visible_text(html: str) -> str:
    parser = _Text()
    parser.feed(html)
    return "".join(parser.parts)


def line_with(text: str, needle: str) -> str:
    return next((line for line in text.splitlines() if needle in line), "")


def test_status_page_shows_batches_failures_and_workers(compose_stack: LocalStack, tmp_path: Path) -> None:
    stack = compose_stack
    key = stack.api_key("acme")
    with httpx.Client(base_url=stack.url, headers={"Authorization": f"Bearer {key}"}, timeout=60) as client:
        done = run_batch(client, [batch_line(f"caption-{i}", b) for i, b in enumerate(make_jobs(4, seed=5))]
                         + [batch_line("too-long", too_long_body())])
        assert done["status"] == "completed", done
        bodies = make_jobs(40, seed=6)
        for body in bodies:
            body["max_tokens"] = 24
        running = run_batch(client, [batch_line(f"label-{i}", b) for i, b in enumerate(bodies)], wait=False)

    # No key: the page asks for one and shows nothing else.
    anonymous = visible_text(chromium(["--dump-dom", stack.url + "/status"], tmp_path / "p0"))
    assert "API key needed" in anonymous and done["id"] not in anonymous

    html = chromium(["--dump-dom", f"{stack.url}/status#key={key}"], tmp_path / "p1")
    text = visible_text(html)
    assert key not in html  # taken from the fragment into session storage, and the fragment dropped
    assert "vlmq status" in text and "tenant acme" in text
    row = line_with(text, done["id"])
    assert "completed" in row and "5 / 5 (100%)" in row and "done" in row, row
    assert running["id"] in text
    failure = line_with(text, "too-long")
    assert "failed" in failure and "invalid_input" in failure and "prompt tokens" in failure, failure
    # The workers and queues are every tenant's load: a tenant's key sees neither, an admin's both.
    assert 'id="workers-section" hidden' in html and 'id="queues-section" hidden' in html
    assert "tiny-llava" not in line_with(text, "worker ") and "blocks" not in text
    assert "No failures." not in text and "could not load status" not in text
    admin = stack.api_key("ops")
    admin_html = chromium(["--dump-dom", f"{stack.url}/status#key={admin}"], tmp_path / "p3")
    admin_text = visible_text(admin_html)
    assert "all tenants" in admin_text and 'id="workers-section" hidden' not in admin_html
    roles = {role: next((line for line in admin_text.splitlines() if line.startswith(role + " ")), "")
             for role in ("worker", "ingest", "beat")}
    assert "tiny-llava" in roles["worker"] and "blocks" in roles["worker"] and "s ago" in roles["worker"], roles
    assert "s ago" in roles["ingest"] and "s ago" in roles["beat"], roles
    assert "could not load status" not in admin_text

    # The same numbers the pages show come from /status/data, scoped to the key's tenant.
    with httpx.Client(base_url=stack.url, headers={"Authorization": f"Bearer {key}"}, timeout=60) as client:
        data = client.get("/status/data").json()
    assert {b["tenant"] for b in data["batches"]} == {"acme"}
    assert "processes" not in data and "queues" not in data
    with httpx.Client(base_url=stack.url, headers={"Authorization": f"Bearer {admin}"}, timeout=60) as client:
        data = client.get("/status/data").json()
    workers = [p for p in data["processes"] if p["role"] == "worker"]
    assert len(workers) == 1 and workers[0]["jobs_done"] >= 5 and workers[0]["kv_blocks_total"] > 0

    shot = tmp_path / "status.png"
    chromium([f"--screenshot={shot}", "--window-size=1280,900", "--hide-scrollbars", f"{stack.url}/status#key={key}"],
             tmp_path / "p2")
    assert shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and shot.stat().st_size > 20_000
    if os.environ.get("VLMQ_UPDATE_SCREENSHOT"):
        shutil.copy(shot, ROOT / "docs" / "status.png")
    print(json.dumps({"batches": [b["id"] for b in data["batches"]]}))
