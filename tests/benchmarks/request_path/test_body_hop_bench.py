"""The body-hop benchmark runs end to end (two processes, the real channels); it reports times, it asserts none."""

from __future__ import annotations

from benchmarks.request_path.body_hop_bench import hop_ms


def test_hop_bench_gets_every_body_across() -> None:
    lat = hop_ms(200_000, count=5, gap_s=0.01)  # past ZERO_COPY_BYTES: the body goes as a frame of its own
    assert len(lat) == 3 and all(v > 0 for v in lat)
