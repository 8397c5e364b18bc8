"""The Triton kernels' start-up probes (kernel_probes.py): run together on threads, each under inference mode on the
worker's device, answers in the probes' order, and one warning for each kernel a probe turned off."""

from __future__ import annotations

import logging
import threading
import time

import pytest
import torch

from workers.engine.kernels.triton_switch import TritonSwitch
from workers.engine.runner import kernel_probes
from workers.engine.runner.kernel_probes import Probe, probe_kernels


def test_probes_overlap_keep_their_order_and_warn_for_each_kernel_turned_off(
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    seen: list[tuple[str, bool, str]] = []
    barrier = threading.Barrier(3, timeout=10)  # the last three meet: they only get past it running together

    def probe(name: str, answer: bool, waits: bool) -> Probe:
        switch = TritonSwitch(f"GLIMPSE_TEST_{name.upper()}")
        monkeypatch.delenv(switch.env, raising=False)
        monkeypatch.setattr("workers.engine.kernels.triton_switch._triton_imports", lambda: True)

        def run(device: torch.device, dtype: torch.dtype) -> bool:
            assert (device, dtype) == (torch.device("cpu"), torch.bfloat16)
            seen.append((name, torch.is_inference_mode_enabled(), threading.current_thread().name))
            if waits:
                barrier.wait()
            else:
                time.sleep(0.05)  # the first runs alone: the others have not started when it ends
            return switch.probe(lambda: answer)

        return Probe(run, switch, f"the {name} kernel is off (%s); its fallback serves")

    probes = [probe("first", True, False), probe("a", False, True), probe("b", True, True), probe("c", False, True)]
    with caplog.at_level(logging.WARNING, logger="glimpse.model"):
        assert probe_kernels(probes, torch.device("cpu"), torch.bfloat16) == [True, False, True, False]
    assert seen[0][:2] == ("first", True) and seen[0][2] == threading.current_thread().name
    assert {n for n, _, _ in seen[1:]} == {"a", "b", "c"} and all(inference for _, inference, _ in seen)
    assert all(thread.startswith("triton-probe") for _, _, thread in seen[1:])
    warnings = [r.getMessage() for r in caplog.records]
    assert warnings == ["the a kernel is off (wrong result); its fallback serves",
                        "the c kernel is off (wrong result); its fallback serves"]  # fmt: skip
    assert probe_kernels([], torch.device("cpu"), torch.bfloat16) == []


def test_every_family_probes_its_kernels_once() -> None:
    probes = [*kernel_probes.TOWER, *kernel_probes.LM, *kernel_probes.RECURRENT]
    assert len({p.run for p in probes}) == len(probes) == 14
    assert len({id(p.switch) for p in probes}) == len(probes)  # a switch per kernel: one's failure spares the rest
    assert all(p.off.count("%s") == 1 for p in probes)
