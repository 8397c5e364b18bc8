"""Image downloads for the tokenizer: async, under one deadline, and guarded against SSRF.

An image URL is the client's choice of where this server connects, so by default a download may
only reach public addresses: the host is resolved, every address it resolves to is checked
(loopback, private, link-local, CGNAT, multicast, reserved and unspecified ranges are refused, IPv4
embedded in IPv6 included), and the connection goes to an address that was checked. The check runs
inside the connection itself (a network backend under httpx's connection pool), so there is no
second DNS lookup for an attacker to answer differently (DNS rebinding), every redirect hop is
checked the same way, and TLS still verifies the URL's host name. Every spelling of an address
(``127.1``, ``2130706433``, ``0x7f000001``, ``[::ffff:127.0.0.1]``) is refused for what it
resolves to, not for how it is written.

Whatever goes wrong (refused address, host outside the allowlist, connection refused, HTTP 404,
timeout, size cap) the client gets the same message: different texts would turn the server into a
port scanner. The reason goes to the log.

The whole fetch (resolution, connection, every redirect hop, headers and body) runs under one
asyncio deadline, which cancels a read in progress: a server dripping a byte a second holds the
fetch for the timeout, not for as long as it likes. Fetches are coroutines, so one slow URL
occupies no thread and delays no other request.
"""

from __future__ import annotations

import asyncio
import ipaddress
import logging
import socket
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass
from typing import Any

import httpcore
import httpx

from workers.common.errors import BadRequest

log = logging.getLogger("glimpse.media")

FETCH_FAILED = "Could not fetch the image."
_HEADERS = {"User-Agent": "glimpse-media/0.1", "Accept": "image/*"}
_DEFAULT_PORTS = {"http": 80, "https": 443}
_CGNAT = ipaddress.IPv4Network("100.64.0.0/10")  # not is_private in Python 3.11, yet not public
_NAT64 = ipaddress.IPv6Network("64:ff9b::/96")  # well-known NAT64 prefix: the last 32 bits are IPv4
_V4_COMPAT = ipaddress.IPv6Network("::/96")  # deprecated IPv4-compatible form, ::a.b.c.d
_MAX_CONNECTIONS = 1024  # per tokenizer: slow URLs hold one each, and must not starve the others

IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address
IPNetwork = ipaddress.IPv4Network | ipaddress.IPv6Network
# host, port -> the addresses to try (numeric strings); the system resolver unless a test injects one.
Resolver = Callable[[str, int], Awaitable[list[str]]]


class FetchRefused(Exception):
    """Why a download was refused or failed; logged, never shown to the client."""


class AddressRefused(httpcore.ConnectError):
    """The guard refused an address. A ConnectError, so httpx reports it like any failed connect."""


# ---- which addresses a download may reach ----------------------------------------------------------


def _embedded_v4(ip: ipaddress.IPv6Address) -> ipaddress.IPv4Address | None:
    """The IPv4 address an IPv6 one stands for (v4-mapped, v4-compatible, NAT64, 6to4, Teredo)."""
    if ip.ipv4_mapped is not None:
        return ip.ipv4_mapped
    if ip.sixtofour is not None:
        return ip.sixtofour
    if ip.teredo is not None:
        return ip.teredo[1]  # (server, client): the client is where packets end up
    if ip in _NAT64 or (ip in _V4_COMPAT and int(ip) > 1):
        return ipaddress.IPv4Address(int(ip) & 0xFFFFFFFF)
    return None


def classify(ip: IPAddress) -> str:
    """"public", "private" (loopback, RFC 1918, ULA, link-local, CGNAT and other non-global ranges:
    refused unless the operator allows them) or "forbidden" (unspecified, multicast, broadcast,
    reserved: never a media host, refused always)."""
    if isinstance(ip, ipaddress.IPv6Address) and (v4 := _embedded_v4(ip)) is not None:
        inner = classify(v4)
        if ip.ipv4_mapped is not None or inner != "public":
            return inner  # a mapped address *is* the IPv4 one; for the others the worse answer wins
    if ip.is_unspecified or ip.is_multicast:
        return "forbidden"
    if isinstance(ip, ipaddress.IPv4Address) and (ip.is_reserved or ip == ipaddress.IPv4Address("255.255.255.255")):
        return "forbidden"
    # is_global alone misses CGNAT on 3.11 and counts multicast as global; reserved IPv6 space
    # (IPv4-compatible, unallocated) is no one's public media host either.
    if not ip.is_global or ip.is_private or ip.is_loopback or ip.is_link_local or ip in _CGNAT:
        return "private"
    if isinstance(ip, ipaddress.IPv6Address) and (ip.is_reserved or ip.is_site_local):
        return "private"
    return "public"


@dataclass(frozen=True)
class _Exemption:
    network: IPNetwork | None  # None: every private address ("*")
    port: int | None  # None: any port


def parse_private_exemptions(entries: Iterable[str]) -> list[_Exemption]:
    """``*`` (every private address), ``ADDR`` or ``CIDR`` (any port), ``ADDR:PORT``, ``[V6]:PORT``."""
    out = []
    for raw in entries:
        entry = raw.strip()
        if not entry:
            continue
        if entry == "*":
            out.append(_Exemption(None, None))
            continue
        port: int | None = None
        if entry.startswith("["):
            addr, _, rest = entry[1:].partition("]")
            if rest:
                port = int(rest.removeprefix(":"))
        elif entry.count(":") == 1:
            addr, _, port_text = entry.partition(":")
            port = int(port_text)
        else:
            addr = entry
        out.append(_Exemption(ipaddress.ip_network(addr, strict=False), port))
    return out


class AddressPolicy:
    """Decides whether a download may connect to ``ip:port``."""

    def __init__(self, exemptions: Iterable[str] = ()) -> None:
        self.exemptions = parse_private_exemptions(exemptions)

    def refusal(self, address: str, port: int) -> str | None:
        """None if allowed, else why not (for the log)."""
        try:
            ip: IPAddress = ipaddress.ip_address(address.split("%", 1)[0])  # drop an IPv6 zone id
        except ValueError:
            return f"{address!r} is not an IP address"
        kind = classify(ip)
        if kind == "public":
            return None
        if kind == "private":
            plain = ip.ipv4_mapped if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped else ip
            for ex in self.exemptions:
                in_net = ex.network is None or (plain.version == ex.network.version and plain in ex.network)
                if in_net and ex.port in (None, port):
                    return None
        return f"address {address} port {port} is {kind}"


async def system_resolver(host: str, port: int) -> list[str]:
    """Every address getaddrinfo gives for ``host`` (numeric spellings such as 127.1 included)."""
    infos = await asyncio.get_running_loop().getaddrinfo(host, port, type=socket.SOCK_STREAM)
    return list(dict.fromkeys(str(info[4][0]) for info in infos))


class _GuardedBackend(httpcore.AsyncNetworkBackend):
    """httpcore's network backend with the address check between resolution and connect: the
    connection goes to an address that was checked, never to a name resolved a second time."""

    def __init__(self, policy: AddressPolicy, resolver: Resolver) -> None:
        self.policy, self.resolver = policy, resolver
        self._inner = httpcore.AnyIOBackend()

    async def connect_tcp(
        self,
        host: str,
        port: int,
        timeout: float | None = None,
        local_address: str | None = None,
        socket_options: Iterable[Any] | None = None,
    ) -> httpcore.AsyncNetworkStream:
        try:
            addresses = await self.resolver(host, port)
        except OSError as exc:
            raise httpcore.ConnectError(f"cannot resolve {host!r}: {exc}") from None
        if not addresses:
            raise httpcore.ConnectError(f"{host!r} resolves to no address")
        # All or nothing: a name that also resolves to a refused address is not trusted for the others.
        for address in addresses:
            if (why := self.policy.refusal(address, port)) is not None:
                raise AddressRefused(f"{host!r} refused: {why}")
        error: Exception | None = None
        for address in addresses:
            try:
                return await self._inner.connect_tcp(
                    address, port, timeout=timeout, local_address=local_address, socket_options=socket_options
                )
            except (httpcore.ConnectError, httpcore.ConnectTimeout) as exc:
                error = exc
        assert error is not None
        raise error

    async def connect_unix_socket(
        self, path: str, timeout: float | None = None, socket_options: Iterable[Any] | None = None
    ) -> httpcore.AsyncNetworkStream:
        raise httpcore.ConnectError("unix sockets are not media hosts")

    async def sleep(self, seconds: float) -> None:
        await asyncio.sleep(seconds)


class _GuardedTransport(httpx.AsyncHTTPTransport):
    def __init__(self, backend: httpcore.AsyncNetworkBackend) -> None:
        # Environment proxies are ignored (trust_env=False): through a proxy, the address checked
        # would be the proxy's, and the proxy would resolve the media host itself.
        super().__init__(trust_env=False)
        # httpx has no public setting for the network backend: the pool is rebuilt around ours.
        self._pool = httpcore.AsyncConnectionPool(
            ssl_context=httpx.create_ssl_context(trust_env=False),
            max_connections=_MAX_CONNECTIONS,
            max_keepalive_connections=32,
            keepalive_expiry=5.0,
            network_backend=backend,
        )


# ---- which hosts (and ports) an operator allows ----------------------------------------------------


def _split_host_port(entry: str) -> tuple[str, str | None]:
    if entry.startswith("["):
        host, _, rest = entry[1:].partition("]")
        return host, rest.removeprefix(":") or None
    if entry.count(":") == 1:
        host, _, port = entry.partition(":")
        return host, port
    return entry, None


class DomainAllowlist:
    """``--allowed-media-domains``: ``host`` (the scheme's default port only), ``host:port``,
    ``host:*``; ``*.example.com`` also admits subdomains. Empty: any host."""

    def __init__(self, entries: Iterable[str]) -> None:
        self.entries = [
            (host.lower().rstrip("."), port) for host, port in (_split_host_port(e.strip()) for e in entries if e.strip())
        ]

    def allows(self, url: httpx.URL) -> bool:
        if not self.entries:
            return True
        host = url.host.lower().rstrip(".")
        port = url.port or _DEFAULT_PORTS.get(url.scheme)
        for allowed, allowed_port in self.entries:
            host_ok = host == allowed or (allowed.startswith("*.") and host.endswith(allowed[1:]))
            port_ok = allowed_port == "*" or (
                int(allowed_port) == port if allowed_port else port == _DEFAULT_PORTS.get(url.scheme)
            )
            if host_ok and port_ok:
                return True
        return False


# ---- the download -----------------------------------------------------------------------------------


class HttpMediaClient:
    """Downloads image URLs for one tokenizer process; owns one pooled httpx.AsyncClient. Use it
    from one event loop."""

    def __init__(
        self,
        max_bytes: int,
        timeout_s: float,
        allowed_domains: Iterable[str] = (),
        allowed_private: Iterable[str] = (),
        max_redirects: int = 5,
        resolver: Resolver | None = None,
    ) -> None:
        self.max_bytes, self.timeout_s, self.max_redirects = max_bytes, timeout_s, max_redirects
        self.allowlist = DomainAllowlist(allowed_domains)
        backend = _GuardedBackend(AddressPolicy(allowed_private), resolver or system_resolver)
        self.client = httpx.AsyncClient(
            transport=_GuardedTransport(backend), headers=_HEADERS, timeout=timeout_s, trust_env=False
        )

    async def aclose(self) -> None:
        await self.client.aclose()

    async def fetch(self, url: str, param: str | None = None) -> bytes:
        """The body behind ``url``; BadRequest with the one generic message on any failure."""
        try:
            async with asyncio.timeout(self.timeout_s):
                return await self._fetch(url)
        except TimeoutError:
            reason = f"no complete answer within {self.timeout_s:g} s"
        except FetchRefused as exc:
            reason = str(exc)
        except (httpx.HTTPError, httpx.InvalidURL, httpcore.ConnectError) as exc:
            reason = f"{type(exc).__name__}: {exc}"
        except (ValueError, UnicodeError) as exc:  # e.g. a URL httpx cannot even parse
            reason = f"{type(exc).__name__}: {exc}"
        log.info("image fetch refused or failed (%s): %s", url if len(url) <= 200 else url[:200] + "...", reason)
        raise BadRequest(FETCH_FAILED, param=param, code="image_fetch_failed")

    async def _fetch(self, url: str) -> bytes:
        request = self.client.build_request("GET", url)
        for _ in range(self.max_redirects + 1):
            if request.url.scheme not in _DEFAULT_PORTS:
                raise FetchRefused(f"scheme {request.url.scheme!r} is not http(s)")
            if not self.allowlist.allows(request.url):
                raise FetchRefused(f"{request.url.host}:{request.url.port} is not in --allowed-media-domains")
            response = await self.client.send(request, stream=True, follow_redirects=False)
            try:
                if response.next_request is not None:
                    request = response.next_request  # checked like the first URL on the next round
                    continue
                if not response.is_success:
                    raise FetchRefused(f"HTTP {response.status_code} from {request.url}")
                return await self._read_capped(response)
            finally:
                await response.aclose()
        raise FetchRefused(f"more than {self.max_redirects} redirects")

    async def _read_capped(self, response: httpx.Response) -> bytes:
        cap = self.max_bytes
        declared = response.headers.get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > cap:
            raise FetchRefused(f"declared {declared} bytes, over the {cap}-byte cap")
        buf = bytearray()
        # aiter_bytes yields decoded content: the cap also bounds a gzip bomb's expansion.
        async for chunk in response.aiter_bytes():
            buf += chunk
            if len(buf) > cap:
                raise FetchRefused(f"body over the {cap}-byte cap")
        return bytes(buf)
