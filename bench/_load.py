"""A lean HTTP/1.1 load client for bench/ingest.py: keep-alive connections, one request in flight on each.

Python HTTP clients (httpx, aiohttp) spend more CPU per request than the server's hot path we measure, and on
a 2-core machine the client shares the CPUs with the server; this one writes a prebuilt request and reads the
answer by Content-Length, so its cost is a small, constant share.
"""

from __future__ import annotations

import asyncio
import json
import multiprocessing
import time
from typing import Any


def _request(port: int, key: str, body: dict[str, Any]) -> bytes:
    payload = json.dumps(body).encode()
    head = (f"POST /v1/jobs HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nAuthorization: Bearer {key}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(payload)}\r\n\r\n")
    return head.encode() + payload


async def _connection(port: int, request: bytes, deadline: float, counts: list[int]) -> None:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        while time.monotonic() < deadline:
            writer.write(request)
            head = await reader.readuntil(b"\r\n\r\n")
            status = int(head[9:12])
            length = 0
            for line in head.split(b"\r\n"):
                if line[:15].lower() == b"content-length:":
                    length = int(line[15:])
            body = await reader.readexactly(length)
            if status == 202:
                counts[0] += 1
            else:
                counts[1] += 1
                if counts[1] == 1:
                    print(f"unexpected {status}: {body[:300]!r}", flush=True)
    finally:
        writer.close()


def _client(ports: list[int], key: str, body: dict[str, Any], seconds: float, connections: int, start_at: float,
            out: Any) -> None:
    async def main() -> list[int]:
        counts = [0, 0]
        await asyncio.sleep(max(0.0, start_at - time.time()))
        deadline = time.monotonic() + seconds
        await asyncio.gather(*(_connection(ports[i % len(ports)], _request(ports[i % len(ports)], key, body),
                                           deadline, counts) for i in range(connections)))
        return counts

    out.put(asyncio.run(main()))


def load(ports: list[int], key: str, body: dict[str, Any], seconds: float, connections: int, clients: int) -> float:
    """Accepted jobs per second over `seconds`, from `clients` processes sharing `connections`, which are
    spread round-robin over the servers at `ports`."""
    ctx = multiprocessing.get_context("fork")
    out = ctx.Queue()
    start_at = time.time() + 0.3
    per = max(1, connections // clients)
    procs = [ctx.Process(target=_client, args=(ports, key, body, seconds, per, start_at, out)) for _ in range(clients)]
    for p in procs:
        p.start()
    ok = failed = 0
    for _ in procs:
        good, bad = out.get()
        ok, failed = ok + good, failed + bad
    for p in procs:
        p.join()
    if failed:
        raise RuntimeError(f"{failed} requests were not answered 202 (and {ok} were)")
    # Requests in flight at the deadline finish a little after it; their share is small at these rates.
    return ok / seconds
