"""The on/off state shared by the hand-written Triton kernels: a failing or wrong probe turns a kernel off for the
process (its fallback serves), and the environment variable turns it off without a probe."""

from __future__ import annotations

import pytest

from workers.engine.kernels.triton_switch import TritonSwitch


def test_probe_failures_turn_the_kernel_off(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("GLIMPSE_TEST_KERNEL", raising=False)
    switch = TritonSwitch("GLIMPSE_TEST_KERNEL")
    assert switch.on() and switch.probe(lambda: True) and switch.on()

    def no_compiler() -> bool:
        raise RuntimeError("no C compiler")

    assert switch.probe(no_compiler) is False  # raised: off, with the reason kept
    assert not switch.on() and switch.why_off() == "RuntimeError: no C compiler"
    assert switch.probe(lambda: True) is False  # stays off: a later probe does not run the kernel again
    switch.reset()
    assert switch.on()
    assert switch.probe(lambda: False) is False and switch.why_off() == "wrong result"


def test_the_environment_turns_it_off_and_a_reset_reads_it_again(monkeypatch: pytest.MonkeyPatch) -> None:
    switch = TritonSwitch("GLIMPSE_TEST_KERNEL")
    monkeypatch.setenv("GLIMPSE_TEST_KERNEL", "0")
    ran: list[bool] = []
    assert not switch.on() and switch.probe(lambda: ran.append(True) or True) is False
    assert ran == [] and switch.why_off() == "GLIMPSE_TEST_KERNEL=0"
    monkeypatch.setenv("GLIMPSE_TEST_KERNEL", "1")
    assert not switch.on()  # the answer is kept: call sites ask on every step
    switch.reset()
    assert switch.on()
