"""Request bodies that stall or are abandoned halfway, sent over raw sockets to the real app under uvicorn."""

from __future__ import annotations

import json
import logging
import socket
import time
from collections.abc import Iterator

import pytest

from tests.conftest import ApiServer, settings_from_env
from tests.log_records import LogRecords

IDLE_SECONDS = 1.0
MODEL = "stall-model"


@pytest.fixture(scope="module")
def server(service_env: dict[str, str]) -> Iterator[ApiServer]:
    settings = settings_from_env(service_env, model=f"/models/{MODEL}", body_idle_timeout_seconds=IDLE_SECONDS)
    with ApiServer(settings) as api:
        yield api


@pytest.fixture
def logs() -> Iterator[LogRecords]:
    """Every record of the app's and uvicorn's loggers (uvicorn's do not reach the root logger)."""
    handler = LogRecords()
    loggers = [logging.getLogger(), logging.getLogger("uvicorn.error"), logging.getLogger("uvicorn")]
    for logger in loggers:
        logger.addHandler(handler)
    app_logger = logging.getLogger("api")
    level, app_logger.level = app_logger.level, logging.INFO
    yield handler
    app_logger.setLevel(level)
    for logger in loggers:
        logger.removeHandler(handler)


def _open(server: ApiServer, path: str, content_type: str, length: int, first: bytes) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", server.port), timeout=30)
    head = (f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer {server.api_key}\r\n"
            f"Content-Type: {content_type}\r\nContent-Length: {length}\r\n\r\n")
    sock.sendall(head.encode() + first)
    return sock


def _response(sock: socket.socket) -> tuple[int, dict, bytes]:
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(65536)
        assert chunk, f"connection closed without a response: {data!r}"
        data += chunk
    head, _, rest = data.partition(b"\r\n\r\n")
    lines = head.decode().split("\r\n")
    headers = {k.lower(): v.strip() for k, _, v in (h.partition(":") for h in lines[1:])}
    while len(rest) < int(headers.get("content-length", 0)):
        rest += sock.recv(65536)
    return int(lines[0].split()[1]), headers, rest


def _multipart_start(boundary: str) -> bytes:
    return (f"--{boundary}\r\nContent-Disposition: form-data; name=\"purpose\"\r\n\r\nbatch\r\n"
            f"--{boundary}\r\nContent-Disposition: form-data; name=\"file\"; filename=\"in.jsonl\"\r\n"
            "Content-Type: application/octet-stream\r\n\r\n{\"custom_id\": \"a\"").encode()


def _open_halfway(server: ApiServer, route: str) -> socket.socket:
    """A request to `route` (json: POST /v1/jobs; upload: POST /v1/files) whose body has begun, not ended."""
    if route == "json":
        return _open(server, "/v1/jobs", "application/json", 10_000, b'{"messages": [')
    return _open(server, "/v1/files", "multipart/form-data; boundary=xyz", 100_000, _multipart_start("xyz"))


@pytest.mark.parametrize("route", ["json", "upload"])
def test_a_stalled_body_is_cut_off_with_408_quietly(server: ApiServer, logs: LogRecords, route: str) -> None:
    sock = _open_halfway(server, route)
    started = time.monotonic()
    with sock:
        status, headers, body = _response(sock)
        waited = time.monotonic() - started
        assert sock.recv(1) == b""  # and the connection is closed: the rest of the body will not be read
    assert status == 408, body
    assert IDLE_SECONDS * 0.9 <= waited < IDLE_SECONDS + 5, waited
    assert headers["connection"] == "close"
    error = json.loads(body)["error"]
    assert error["code"] == "request_timeout" and "no data for 1 seconds" in error["message"]
    time.sleep(0.2)
    assert not logs.errors(), logs.errors()
    assert any("stalled" in r.getMessage() and r.levelno == logging.WARNING for r in logs.records)


def test_a_slow_body_that_keeps_coming_is_not_cut(server: ApiServer) -> None:
    raw = json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "hello"}]}).encode()
    pieces = [raw[i:i + 8] for i in range(0, len(raw), 8)]
    sock = _open(server, "/v1/jobs", "application/json", len(raw), b"")
    with sock:
        for piece in pieces:  # in all, well past the idle timeout
            time.sleep(IDLE_SECONDS / 3)
            sock.sendall(piece)
        status, _, body = _response(sock)
    assert len(pieces) * IDLE_SECONDS / 3 > 2 * IDLE_SECONDS
    assert status == 202, body


@pytest.mark.parametrize("route", ["json", "upload"])
def test_a_client_that_leaves_mid_body_leaves_no_traceback(server: ApiServer, logs: LogRecords, route: str) -> None:
    sock = _open_halfway(server, route)
    time.sleep(0.3)  # the app is reading the body
    sock.close()
    time.sleep(0.5)
    assert not logs.errors(), logs.errors()
    assert any("disconnected before its request body ended" in r.getMessage() for r in logs.records)
