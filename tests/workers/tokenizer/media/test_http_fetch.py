"""Image downloads: real HTTP from a loopback server, the deadline under a drip, the address guard
(every spelling, redirects, a resolver that changes its answer) and one message for every failure."""

from __future__ import annotations

import asyncio
import ipaddress
import time
from collections.abc import Iterator

import pytest

from tests.conftest import noise_image
from tests.media_server import MediaServer
from tests.workers.tokenizer.media.test_fetch import encode
from workers.common.errors import BadRequest
from workers.tokenizer.media.fetch import MediaFetcher, MediaLimits
from workers.tokenizer.media.http_fetch import FETCH_FAILED, AddressPolicy, Resolver, classify

PNG = encode(noise_image(40, 30, seed=1), "PNG")


@pytest.fixture(scope="module")
def media() -> Iterator[MediaServer]:
    server = MediaServer(PNG)
    yield server
    server.close()


def limits(**kw: object) -> MediaLimits:
    base: dict[str, object] = {"max_bytes": 1 << 20, "timeout_s": 5.0, "allowed_private": ("127.0.0.1",)}
    return MediaLimits(**(base | kw))  # type: ignore[arg-type]


async def fetch(url: str, lim: MediaLimits, resolver: Resolver | None = None) -> bytes:
    fetcher = MediaFetcher(lim, resolver)
    try:
        return await fetcher.fetch(url, "p")
    finally:
        await fetcher.aclose()


async def refused(url: str, lim: MediaLimits, resolver: Resolver | None = None) -> None:
    with pytest.raises(BadRequest) as info:
        await fetch(url, lim, resolver)
    err = info.value
    # One answer whatever the cause: a port scanner learns nothing from the text.
    assert (err.status, err.message, err.code, err.param) == (400, FETCH_FAILED, "image_fetch_failed", "p")


async def test_fetch_and_redirect(media: MediaServer) -> None:
    fetcher = MediaFetcher(limits())
    try:
        assert await fetcher.fetch(media.url("/img.png")) == PNG
        assert await fetcher.fetch(media.url(f"/redirect?to={media.url('/img.png')}")) == PNG
        # Several at once, in order.
        urls = [(media.url("/img.png"), None), (media.url("/redirect?to=/img.png"), None)]
        assert await fetcher.fetch_all(urls) == [PNG, PNG]
    finally:
        await fetcher.aclose()


@pytest.mark.parametrize("path", ["/missing", "/big", "/big-unsized", "/redirect-loop", "/redirect?to=ftp://x/y"])
async def test_failures_share_one_message(media: MediaServer, path: str) -> None:
    await refused(media.url(path), limits(max_bytes=1024))


async def test_connection_refused_and_bad_urls_share_it_too() -> None:
    await refused("http://127.0.0.1:1/img.png", limits())
    await refused("http://exa mple.com/x.png", limits())
    await refused("http://[::1/x.png", limits())


async def test_deadline_holds_while_bytes_drip(media: MediaServer) -> None:
    start = time.monotonic()
    await refused(media.url("/drip"), limits(timeout_s=1.0))
    elapsed = time.monotonic() - start
    assert 1.0 <= elapsed < 1.5, elapsed  # one deadline for the whole fetch, enforced mid-read


# ---- the address guard ---------------------------------------------------------------------------

SPELLINGS = [  # all of them loopback, private, link-local, CGNAT, multicast, reserved or unspecified
    "127.0.0.1", "127.1", "2130706433", "0x7f000001", "017700000001", "127.000.000.001", "0.0.0.0", "0",
    "localhost", "[::1]", "[::]", "[::ffff:127.0.0.1]", "[::ffff:7f00:1]", "[0:0:0:0:0:ffff:127.0.0.1]",
    "[::127.0.0.1]", "[64:ff9b::127.0.0.1]", "[2002:7f00:1::]", "10.0.0.1", "172.16.0.1", "192.168.1.1",
    "169.254.169.254", "100.64.0.1", "224.0.0.1", "239.255.255.250", "255.255.255.255", "240.0.0.1",
    "198.18.0.1", "[fe80::1]", "[fc00::1]", "[fd00::1]", "[ff02::1]", "[::ffff:10.0.0.1]", "[::ffff:169.254.169.254]",
]


async def test_every_spelling_of_a_private_address_is_refused(media: MediaServer) -> None:
    before = sum(media.hits.values())
    for host in SPELLINGS:
        await refused(f"http://{host}:{media.port}/img.png", limits(allowed_private=()))
    assert sum(media.hits.values()) == before  # not one of them reached the server


@pytest.mark.parametrize(
    ("address", "kind"),
    [
        ("8.8.8.8", "public"), ("2606:4700::1111", "public"), ("::ffff:8.8.8.8", "public"),
        ("127.0.0.1", "private"), ("100.127.255.255", "private"), ("::ffff:192.168.0.1", "private"),
        ("2001:0:4136:e378:8000:63bf:80ff:fffe", "private"),  # Teredo to 127.0.0.1
        ("0.0.0.0", "forbidden"), ("::", "forbidden"), ("224.0.0.1", "forbidden"), ("ff02::1", "forbidden"),
        ("255.255.255.255", "forbidden"), ("::ffff:0.0.0.0", "forbidden"),
    ],
)
def test_classify(address: str, kind: str) -> None:
    assert classify(ipaddress.ip_address(address)) == kind


def test_exemptions_name_addresses_networks_and_ports() -> None:
    policy = AddressPolicy(["127.0.0.1:8080", "10.0.0.0/8", "[::1]:9000"])
    assert policy.refusal("127.0.0.1", 8080) is None and policy.refusal("::ffff:127.0.0.1", 8080) is None
    assert policy.refusal("127.0.0.1", 8081) is not None and policy.refusal("127.0.0.2", 8080) is not None
    assert policy.refusal("10.1.2.3", 1) is None and policy.refusal("::1", 9000) is None
    assert policy.refusal("0.0.0.0", 8080) is not None  # unspecified: never, whatever is exempt
    star = AddressPolicy(["*"])
    assert star.refusal("192.168.0.1", 80) is None and star.refusal("224.0.0.1", 80) is not None
    assert AddressPolicy([]).refusal("93.184.216.34", 80) is None


async def test_every_redirect_hop_is_checked(media: MediaServer) -> None:
    # Only this server's port is exempt: the first hop is allowed, a hop anywhere else is not.
    exempt = limits(allowed_private=(f"127.0.0.1:{media.port}",))
    assert await fetch(media.url("/img.png"), exempt) == PNG
    other = MediaServer(PNG)
    try:
        targets = [f"http://{h}:{other.port}/img.png" for h in ("127.0.0.1", "localhost", "127.1", "[::ffff:127.0.0.1]")]
        targets += [f"http://[::1]:{media.port}/img.png", f"http://0.0.0.0:{media.port}/img.png"]
        for target in targets:
            await refused(media.url(f"/redirect?to={target}"), exempt)
        assert sum(other.hits.values()) == 0
    finally:
        other.close()


async def test_dns_rebinding_cannot_swap_the_checked_address(media: MediaServer) -> None:
    """A resolver that answers a public address first and loopback afterwards: the connection goes
    to the address that was checked, so the loopback server never hears of it."""
    answers: list[str] = []

    async def rebinding(host: str, port: int) -> list[str]:
        answer = "192.0.2.1" if not answers else "127.0.0.1"  # TEST-NET-1: refused by the guard too
        answers.append(answer)
        return [answer]

    before = sum(media.hits.values())
    await refused(f"http://rebind.test:{media.port}/img.png", limits(allowed_private=(), timeout_s=1.0), rebinding)
    assert answers == ["192.0.2.1"]  # resolved once, checked, refused: no second lookup to win

    public: list[str] = []

    async def public_then_loopback(host: str, port: int) -> list[str]:
        public.append("8.8.8.8" if not public else "127.0.0.1")
        return [public[-1]]

    # A public first answer passes the guard; the connection then goes to 8.8.8.8 (unreachable from a
    # test box, or not an image server), never to a second answer pointing at loopback.
    await refused(f"http://rebind.test:{media.port}/img.png", limits(allowed_private=(), timeout_s=1.0), public_then_loopback)
    assert public == ["8.8.8.8"] and sum(media.hits.values()) == before


async def test_allowlist_names_hosts_and_ports(media: MediaServer) -> None:
    port = media.port
    only_default_port = limits(allowed_domains=("localhost",))
    await refused(f"http://localhost:{port}/img.png", only_default_port)  # a bare host means port 80/443
    assert await fetch(f"http://localhost:{port}/img.png", limits(allowed_domains=(f"localhost:{port}",))) == PNG
    assert await fetch(f"http://localhost:{port}/img.png", limits(allowed_domains=("localhost:*",))) == PNG
    # A redirect to a host (or port) outside the list is refused on that hop.
    on_list = limits(allowed_domains=(f"localhost:{port}",))
    await refused(f"http://localhost:{port}/redirect?to=http://127.0.0.1:{port}/img.png", on_list)
    await refused(f"http://example.com:{port}/img.png", on_list)


async def test_many_slow_fetches_do_not_delay_a_fast_one(media: MediaServer) -> None:
    fetcher = MediaFetcher(limits(timeout_s=3.0))
    try:
        slow = [asyncio.ensure_future(fetcher.fetch(media.url("/drip"))) for _ in range(8)]
        await asyncio.sleep(0.3)
        start = time.monotonic()
        assert await fetcher.fetch(media.url("/img.png")) == PNG
        assert time.monotonic() - start < 0.5
        for task in slow:
            task.cancel()
        await asyncio.gather(*slow, return_exceptions=True)
        deadline = time.monotonic() + 3
        while media.drips_open and time.monotonic() < deadline:  # cancelling closed their connections
            await asyncio.sleep(0.05)
        assert media.drips_open == 0
    finally:
        await fetcher.aclose()
