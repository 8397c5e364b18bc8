"""Every benchmark script with a CPU mode runs here with its smallest arguments: it must exit 0 and print its
table's header. The scripts run one after another in one child process (``python tests/benchmarks/
test_cpu_smoke.py OUT``), so torch and the engine are imported once (~10 s on a 2-core box) and the test
process keeps its own state; each script still gets its own ``sys.argv`` and ``__main__``. Scripts that need
CUDA are listed in ``GPU_ONLY`` and run (same smallest-arguments rule) only where a GPU is present.

benchmarks/README.md lists every script and which of them have a CPU mode.
"""

from __future__ import annotations

import contextlib
import gc
import io
import json
import os
import runpy
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[2]
TRACE = "{trace}"  # replaced by the driver's step-trace folder (tp_bench writes it, step_trace reads it)
OUT = "{out}"  # replaced by a scratch folder

# (module under benchmarks/, arguments, a line of its table's header). Order matters: step_trace reads the
# records tp_bench's scheduler and model worker wrote.
CPU: list[tuple[str, list[str], str]] = [
    ("engine.engine_bench", ["--shape", "demo", "--device", "cpu", "--images", "1", "--resolution", "720p",
                             "--max-tokens", "2", "--kv-cache-mb", "64", "--mm-cache-mb", "64"],
     "mode      tokens  prep s  TTFT s"),
    ("engine.engine_step_bench", ["--shape", "demo", "--device", "cpu", "--images", "1", "--batch", "2",
                                  "--decode-tokens", "8", "--record-steps", "1", "--kv-cache-mb", "64"],
     "decode@2:"),
    ("engine.precision_check", ["--shape", "demo", "--device", "cpu", "--batch", "2"], "argmax equal"),
    ("engine.plan_bytes_bench", ["--resolutions", "720p", "--images", "2", "--decode-steps", "1"],
     "res            grid  pixel MB  tokens"),
    ("engine.sched_plan_bench", ["--rounds", "2", "--passes", "1"], "| round | prompt tokens | block |"),
    ("engine.step_mix_sim", ["--requests", "8", "--caps", "2048"], "| image cap | chunk grid | steps |"),
    ("engine.step_budget_sim", ["--requests", "8", "--variants", "2048:1"], "| chunk | encode cost | steps |"),
    ("engine.host_tier_bench", ["--chats", "2", "--rounds", "2", "--images-per-round", "1", "--resolution", "720p",
                                "--max-tokens", "1", "--small-kv-blocks", "60", "--big-kv-blocks", "512",
                                "--kv-host-cache-mb", "16", "--mm-host-cache-mb", "16"],
     "| engine | TTFT round 1, ms | late TTFT mean, ms |"),
    ("engine.sampling_bench", ["--shape", "demo", "--device", "cpu", "--batch", "4", "--max-tokens", "4",
                               "--rounds", "1"], "demo shapes, dummy weights, cpu"),
    ("engine.tp_bench", ["--shape", "demo", "--device", "cpu", "--tp", "1", "--images", "1", "--decode-tokens", "4",
                         "--broadcast-res", "", "--kv-cache-mb", "64", "--max-model-len", "8192"],
     " tp  TTFT s  tokens  decode tok/s"),
    ("tools.step_trace", [TRACE], "| where | seconds | of window | count | ms each | note |"),
    ("tools.load_floor", ["--shape", "qwen3.5-35b-a3b", "--layers", "4", "--server", "vLLM=7.18", "--goal", "1.3",
                          "--trace", f"{ROOT}/tests/benchmarks/fixtures/trace-qwen3.5-9b-b"],
     "| part | floor, s | traced run, s | floor / run |"),
    ("tools.itl_plot", [f"{OUT}/itl.png", f"run={ROOT}/tests/benchmarks/fixtures/serving-itl.json",
                        "--marks", "other=50:9,100:40"], "p99.9"),
    ("engine.video_bench", ["--decode-only", "--decode-seconds", "0.5"], "  size  all frames/s  sampled frames/s"),
    ("engine.snapshot_prefill_bench", ["--shape", "demo", "--device", "cpu", "--words", "60", "--reps", "1"],
     "| prompt tokens | rounds, ms | kept states, ms |"),
    ("kernels.gated_delta_bench", ["--device", "cpu", "--prefill", "64", "--batch", "2", "--heads", "2,4", "--dim", "32",
                                   "--reps", "1"], "| case | tokens | path | ms per call | tokens/s |"),
    ("kernels.compile_bench", ["--candidates", "2", "--workers", "2"], "| how | seconds |"),
    ("kernels.fp8_gemm_bench", ["--device", "cpu", "--size", "tiny", "--rows", "1", "--chunks", "16", "--reps", "1"],
     "| M | proj | N x K | bf16 ms | w8a16 ms | rowwise ms |"),
    ("checkpoints", [f"{OUT}/ck", "--shape", "qwen3-8b", "--quantize", "fp8-block", "--layers", "2"],
     "(qwen3-8b, fp8-block, 2 layers)"),
    ("request_path.fresh_image_bench", ["--count", "1"], "stage    variant"),
    ("request_path.multiturn_prep_bench", ["--rounds", "2", "--passes", "1"], "round images"),
    ("request_path.tokenizer_bench", ["--workers", "1", "--requests", "2", "--json", f"{OUT}/tok.json"],
     "workers threads mode   requests images  images/s"),
    ("request_path.grammar_bench", ["--vocab", "500", "--repeat", "1"], "engine        compile+1st mask (ms)"),
    ("serving.startup_bench", ["--shape", "demo", "--runs", "1"], "| /health, s | (model worker's GC pauses), s |"),
    ("request_path.landing_bench", ["--sizes-mb", "1", "--reps", "1"], "| MiB | shm: land | shm: read + copy |"),
]

# Scripts that allocate on CUDA (or are sized for a GPU server) and the smallest run of each.
GPU_ONLY: dict[str, list[str]] = {
    "engine.family_bench": ["--shapes", "7b", "--images", "1", "--decode-tokens", "4"],
    "engine.decode_profile": ["--layers", "4", "--top", "5"],
    "engine.load_bench": ["--demo", "qwen3_vl_moe", "--rounds", "1"],
    "engine.vit_bench": ["--images", "1", "--prefill-tokens", "1024"],
    "engine.gemma4_vit_bench": ["--images", "1", "--budgets", "70", "--reps", "2"],
    "engine.qwen3_vit_bench": ["--images", "1", "--rounds", "1", "--reps", "1"],
    "engine.piecewise_bench": ["--repeats", "1", "--load-requests", "8", "--running", "4", "--base-words", "200"],
    "kernels.attn_bench": ["--chunks", "1024:4096"],
    "kernels.paged_decode_bench": [],
    "kernels.moe_bench": ["--rows", "1,2", "--shapes", "qwen3-30b-a3b"],
    "kernels.rope_bench": ["--tokens", "1,64"],
    "kernels.silu_bench": [],
    "kernels.split_norm_bench": ["--rows"],
    "kernels.skinny_gemm_bench": ["--rows", "1,16"],
    "kernels.elementwise_bench": ["--passes", "hybrid,vit-pad"],
    "kernels.fla_configs": ["--dest", f"{OUT}/fla", "--heads", "2:4", "--tokens", "256"],
}
# Scripts with a CPU mode that start whole servers: their paths are the serving tests' (tests/server,
# tests/benchmarks/serving/test_bench_client.py); a run here would cost minutes of the CI budget.
SERVERS: dict[str, str] = {
    "side_by_side": "--shape demo starts transformers and two glimpse servers (~2-3 min on 2 cores)",
    "serving.first_requests": "starts one glimpse server per --servers",
    "serving.dp_bench": "a server per --dp value with a 16 GiB KV cache: sized for GPUs",
    "serving.encoder_bench": "a server per variant (dp_bench's, 16 GiB KV cache): sized for GPUs",
    "serving.fp8_bench": "a server per variant (dp_bench's, 16 GiB KV cache): sized for GPUs",
    "serving.bench_client": "is `glimpse bench`; tests/benchmarks/serving/test_bench_client.py drives it on a live server",
    "tools.sbs_setup": "copies ../shared's harness, absent from a clone: tests/benchmarks/test_sbs_setup.py runs it on one",
    "tools.fp8_checkpoint": "copies a checkpoint directory: tests/benchmarks/test_fp8_checkpoint.py runs it on a two-shard demo",
}


def _fill(args: list[str], trace: str, out: str) -> list[str]:
    return [a.replace(TRACE, trace).replace(OUT, out) for a in args]


def drive(runs: list[tuple[str, list[str]]], result_path: Path) -> None:
    """Run each ``benchmarks.<module>`` as ``__main__`` in this process, one after another; write for each its exit
    status, stdout, the end of any traceback and its seconds to ``result_path`` (JSON)."""
    import torch

    threads = torch.get_num_threads()
    results: dict[str, dict[str, Any]] = {}
    with tempfile.TemporaryDirectory() as scratch:
        trace = Path(scratch) / "trace"
        trace.mkdir()
        out = Path(scratch) / "out"
        out.mkdir()
        for module, args in runs:
            if module == "engine.tp_bench":
                os.environ["GLIMPSE_STEP_TRACE"] = str(trace)  # its scheduler and model worker inherit it
            buffer, code, error = io.StringIO(), 0, ""
            sys.argv = [f"benchmarks/{module.replace('.', '/')}.py", *_fill(args, str(trace), str(out))]
            started = time.perf_counter()
            try:
                with contextlib.redirect_stdout(buffer):
                    runpy.run_module(f"benchmarks.{module}", run_name="__main__", alter_sys=True)
            except SystemExit as stop:
                code = stop.code if isinstance(stop.code, int) else (0 if stop.code is None else 1)
            except BaseException:  # noqa: BLE001 - every failure is the script's result, reported by its test
                code, error = 1, traceback.format_exc()[-4000:]
            finally:
                os.environ.pop("GLIMPSE_STEP_TRACE", None)
                torch.set_num_threads(threads)  # fresh_image_bench and grammar_bench change it
                gc.collect()
            results[module] = {"code": code, "stdout": buffer.getvalue(), "error": error,
                               "seconds": round(time.perf_counter() - started, 1)}
            result_path.write_text(json.dumps(results))  # after each, so a crash still reports the earlier ones


def _run_driver(runs: list[tuple[str, list[str]]], result_path: Path, timeout: float) -> dict[str, Any]:
    plan = result_path.with_suffix(".plan.json")
    plan.write_text(json.dumps(runs))
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run([sys.executable, __file__, str(plan), str(result_path)], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=timeout)
    found: dict[str, Any] = json.loads(result_path.read_text()) if result_path.exists() else {}
    found["_driver"] = {"code": proc.returncode, "stderr": proc.stderr[-4000:]}
    return found


@pytest.fixture(scope="module")
def cpu_runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    found = _run_driver([(m, a) for m, a, _ in CPU], tmp_path_factory.mktemp("smoke") / "cpu.json", timeout=900)
    print("\nseconds per script: " + ", ".join(f"{m} {r['seconds']}" for m, r in found.items() if m != "_driver"))
    return found


def _check(found: dict[str, Any], module: str, header: str | None) -> None:
    run = found.get(module)
    assert run is not None, f"benchmarks.{module} did not run; driver: {found['_driver']}"
    assert run["code"] == 0, f"benchmarks.{module} exited {run['code']}:\n{run['error']}\n{run['stdout'][-2000:]}"
    if header is not None:
        assert header in run["stdout"], f"benchmarks.{module} printed no table header:\n{run['stdout'][-2000:]}"


@pytest.mark.parametrize(("module", "header"), [(m, h) for m, _, h in CPU], ids=[m for m, _, _ in CPU])
def test_cpu_mode_runs_and_prints_its_table(cpu_runs: dict[str, Any], module: str, header: str) -> None:
    _check(cpu_runs, module, header)


def test_precision_check_reports_every_path_with_equal_greedy_tokens(cpu_runs: dict[str, Any]) -> None:
    """It drives the real Engine through engine_step_bench's spy on the sampler, so a change to the sampler's
    signature breaks it here rather than on a GPU lease. On the CPU every path is float32: the same argmax."""
    rows = [line for line in cpu_runs["engine.precision_check"]["stdout"].splitlines() if "rel L2" in line]
    assert len(rows) == 6, rows
    for row in rows:
        got, total = row.split("argmax equal")[1].split()[0].split("/")
        assert got == total and int(total) > 0, row


def test_every_script_is_smoked_or_has_a_reason() -> None:
    """A new script lands in one of the lists (a CPU run, a GPU run, or a server's reason)."""
    scripts = {
        ".".join(p.relative_to(ROOT / "benchmarks").with_suffix("").parts)
        for p in (ROOT / "benchmarks").rglob("*.py")
        if p.name != "__init__.py"
    }
    # imported by the scripts (bench_cli is `glimpse bench`'s parser, run through server.cli) or, for vllm_compat,
    # by vLLM's own process in the side-by-side harness: no entry point
    library = {"args", "serving.bench_plot", "serving.bench_figures", "serving.bench_cli",
               "vllm_compat.sitecustomize"}
    soak = {s for s in scripts if s.startswith("serving.soak")}  # tests/benchmarks/serving/ owns the soak's tests
    listed = {m for m, _, _ in CPU} | set(GPU_ONLY) | set(SERVERS) | library | soak
    assert scripts - listed == set()
    assert listed - library - soak - scripts == set()


@pytest.mark.gpu
@pytest.mark.parametrize("module", sorted(GPU_ONLY))
def test_gpu_script_runs(module: str, tmp_path: Path) -> None:
    import torch

    if not torch.cuda.is_available():
        pytest.skip(f"benchmarks.{module} needs CUDA, and torch finds no CUDA device here")
    found = _run_driver([(module, GPU_ONLY[module])], tmp_path / "gpu.json", timeout=900)
    _check(found, module, None)


if __name__ == "__main__":
    drive([(m, a) for m, a in json.loads(Path(sys.argv[1]).read_text())], Path(sys.argv[2]))
