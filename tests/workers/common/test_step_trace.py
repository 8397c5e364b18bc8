"""The step trace's profile summary: GPU busy time as the union of kernel spans, and kernels sorted into categories;
and the no-sync mode's switch."""

from __future__ import annotations

from pathlib import Path

import pytest

from workers.common.step_trace import StepTrace, busy_us, category


def test_busy_time_counts_overlapping_kernels_once() -> None:
    # two overlapping kernels (0-2, 1-3), a gap, one kernel with another inside it (5-6 holding 5.5-5.7)
    assert busy_us([(5.5, 5.7), (0, 2), (5, 6), (1, 3)]) == pytest.approx(4.0)
    assert busy_us([]) == 0.0
    assert busy_us([(0, 1), (1, 2)]) == pytest.approx(2.0)  # back to back: no gap, no double count


@pytest.mark.parametrize(
    ("kernel", "want"),
    [
        ("nvjet_sm90_tst_320x128_64x3_1x2_h_bz_coopB_TNT", "GEMM"),
        ("void cublasLt::splitKreduce_kernel<32, 16, int, float, __nv_bfloat16>", "GEMM"),
        ("skinny_gemm_kernel", "GEMM"),
        ("void pytorch_flash::flash_fwd_kernel<Flash_fwd_kernel_traits<128, 128, 64>>", "attention"),
        ("cudnn_generated_fort_native_sdpa_sm90_flash_fprop_wgmma_f16_knob_7", "attention"),
        ("split_kernel", "attention"),
        ("triton_red_fused__to_copy_add_mean_mul_pow_rsqrt_0", "elementwise / norms"),
        ("silu_mul_kernel", "elementwise / norms"),
        ("void at::native::index_elementwise_kernel<128, 4, at::native::index_copy_kernel_impl>", "memory"),
        ("Memcpy HtoD (Pinned -> Device)", "memory"),
        ("kv_write_kernel", "memory"),
        ("some_new_kernel", "other"),
    ],
)
def test_kernels_fall_into_their_category(kernel: str, want: str) -> None:
    assert category(kernel) == want


def test_without_syncs_the_phases_do_not_wait_for_the_gpu(monkeypatch: pytest.MonkeyPatch, tmp_path: object) -> None:
    syncs: list[int] = []
    monkeypatch.setenv("GLIMPSE_STEP_TRACE", str(tmp_path))
    for flag, want in (("1", 1), ("0", 0)):
        monkeypatch.setenv("GLIMPSE_STEP_TRACE_SYNC", flag)
        syncs.clear()
        trace = StepTrace("worker0", sync=lambda: syncs.append(1))
        trace.begin()
        trace.mark("forward")
        trace.end(step=0)
        trace.close()
        assert len(syncs) == want, flag


def _busy_loop() -> int:
    return sum(range(50_000))


def test_python_profile_covers_exactly_its_window_of_steps(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """GLIMPSE_PY_PROFILE=START:COUNT profiles the host's Python over those steps only (no GPU needed): the file
    names the window, and a function called in every step was recorded COUNT times, not once per step traced."""
    monkeypatch.setenv("GLIMPSE_STEP_TRACE", str(tmp_path))
    monkeypatch.setenv("GLIMPSE_PY_PROFILE", "1:2")
    assert not StepTrace("scheduler0")._py_windows  # only the model process (the one given a GPU sync) profiles
    trace = StepTrace("worker0", sync=lambda: None)
    for step in range(5):
        trace.begin()
        _busy_loop()
        trace.mark("forward")
        trace.end(step=step)
    trace.close()
    text = (tmp_path / "python-1.txt").read_text()
    assert text.startswith("2 steps from step 1")
    assert "by tottime:" in text and "by cumulative:" in text
    rows = [line for line in text.splitlines() if "(_busy_loop)" in line]
    assert rows and all(line.split()[0] == "2" for line in rows)  # ncalls: the two profiled steps
    assert [p.name for p in tmp_path.glob("python-*.txt")] == ["python-1.txt"]
