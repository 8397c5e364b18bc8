"""startup_bench's phases from a server log: each phase ends at its line's timestamp (the graphs at the last of
theirs), the model worker's imports end where its "loaded ... in X s" says it began, lines without a stamp and
phases the log lacks are skipped."""

from __future__ import annotations

from benchmarks.serving.startup_bench import phases, stamp

LOG = """\
2026-12-04 00:33:20,000 INFO glimpse.launcher[1] started model[0] (pid 2) before the config; handed it now
2026-12-04 00:33:24,000 INFO glimpse.launcher[1] started scheduler[0] pid 3
INFO:     Started server process [1]
2026-12-04 00:33:31,000 INFO [glimpse.model[0]] glimpse.model: Qwen3VLForConditionalGeneration ready: 36 layers, tp 0/1
2026-12-04 00:33:33,500 INFO [glimpse.model[0]] glimpse.model: embedding host tier: 8704.0 MiB pinned
2026-12-04 00:33:39,000 INFO [glimpse.model[0]] glimpse.model: fused kernels ready in 4.0 s (probes 1.2 s, skinny GEMM tiles 0.8 s, call sites 2.0 s)
2026-12-04 00:33:42,000 INFO [glimpse.model[0]] glimpse.model: step shapes warmed in 3.09 s (ViT calls of [1])
2026-12-04 00:33:42,500 INFO [glimpse.model[0]] glimpse.model: state snapshot paths warmed in 0.50 s (3 autotunes compiled on threads so far)
2026-12-04 00:33:43,000 INFO [glimpse.model[0]] workers.engine.runner.cuda_graphs: 11 decode graphs captured in 0.6 s
2026-12-04 00:33:45,000 INFO [glimpse.model[0]] workers.engine.runner.piecewise_graphs: 1406 piecewise graphs (19 buckets up to 1024 tokens) captured in 2.1 s
2026-12-04 00:33:45,500 INFO [glimpse.model[0]] glimpse.model[0]: loaded /tmp/ck in 15.5s: 1536 KV blocks of 128 tokens
2026-12-04 00:33:45,600 INFO [glimpse.model[0]] glimpse.model[0]: start-up garbage collections: 812 (23 full), 4.21 s paused, longest 412 ms
2026-12-04 00:33:46,000 INFO glimpse.launcher[1] all children ready
"""


def test_phases_end_at_their_lines() -> None:
    launched = stamp(LOG.splitlines()[0])
    assert launched is not None and stamp("INFO:     Started server process [1]") is None
    got = phases(LOG, launched - 1.0)
    assert got == {"config built": 5.0, "weights": 12.0, "host tier": 14.5, "fused kernels": 20.0,
                   "step shapes": 23.0, "state snapshots": 23.5, "graphs": 26.0, "imports": 11.0, "all ready": 27.0, "gc": 4.21}  # fmt: skip


def test_a_cpu_log_has_no_gpu_phases() -> None:
    lines = [line for line in LOG.splitlines() if "glimpse.model: " not in line and "graphs" not in line]
    got = phases("\n".join(lines), stamp(LOG.splitlines()[0]) or 0.0)
    assert set(got) == {"config built", "imports", "all ready", "gc"}
