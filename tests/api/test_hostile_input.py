"""Hostile input over real HTTP: image bombs and disguised formats, remote image URLs aimed inside the network,
JSON past the parser's limits, and bodies over the limit. Each ends in a clear 4xx; nothing else is affected.

Remote images come from a local server on loopback, which these settings exempt (127.0.0.0/8 only) so that a
positive fetch can be tested without the internet; every other non-public address stays refused."""

from __future__ import annotations

import base64
import hashlib
import io
import json
import socket
import struct
import time
import zlib
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from PIL import Image

from common.infra.settings import Settings
from tests.api.test_jobs_api import chat_body, data_url, png_bytes
from tests.common.images.test_fetch import Server, redirect, send
from tests.conftest import ApiServer, settings_from_env

MODEL = "tiny-test-model"
MAX_BODY = 256 * 1024
MAX_FILE = 64 * 1024


def encode(im: Image.Image, fmt: str, **params: object) -> bytes:
    buf = io.BytesIO()
    im.save(buf, fmt, **params)
    return buf.getvalue()


def bomb_png(side: int = 20_000) -> bytes:
    """400 megapixels of 1-bit PNG in about 50 KB."""
    def chunk(kind: bytes, body: bytes) -> bytes:
        return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body))

    rows = zlib.compress((b"\0" * (1 + side // 8)) * side, 9)
    return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", side, side, 1, 0, 0, 0, 0))
            + chunk(b"IDAT", rows) + chunk(b"IEND", b""))


def gif(frames: int) -> bytes:
    images = [Image.new("RGB", (8, 8), (i * 20, 0, 0)) for i in range(frames)]
    return encode(images[0], "GIF", save_all=True, append_images=images[1:], duration=50)


@pytest.fixture(scope="module")
def settings(service_env: dict[str, str]) -> Settings:
    return settings_from_env(service_env, model=f"/models/{MODEL}", max_body_bytes=MAX_BODY, max_file_bytes=MAX_FILE,
                             max_image_bytes=100_000, max_image_frames=5, image_urls_enabled=True,
                             image_url_allow_http=True, image_url_timeout_seconds=2,
                             image_url_allowed_networks=["127.0.0.0/8"])


@pytest.fixture(scope="module")
def server(settings: Settings) -> Iterator[ApiServer]:
    with ApiServer(settings) as api_server:
        yield api_server


@pytest.fixture(scope="module")
def api(server: ApiServer) -> Iterator[httpx.Client]:
    with server.client(timeout=30) as client:
        yield client


@pytest.fixture(scope="module")
def images() -> Iterator[Server]:
    s = Server()
    yield s
    s.close()


def error(response: httpx.Response, status: int) -> tuple[str, str]:
    assert response.status_code == status, response.text
    body = response.json()["error"]
    return body["code"], body["message"]


# --- images ------------------------------------------------------------------------------------------------

def test_bombs_are_refused_on_every_way_in(api: httpx.Client) -> None:
    bomb = bomb_png()
    assert len(bomb) < 100_000
    started = time.monotonic()
    code, message = error(api.post("/v1/jobs", json=chat_body(data_url(bomb))), 400)
    assert code == "invalid_image" and "too large" in message
    code, message = error(api.post("/v1/images", files={"file": ("b.png", bomb, "image/png")}), 400)
    assert code == "invalid_image" and "too large" in message
    code, _ = error(api.post("/v1/jobs", data={"prompt": "hi"}, files={"image": ("b.png", bomb, "image/png")}), 400)
    assert code == "invalid_image"
    assert time.monotonic() - started < 10
    assert api.get("/healthz").status_code == 200


@pytest.mark.parametrize(("data", "mime", "fragment"), [
    (encode(Image.new("RGB", (8, 8)), "TIFF"), "image/png", "format TIFF is not allowed"),
    (b'<svg xmlns="http://www.w3.org/2000/svg"/>', "image/svg+xml", "format SVG is not allowed"),
    (b"%PDF-1.4 not an image", "image/jpeg", "format PDF is not allowed"),
    (encode(Image.new("RGB", (64, 64), (9, 9, 9)), "JPEG")[:300], "image/jpeg", "truncated or corrupt"),
    (png_bytes(size=(64, 64))[:-40], "image/png", "truncated or corrupt"),
    (gif(10), "image/gif", "10 frames, more than the limit of 5"),
])
def test_refused_images_say_why(api: httpx.Client, data: bytes, mime: str, fragment: str) -> None:
    for response in (api.post("/v1/jobs", json=chat_body(data_url(data, mime))),
                     api.post("/v1/images", files={"file": ("photo.png", data, "image/png")})):
        code, message = error(response, 400)
        assert code == "invalid_image" and fragment in message


@pytest.mark.parametrize("data", [
    encode(Image.new("CMYK", (8, 8), (0, 255, 255, 0)), "JPEG"),
    encode(Image.new("I;16", (8, 8), 40000), "PNG"),
    encode(Image.new("P", (8, 8), 1), "PNG", transparency=1),
    encode(Image.new("RGBA", (8, 8), (0, 0, 0, 0)), "PNG"),
    gif(3),
    encode(Image.new("RGB", (8, 8), (1, 2, 3)), "WEBP", lossless=True),
])
def test_unusual_but_valid_images_are_accepted_whatever_they_claim(api: httpx.Client, data: bytes) -> None:
    # Declared as a JPEG named .jpg: the format comes from the bytes, never from the name or the mime type.
    upload = api.post("/v1/images", files={"file": ("photo.jpg", data, "image/jpeg")})
    assert upload.status_code == 201, upload.text
    assert upload.json()["sha256"] == hashlib.sha256(data).hexdigest()
    assert api.post("/v1/jobs", json=chat_body(data_url(data, "image/jpeg"))).status_code == 202


# --- remote image URLs -------------------------------------------------------------------------------------

def test_image_url_is_fetched_validated_and_stored_once(api: httpx.Client, images: Server) -> None:
    cat = png_bytes((1, 99, 200), (10, 10))
    images.routes["/cat.png"] = send(cat)
    images.routes["/moved"] = redirect("/cat.png")
    for url in (f"http://127.0.0.1:{images.port}/cat.png", f"http://127.0.0.1:{images.port}/moved"):
        assert api.post("/v1/jobs", json=chat_body(url)).status_code == 202
    stored = api.get(f"/v1/images/img_{hashlib.sha256(cat).hexdigest()}")
    assert stored.status_code == 200 and stored.json()["format"] == "PNG"


@pytest.mark.parametrize(("url", "code", "fragment"), [
    ("https://169.254.169.254/latest/meta-data/", "image_url_not_allowed", "(link-local)"),
    ("https://10.1.2.3/cat.png", "image_url_not_allowed", "(private)"),
    ("https://[::ffff:192.168.0.1]/cat.png", "image_url_not_allowed", "(private, embedded in IPv6)"),
    ("http://[::1]:{port}/cat.png", "image_url_not_allowed", "(loopback)"),  # the exemption is 127.0.0.0/8
    ("http://127.0.0.1:{port}/to-metadata", "image_url_not_allowed", "169.254.169.254"),
    ("http://127.0.0.1:{port}/huge", "image_fetch_failed", "the limit is 100000 bytes"),
    ("http://127.0.0.1:{port}/missing", "image_fetch_failed", "HTTP 404"),
    ("http://127.0.0.1:{port}/slow", "image_fetch_failed", "longer than 2 s"),
    ("http://127.0.0.1:{port}/tiff", "invalid_image", "format TIFF is not allowed"),
])
def test_image_url_refusals(api: httpx.Client, images: Server, url: str, code: str, fragment: str) -> None:
    images.routes["/to-metadata"] = redirect("http://169.254.169.254/latest/meta-data/")
    images.routes["/huge"] = send(b"\0" * 200_000)
    images.routes["/slow"] = lambda h: time.sleep(4)
    images.routes["/tiff"] = send(encode(Image.new("RGB", (8, 8)), "TIFF"))
    got_code, message = error(api.post("/v1/jobs", json=chat_body(url.format(port=images.port))), 400)
    assert got_code == code and fragment in message


def test_image_urls_stay_off_by_default(service_env: dict[str, str]) -> None:
    assert not Settings().image_urls_enabled and not Settings().image_url_allow_http
    off = settings_from_env(service_env, model=f"/models/{MODEL}")
    with ApiServer(off) as server, server.client() as client:
        code, message = error(client.post("/v1/jobs", json=chat_body("https://example.com/cat.png")), 400)
    assert code == "image_url_not_allowed" and "not enabled" in message


# --- JSON and bodies -----------------------------------------------------------------------------------------

@pytest.mark.parametrize("raw", [b"[" * 50_000, b'{"model": "x", "seed": ' + b"9" * 5000 + b"}",
                                 b'{"messages": ' + b'{"a": ' * 10_000 + b"1" + b"}" * 10_001])
def test_json_past_the_parsers_limits_is_a_400(api: httpx.Client, raw: bytes) -> None:
    for path in ("/v1/jobs", "/v1/batches"):
        response = api.post(path, content=raw, headers={"content-type": "application/json"})
        assert 400 <= response.status_code < 500, (path, response.status_code, response.text[:200])
    form = api.post("/v1/jobs", data={"prompt": "hi", "metadata": raw.decode()})
    assert form.status_code == 400, form.text[:200]


def _endless(sent: list[int], total: int = 256 * 1024 * 1024) -> Iterator[bytes]:
    # A well-formed start, so that it is the size that is refused, not the framing.
    yield b'--x\r\nContent-Disposition: form-data; name="file"; filename="a.png"\r\nContent-Type: image/png\r\n\r\n'
    piece = b"a" * 65536
    while sum(sent) < total:
        sent.append(len(piece))
        yield piece


@pytest.mark.parametrize(("path", "limit"), [("/v1/jobs", MAX_BODY), ("/v1/images", MAX_BODY),
                                             ("/v1/files", MAX_FILE)])
def test_chunked_bodies_over_the_limit_are_cut_off(api: httpx.Client, path: str, limit: int) -> None:
    sent: list[int] = []  # no Content-Length: the server can only count what arrives
    content_type = "application/json" if path == "/v1/jobs" else "multipart/form-data; boundary=x"
    response = api.post(path, content=_endless(sent), headers={"content-type": content_type})
    code, message = error(response, 413)
    assert code == "request_too_large" and "exceeds the limit" in message
    assert sum(sent) < 64 * 1024 * 1024  # far from the 256 MB offered: the server stopped reading
    assert api.get("/healthz").status_code == 200


def test_declared_oversize_body_is_refused_before_it_is_sent(server: ApiServer) -> None:
    with socket.create_connection(("127.0.0.1", server.port), timeout=10) as sock:
        sock.sendall(b"POST /v1/jobs HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     + f"Authorization: Bearer {server.api_key}\r\n".encode()
                     + b"Content-Length: 1000000000000\r\n\r\n")
        answer = b""
        while piece := sock.recv(65536):  # the server closes the connection after its answer
            answer += piece
    assert answer.startswith(b"HTTP/1.1 413"), answer[:200]
    assert b"request_too_large" in answer


def test_service_is_unaffected(api: httpx.Client) -> None:
    ok = api.post("/v1/jobs", json=chat_body(data_url(png_bytes()), text=base64.b64encode(b"fine").decode()))
    assert ok.status_code == 202, ok.text


# --- values neither SQL nor a JSON answer can hold --------------------------------------------------------------

def _body(rest: str, messages: str = '[{"role": "user", "content": "x"}]') -> str:
    """A job body written by hand, since json.dumps can spell neither NaN nor a lone surrogate as a client does."""
    return '{"messages": ' + messages + (", " + rest if rest else "") + "}"


@pytest.mark.parametrize(("raw", "status", "fragment"), [
    (_body('"metadata": {"a": NaN}'), 400, "NaN is not a JSON number"),
    (_body('"metadata": {"a": -Infinity}'), 400, "Infinity is not a JSON number"),
    (_body('"metadata": {"a": [1e999]}'), 400, "out of range"),
    (_body('"metadata": {"a": "\\udc00"}'), 422, "metadata.a contains a lone surrogate"),
    (_body('"metadata": {"\\ud800": 1}'), 422, "a key in metadata"),
    (_body("", '[{"role": "user", "content": "hi \\udfff"}]'), 422, "messages.0.content contains"),
    (_body('"stop": ["\\ud800"]'), 422, "stop.0 contains a lone surrogate"),
    (_body('"seed": 18446744073709551616'), 422, "less than or equal to 9223372036854775807"),
    (_body('"metadata": {"a": "' + "x" * 17_000 + '"}'), 422, "the limit is 16384"),
])
def test_unstorable_values_are_refused_naming_the_field(api: httpx.Client, raw: str, status: int,
                                                        fragment: str) -> None:
    response = api.post("/v1/jobs", content=raw.encode(), headers={"content-type": "application/json"})
    assert response.status_code == status, response.text
    assert fragment in response.json()["error"]["message"]
    assert api.get("/v1/jobs").status_code == 200  # nothing unreadable was stored


def test_bad_requests_do_not_fail_the_requests_beside_them(api: httpx.Client) -> None:
    """Submitted all at once, so that the API writes them in shared transactions: only the bad ones fail."""
    good = [json.dumps(chat_body(text=f"fine {i}")).encode() for i in range(40)]
    bad = [_body('"metadata": {"a": NaN}').encode(), _body('"metadata": {"a": "\\udc00"}').encode()] * 5

    def post(raw: bytes) -> int:
        return api.post("/v1/jobs", content=raw, headers={"content-type": "application/json"}).status_code

    mixed = good[:20] + bad + good[20:]
    with ThreadPoolExecutor(16) as pool:
        codes = list(pool.map(post, mixed))
    assert [c for c, raw in zip(codes, mixed, strict=True) if raw in good] == [202] * 40
    assert all(400 <= c < 500 for c, raw in zip(codes, mixed, strict=True) if raw in bad)


@pytest.mark.parametrize("path", ["/v1/jobs/a%00b", "/v1/files/a%00b", "/v1/batches/a%00b", "/v1/jobs?after=%00",
                                  "/v1/files?after=%00", "/v1/batches?after=%00", "/v1/images/img_%00"])
def test_nul_in_an_id_or_a_cursor_is_a_4xx(api: httpx.Client, path: str) -> None:
    response = api.get(path)
    assert 400 <= response.status_code < 500, (path, response.status_code, response.text)
    assert response.json()["error"]["message"]


def test_batch_metadata_with_a_lone_surrogate_is_refused(api: httpx.Client) -> None:
    file_id = api.post("/v1/files", data={"purpose": "batch"},
                       files={"file": ("in.jsonl", b'{"custom_id": "a", "body": {}}\n')}).json()["id"]
    raw = ('{"input_file_id": "' + file_id + '", "endpoint": "/v1/chat/completions", "completion_window": "24h", '
           '"metadata": {"k": "\\ud800"}}')
    response = api.post("/v1/batches", content=raw.encode(), headers={"content-type": "application/json"})
    assert response.status_code == 422 and "metadata.k contains a lone surrogate" in response.text
    assert api.get("/v1/batches").status_code == 200


def test_a_file_name_with_control_characters_still_downloads(api: httpx.Client) -> None:
    body = (b'--b\r\nContent-Disposition: form-data; name="purpose"\r\n\r\nbatch\r\n'
            b'--b\r\nContent-Disposition: form-data; name="file"; filename="a\x01b\x7f\xc3\xa9.jsonl"\r\n'
            b"Content-Type: application/jsonl\r\n\r\n{}\n\r\n--b--\r\n")
    uploaded = api.post("/v1/files", content=body, headers={"content-type": "multipart/form-data; boundary=b"})
    assert uploaded.status_code == 200, uploaded.text
    assert uploaded.json()["filename"] == "abé.jsonl"
    content = api.get(f"/v1/files/{uploaded.json()['id']}/content")
    assert content.status_code == 200 and content.content == b"{}\n"
    assert content.headers["content-disposition"] == ("attachment; filename=\"ab.jsonl\"; "
                                                      "filename*=UTF-8''ab%C3%A9.jsonl")


def test_multipart_oddities_are_a_400(api: httpx.Client) -> None:
    boundary = "b" * 300
    body = f'--{boundary}\r\nContent-Disposition: form-data; name="purpose"\r\n\r\nbatch\r\n--{boundary}--\r\n'
    for path in ("/v1/files", "/v1/datasets"):
        response = api.post(path, content=body.encode(),
                            headers={"content-type": f"multipart/form-data; boundary={boundary}"})
        _, message = error(response, 400)
        assert "boundary" in message
    _, message = error(api.post("/v1/jobs", data={"prompt": "hi", "max_token": "5"}), 400)
    assert "unknown multipart field(s) 'max_token'" in message
    _, message = error(api.post("/v1/jobs", data={"prompt": "hi", "image": "cat.png"}), 400)
    assert "'image' must be a file" in message
    _, message = error(api.post("/v1/datasets", data={"window": "24h"},
                                files={"manifest": ("m.jsonl", b"{}\n")}), 400)
    assert "unknown multipart field(s) 'window'" in message


def test_a_large_json_body_is_accepted(api: httpx.Client) -> None:
    """Bodies over 64 KiB are parsed off the event loop; the answer is the same."""
    text = "word " * 40_000
    response = api.post("/v1/jobs", json=chat_body(text=text))
    assert response.status_code == 202, response.text[:300]
    assert api.get(f"/v1/jobs/{response.json()['id']}").json()["status"] in ("queued", "running", "succeeded")
