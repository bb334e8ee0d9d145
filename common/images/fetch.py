"""Fetching remote images (``https`` URLs in image parts) without letting a request reach into our network.

The URL is chosen by whoever submits the job, so fetching it is a request this server makes on their behalf
(server-side request forgery): to a cloud metadata endpoint, a database on the private network, an admin
port on localhost. The defences, in order:

- off unless ``image_urls_enabled``; ``https`` only unless ``image_url_allow_http``; no credentials in URLs;
- every address the host resolves to must be public (``address_problem``): loopback, private, link-local
  (169.254.169.254 included), CGNAT, multicast, reserved, unspecified, their IPv6 equivalents and IPv4
  addresses embedded in IPv6 (mapped, 6to4, NAT64) are refused;
- the connection goes to the very address that was vetted: resolution and connection happen in one network
  backend, so a DNS answer cannot change (rebinding) between the check and the connect; TLS still verifies
  the certificate against the URL's hostname (SNI is the hostname, not the address);
- redirects are followed by hand, at most ``max_redirects``, and every hop is checked like the first;
- one deadline for the whole fetch (a server dripping a byte a second cannot hold a worker), and the byte
  cap is enforced while streaming: a response is abandoned as soon as it passes the cap.

Torch-free: the API process fetches at submit time.
"""

from __future__ import annotations

import ipaddress
import socket
import ssl
import time
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from functools import lru_cache
from typing import TYPE_CHECKING

import httpcore
import httpx

if TYPE_CHECKING:
    from common.infra.settings import Settings

IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address
IPNetwork = ipaddress.IPv4Network | ipaddress.IPv6Network
Resolver = Callable[[str, int], list[str]]

NOT_ALLOWED = "image_url_not_allowed"
FETCH_FAILED = "image_fetch_failed"
_REDIRECTS = {301, 302, 303, 307, 308}
_CGNAT = ipaddress.ip_network("100.64.0.0/10")
_NAT64 = ipaddress.ip_network("64:ff9b::/96")
_NAT64_LOCAL = ipaddress.ip_network("64:ff9b:1::/48")
# getaddrinfo has no timeout of its own; a few threads let a lookup be abandoned at the deadline.
_dns_pool = ThreadPoolExecutor(max_workers=4, thread_name_prefix="vlmq-dns")


class ImageFetchError(ValueError):
    """The URL is refused (``code`` image_url_not_allowed) or could not be fetched (image_fetch_failed)."""

    def __init__(self, message: str, code: str = FETCH_FAILED) -> None:
        super().__init__(message)
        self.code = code


def address_problem(address: IPAddress, allowed: Sequence[IPNetwork] = ()) -> str | None:
    """Why connecting to `address` is refused (a short class name such as 'loopback'), or None if it is a
    public address (or inside one of the `allowed` networks)."""
    if any(address.version == net.version and address in net for net in allowed):
        return None
    if isinstance(address, ipaddress.IPv6Address):
        # These reach an IPv4 host: judge that host. Mapped (::ffff:a.b.c.d) is how dual-stack sockets
        # spell IPv4; 6to4 and NAT64 gateways forward to the embedded address.
        embedded = address.ipv4_mapped or address.sixtofour
        if embedded is None and address in _NAT64:
            embedded = ipaddress.IPv4Address(int(address) & 0xFFFFFFFF)
        if embedded is not None:
            problem = address_problem(embedded, allowed)
            return f"{problem}, embedded in IPv6" if problem else None
        if address in _NAT64_LOCAL:
            return "NAT64 local-use"
        if address.is_site_local:
            return "site-local"
    checks = (
        ("unspecified", address.is_unspecified),
        ("loopback", address.is_loopback),
        ("link-local", address.is_link_local),
        ("multicast", address.is_multicast),
        ("shared/CGNAT", address.version == 4 and address in _CGNAT),
        ("private", address.is_private),
        ("reserved", address.is_reserved),
    )
    for name, hit in checks:
        if hit:
            return name
    return None if address.is_global else "not globally routable"


def _is_literal(host: str) -> bool:
    try:
        ipaddress.ip_address(host)
    except ValueError:
        return False
    return True


def _system_resolve(host: str, port: int) -> list[str]:
    infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    return list(dict.fromkeys(str(info[4][0]) for info in infos))


class _VettingBackend(httpcore.SyncBackend):
    """Resolves the host once, refuses it unless every address is allowed, and connects to those addresses."""

    def __init__(self, resolve: Resolver, allowed: Sequence[IPNetwork], deadline: Callable[[], float]) -> None:
        self.resolve, self.allowed, self.deadline = resolve, allowed, deadline

    def vet(self, host: str, port: int) -> list[IPAddress]:
        future = _dns_pool.submit(self.resolve, host, port)
        try:
            found = future.result(timeout=max(0.01, self.deadline() - time.monotonic()))
        except FutureTimeout:
            raise ImageFetchError(f"looking up {host!r} timed out") from None
        except (OSError, UnicodeError) as exc:
            raise ImageFetchError(f"cannot resolve image URL host {host!r}: {exc}") from None
        try:
            addresses = [ipaddress.ip_address(a.split("%", 1)[0]) for a in found]
        except ValueError as exc:
            raise ImageFetchError(f"cannot resolve image URL host {host!r}: {exc}") from None
        if not addresses:
            raise ImageFetchError(f"image URL host {host!r} has no address")
        # Refuse when *any* answer is not public: a host that mixes public and private answers is probing.
        for address in addresses:
            problem = address_problem(address, self.allowed)
            if problem is not None:
                where = host if _is_literal(host) else f"{host!r} resolves to {address}, which"
                raise ImageFetchError(f"image URL host {where} is not a public address ({problem})", NOT_ALLOWED)
        return addresses

    def connect_tcp(self, host: str, port: int, timeout: float | None = None, local_address: str | None = None,
                    socket_options: Iterable[httpcore.SOCKET_OPTION] | None = None) -> httpcore.NetworkStream:
        failure: Exception | None = None
        for address in self.vet(host, port):
            try:
                # An address literal: create_connection does no second lookup that could be answered differently.
                return super().connect_tcp(str(address), port, timeout, local_address, socket_options)
            except httpcore.ConnectError as exc:
                failure = exc
        assert failure is not None
        raise failure


class _VettingTransport(httpx.HTTPTransport):
    def __init__(self, backend: _VettingBackend, ssl_context: ssl.SSLContext) -> None:
        super().__init__(verify=ssl_context, trust_env=False)
        # httpx takes no network backend argument (encode/httpx#3180), so its pool is rebuilt with ours;
        # handle_request (exception mapping, streaming) stays httpx's own.
        self._pool = httpcore.ConnectionPool(ssl_context=ssl_context, network_backend=backend, max_connections=2,
                                             retries=0)


@lru_cache(maxsize=1)
def _default_ssl_context() -> ssl.SSLContext:
    # Loading the CA bundle takes milliseconds; one verified context serves every fetch.
    return httpx.create_ssl_context()


class ImageFetcher:
    """Fetch one image URL under the rules above; `fetch` returns its bytes or raises ImageFetchError."""

    def __init__(self, *, max_bytes: int, timeout: float = 10.0, allow_http: bool = False, max_redirects: int = 5,
                 allowed_networks: Sequence[IPNetwork] = (), resolve: Resolver = _system_resolve,
                 ssl_context: ssl.SSLContext | None = None) -> None:
        self.max_bytes, self.timeout, self.allow_http = max_bytes, timeout, allow_http
        self.max_redirects, self.allowed_networks, self.resolve = max_redirects, tuple(allowed_networks), resolve
        self.ssl_context = ssl_context

    def fetch(self, url: str) -> bytes:
        deadline = time.monotonic() + self.timeout
        backend = _VettingBackend(self.resolve, self.allowed_networks, lambda: deadline)
        transport = _VettingTransport(backend, self.ssl_context or _default_ssl_context())
        # trust_env=False: a proxy from HTTPS_PROXY would connect for us, to addresses we never vetted.
        with httpx.Client(transport=transport, trust_env=False, follow_redirects=False,
                          headers={"User-Agent": "vlmq-image-fetch", "Accept": "image/*",
                                   "Accept-Encoding": "identity"}) as client:
            target = self._check_url(url)
            for _ in range(self.max_redirects + 1):
                location = self._get(client, target, deadline)
                if isinstance(location, bytes):
                    return location
                target = self._check_url(str(target.join(location)))
        raise ImageFetchError(f"image URL redirected more than {self.max_redirects} times")

    def _check_url(self, url: str) -> httpx.URL:
        shown = url if len(url) <= 200 else url[:200] + "..."
        try:
            parsed = httpx.URL(url)
        except (httpx.InvalidURL, ValueError, TypeError) as exc:
            raise ImageFetchError(f"invalid image URL {shown!r}: {exc}", NOT_ALLOWED) from None
        schemes = ("https", "http") if self.allow_http else ("https",)
        if parsed.scheme not in schemes:
            raise ImageFetchError(f"image URL {shown!r}: only {' and '.join(schemes)} URLs are fetched", NOT_ALLOWED)
        if not parsed.host:
            raise ImageFetchError(f"image URL {shown!r} has no host", NOT_ALLOWED)
        if parsed.userinfo:
            raise ImageFetchError("image URLs may not carry credentials (user:password@)", NOT_ALLOWED)
        return parsed

    def _get(self, client: httpx.Client, url: httpx.URL, deadline: float) -> bytes | str:
        """The body of a 200 answer, or the Location of a redirect."""
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise ImageFetchError(f"fetching the image URL took longer than {self.timeout:g} s")
        try:
            with client.stream("GET", url, timeout=httpx.Timeout(remaining)) as response:
                if response.status_code in _REDIRECTS:
                    location: str | None = response.headers.get("location")
                    if not location:
                        raise ImageFetchError(f"image URL answered {response.status_code} without a Location")
                    return location
                if response.status_code != 200:
                    raise ImageFetchError(f"image URL answered HTTP {response.status_code}")
                encoding = response.headers.get("content-encoding", "identity").strip().lower()
                if encoding not in ("", "identity"):
                    # Decoding would let a small compressed answer expand past the cap inside one chunk.
                    raise ImageFetchError(f"image URL answered with Content-Encoding {encoding!r}; send the "
                                          "image itself")
                declared = response.headers.get("content-length", "")
                if declared.isdigit() and int(declared) > self.max_bytes:
                    raise self._too_large(f"{declared} bytes")
                return self._read(response, deadline)
        except httpx.TimeoutException:
            raise ImageFetchError(f"fetching the image URL took longer than {self.timeout:g} s") from None
        except httpx.HTTPError as exc:
            raise ImageFetchError(f"fetching the image URL failed: {exc or type(exc).__name__}") from None

    def _read(self, response: httpx.Response, deadline: float) -> bytes:
        body = bytearray()
        # Pieces as they arrive: a chunk size would make httpx wait to fill it, past the deadline.
        for chunk in response.iter_raw():
            body += chunk
            if len(body) > self.max_bytes:
                raise self._too_large(f"more than {self.max_bytes} bytes")
            if time.monotonic() > deadline:
                raise ImageFetchError(f"fetching the image URL took longer than {self.timeout:g} s")
        return bytes(body)

    def _too_large(self, size: str) -> ImageFetchError:
        return ImageFetchError(f"the image at the URL is {size}; the limit is {self.max_bytes} bytes")


def fetcher_for(settings: Settings) -> ImageFetcher:
    return ImageFetcher(max_bytes=settings.max_image_bytes, timeout=settings.image_url_timeout_seconds,
                        allow_http=settings.image_url_allow_http, max_redirects=settings.image_url_max_redirects,
                        allowed_networks=settings.image_url_allowed_networks)
