"""common.images.fetch against real local HTTP(S) servers. Nothing here reaches the internet: non-public
addresses are refused before any connection, and the positive cases serve from loopback, which a test
allows explicitly (`allowed_networks`), under a made-up hostname mapped by the injected resolver."""

from __future__ import annotations

import contextlib
import datetime
import io
import ipaddress
import ssl
import threading
import time
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
from PIL import Image

from common.images.fetch import (
    FETCH_FAILED,
    NOT_ALLOWED,
    ImageFetcher,
    ImageFetchError,
    _system_resolve,
    address_problem,
)

LOOPBACK = [ipaddress.ip_network("127.0.0.0/8")]
HOST = "images.test"  # resolved to 127.0.0.1 by the tests' resolver, never by DNS


def png(colour: tuple[int, int, int] = (10, 200, 30)) -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", (12, 9), colour).save(buf, "PNG")
    return buf.getvalue()


PNG = png()
Route = Callable[[BaseHTTPRequestHandler], None]


class Server:
    """A threaded HTTP(S) server on 127.0.0.1 whose paths are functions; records the requests it saw."""

    def __init__(self, tls: ssl.SSLContext | None = None) -> None:
        self.routes: dict[str, Route] = {}
        self.seen: list[tuple[str, str]] = []  # (path, Host header)
        server = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def do_GET(self) -> None:
                server.seen.append((self.path, self.headers.get("Host", "")))
                route = server.routes.get(self.path.split("?")[0])
                if route is None:
                    self.send_error(404)
                    return
                with contextlib.suppress(BrokenPipeError, ConnectionResetError, ssl.SSLError):
                    route(self)  # the client may hang up on purpose (cap, deadline)

            def log_message(self, *args: object) -> None:
                pass

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        if tls is not None:
            self.httpd.socket = tls.wrap_socket(self.httpd.socket, server_side=True)
        self.port = self.httpd.server_address[1]
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


def send(body: bytes, status: int = 200, headers: dict[str, str] | None = None) -> Route:
    def route(h: BaseHTTPRequestHandler) -> None:
        h.send_response(status)
        for name, value in {"Content-Type": "image/png", "Content-Length": str(len(body)), **(headers or {})}.items():
            h.send_header(name, value)
        h.end_headers()
        h.wfile.write(body)

    return route


def redirect(location: str, status: int = 302) -> Route:
    return send(b"", status, {"Location": location})


def resolver(table: dict[str, list[str]]) -> Callable[[str, int], list[str]]:
    def resolve(host: str, port: int) -> list[str]:
        return table[host] if host in table else _system_resolve(host, port)  # literals, localhost
    return resolve


def fetcher(**kwargs: object) -> ImageFetcher:
    options: dict[str, object] = {"max_bytes": 100_000, "timeout": 5.0, "allow_http": True,
                                  "allowed_networks": LOOPBACK, "resolve": resolver({HOST: ["127.0.0.1"]})}
    return ImageFetcher(**{**options, **kwargs})  # type: ignore[arg-type]


def refused(fetch: ImageFetcher, url: str, code: str = NOT_ALLOWED) -> str:
    with pytest.raises(ImageFetchError) as err:
        fetch.fetch(url)
    assert err.value.code == code, str(err.value)
    return str(err.value)


@pytest.fixture
def server() -> Iterator[Server]:
    s = Server()
    s.routes["/cat.png"] = send(PNG)
    yield s
    s.close()


# --- the address policy ----------------------------------------------------------------------------------

@pytest.mark.parametrize(("address", "problem"), [
    ("127.0.0.1", "loopback"), ("127.8.9.10", "loopback"), ("::1", "loopback"),
    ("10.1.2.3", "private"), ("172.16.0.1", "private"), ("192.168.1.1", "private"), ("fd12:3456::1", "private"),
    ("169.254.169.254", "link-local"), ("fe80::1", "link-local"),
    ("100.64.0.1", "shared/CGNAT"), ("100.127.255.254", "shared/CGNAT"),
    ("224.0.0.1", "multicast"), ("239.255.255.250", "multicast"), ("ff02::1", "multicast"), ("ff0e::1", "multicast"),
    ("240.0.0.1", "private"), ("255.255.255.255", "private"), ("0.0.0.0", "unspecified"), ("::", "unspecified"),
    ("192.0.2.1", "private"), ("198.18.0.1", "private"),  # documentation, benchmarking
    ("::ffff:127.0.0.1", "loopback, embedded in IPv6"), ("::ffff:169.254.169.254", "link-local, embedded in IPv6"),
    ("::ffff:10.0.0.1", "private, embedded in IPv6"), ("2002:7f00:1::", "loopback, embedded in IPv6"),
    ("64:ff9b::a9fe:a9fe", "link-local, embedded in IPv6"), ("64:ff9b:1::1", "NAT64 local-use"),
    ("fec0::1", "site-local"), ("::7f00:1", "reserved"), ("2001:db8::1", "private"),
])
def test_non_public_addresses_have_a_named_problem(address: str, problem: str) -> None:
    assert address_problem(ipaddress.ip_address(address)) == problem


@pytest.mark.parametrize("address", ["8.8.8.8", "1.1.1.1", "93.184.216.34", "2606:4700:4700::1111",
                                     "::ffff:8.8.8.8", "64:ff9b::808:808"])
def test_public_addresses_pass(address: str) -> None:
    assert address_problem(ipaddress.ip_address(address)) is None


def test_allowed_networks_exempt_only_themselves() -> None:
    assert address_problem(ipaddress.ip_address("127.0.0.1"), LOOPBACK) is None
    assert address_problem(ipaddress.ip_address("::1"), LOOPBACK) == "loopback"
    assert address_problem(ipaddress.ip_address("10.0.0.1"), LOOPBACK) == "private"


# --- refusals before any connection ----------------------------------------------------------------------

@pytest.mark.parametrize("url", [
    "https://127.0.0.1/x.png", "https://[::1]/x.png", "https://169.254.169.254/latest/meta-data/",
    "https://[::ffff:127.0.0.1]/x.png", "https://10.0.0.1/x.png", "https://100.64.0.1/", "https://0.0.0.0/",
    "https://[fe80::1]/", "https://[fd00::1]/", "https://224.0.0.1/", "https://2130706433/", "https://0x7f.1/",
])
def test_address_literals_of_every_class_are_refused(url: str) -> None:
    assert "is not a public address" in refused(ImageFetcher(max_bytes=1000), url)


def test_hostnames_are_resolved_and_checked(server: Server) -> None:
    plain = ImageFetcher(max_bytes=1000, allow_http=True)  # the system resolver, no exemptions
    message = refused(plain, f"http://localhost:{server.port}/cat.png")
    assert "'localhost' resolves to" in message and "(loopback)" in message
    # One private answer among public ones is enough to refuse: nothing is connected to.
    mixed = ImageFetcher(max_bytes=1000, resolve=resolver({"mixed.test": ["8.8.8.8", "10.0.0.7"]}))
    assert "10.0.0.7" in refused(mixed, "https://mixed.test/cat.png")
    assert server.seen == []


@pytest.mark.parametrize(("url", "fragment"), [
    ("ftp://example.com/x.png", "only https"), ("file:///etc/passwd", "only https"),
    ("https://user:pw@example.com/x.png", "credentials"), ("https:///x.png", "no host"),
    ("gopher://127.0.0.1:6379/_FLUSHALL", "only https"),
])
def test_unfetchable_urls_are_refused(url: str, fragment: str) -> None:
    assert fragment in refused(ImageFetcher(max_bytes=1000), url)


def test_http_only_when_enabled(server: Server) -> None:
    url = f"http://{HOST}:{server.port}/cat.png"
    assert "only https URLs" in refused(fetcher(allow_http=False), url)
    assert server.seen == []
    assert fetcher(allow_http=True).fetch(url) == PNG


# --- fetching ----------------------------------------------------------------------------------------------

def test_fetch_connects_to_the_vetted_address_with_the_hostname(server: Server) -> None:
    assert fetcher().fetch(f"http://{HOST}:{server.port}/cat.png?size=big") == PNG
    assert server.seen == [("/cat.png?size=big", f"{HOST}:{server.port}")]
    assert "HTTP 404" in refused(fetcher(), f"http://{HOST}:{server.port}/nope.png", FETCH_FAILED)


def test_redirects_are_followed_and_each_hop_checked(server: Server) -> None:
    base = f"http://{HOST}:{server.port}"
    server.routes["/relative"] = redirect("/cat.png", 301)
    server.routes["/to-metadata"] = redirect("http://169.254.169.254/latest/meta-data/iam/")
    server.routes["/to-internal"] = redirect(f"http://internal.test:{server.port}/cat.png", 307)
    server.routes["/to-ipv6-loopback"] = redirect(f"http://[::1]:{server.port}/cat.png", 308)
    server.routes["/to-ftp"] = redirect("ftp://example.com/cat.png")
    server.routes["/loop"] = redirect("/loop")
    server.routes["/no-location"] = send(b"", 302)
    assert fetcher().fetch(f"{base}/relative") == PNG
    assert "169.254.169.254 is not a public address (link-local)" in refused(fetcher(), f"{base}/to-metadata")
    internal = fetcher(resolve=resolver({HOST: ["127.0.0.1"], "internal.test": ["10.0.0.5"]}))
    assert "'internal.test' resolves to 10.0.0.5" in refused(internal, f"{base}/to-internal")
    assert "::1 is not a public address (loopback)" in refused(fetcher(), f"{base}/to-ipv6-loopback")
    assert "only https and http" in refused(fetcher(), f"{base}/to-ftp")
    assert "more than 3 times" in refused(fetcher(max_redirects=3), f"{base}/loop", FETCH_FAILED)
    assert [p for p, _ in server.seen].count("/loop") == 4
    assert "without a Location" in refused(fetcher(), f"{base}/no-location", FETCH_FAILED)
    assert not any(p.startswith("/latest") for p, _ in server.seen)


def test_byte_cap_while_streaming(server: Server) -> None:
    sent: list[int] = []

    def endless(h: BaseHTTPRequestHandler) -> None:  # no Content-Length, never ends on its own
        h.send_response(200)
        h.send_header("Transfer-Encoding", "chunked")
        h.end_headers()
        total = 0
        while total < 50_000_000:
            h.wfile.write(b"10000\r\n" + b"\0" * 0x10000 + b"\r\n")
            total += 0x10000
            sent.append(total)

    server.routes["/endless"] = endless
    server.routes["/declared"] = send(b"x" * 10, headers={"Content-Length": "999999999"})
    server.routes["/gzip"] = send(b"\x1f\x8b" + b"\0" * 100, headers={"Content-Encoding": "gzip"})
    started = time.monotonic()
    assert "limit is 100000 bytes" in refused(fetcher(), f"http://{HOST}:{server.port}/endless", FETCH_FAILED)
    assert time.monotonic() - started < 3
    time.sleep(0.2)
    assert max(sent, default=0) < 20_000_000  # the client hung up; the 50 MB were never all sent
    assert "999999999 bytes" in refused(fetcher(), f"http://{HOST}:{server.port}/declared", FETCH_FAILED)
    assert "Content-Encoding 'gzip'" in refused(fetcher(), f"http://{HOST}:{server.port}/gzip", FETCH_FAILED)
    assert fetcher(max_bytes=len(PNG)).fetch(f"http://{HOST}:{server.port}/cat.png") == PNG


def test_one_deadline_for_the_whole_fetch(server: Server) -> None:
    def hang(h: BaseHTTPRequestHandler) -> None:
        time.sleep(5)

    def drip(h: BaseHTTPRequestHandler) -> None:  # each byte well within any per-read timeout
        h.send_response(200)
        h.send_header("Content-Length", "1000")
        h.end_headers()
        for _ in range(1000):
            h.wfile.write(b"x")
            h.wfile.flush()
            time.sleep(0.1)

    server.routes["/hang"], server.routes["/drip"] = hang, drip
    for path in ("/hang", "/drip"):
        started = time.monotonic()
        assert "longer than 0.8 s" in refused(fetcher(timeout=0.8), f"http://{HOST}:{server.port}{path}",
                                              FETCH_FAILED)
        assert time.monotonic() - started < 2.5


def test_connection_refused_is_a_fetch_failure() -> None:
    with ThreadingHTTPServer(("127.0.0.1", 0), BaseHTTPRequestHandler) as unused:
        port = unused.server_address[1]
    assert "failed" in refused(fetcher(), f"http://{HOST}:{port}/cat.png", FETCH_FAILED)


# --- TLS: verified against the URL's hostname while connecting to the vetted address ---------------------

def _certificate(tmp: Path, name: str) -> tuple[Path, Path]:
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
    now = datetime.datetime.now(datetime.UTC)
    cert = (x509.CertificateBuilder().subject_name(subject).issuer_name(subject).public_key(key.public_key())
            .serial_number(x509.random_serial_number()).not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(hours=1))
            .add_extension(x509.SubjectAlternativeName([x509.DNSName(name)]), critical=False)
            .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
            .sign(key, hashes.SHA256()))
    cert_path, key_path = tmp / f"{name}.crt", tmp / f"{name}.key"
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_path.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                           serialization.NoEncryption()))
    return cert_path, key_path


@pytest.mark.parametrize(("cert_name", "ok"), [(HOST, True), ("other.test", False)])
def test_https_verifies_the_hostname(tmp_path: Path, cert_name: str, ok: bool) -> None:
    pytest.importorskip("cryptography")
    cert, key = _certificate(tmp_path, cert_name)
    tls = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    tls.load_cert_chain(cert, key)
    server = Server(tls)
    server.routes["/cat.png"] = send(PNG)
    try:
        url = f"https://{HOST}:{server.port}/cat.png"
        trusting = ssl.create_default_context(cafile=str(cert))
        if ok:
            assert fetcher(ssl_context=trusting, allow_http=False).fetch(url) == PNG
            assert server.seen == [("/cat.png", f"{HOST}:{server.port}")]
        else:
            assert "hostname" in refused(fetcher(ssl_context=trusting), url, FETCH_FAILED).lower()
        # The default trust store does not know the test's certificate: verification is on by default.
        assert "certificate" in refused(fetcher(), url, FETCH_FAILED).lower()
    finally:
        server.close()
