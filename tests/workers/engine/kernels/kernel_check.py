"""The Triton kernels' interpreter checks end alike: after a kernel's own cases, its start-up probe must pass on the
CPU under the interpreter and leave the kernel's switch on. ``run_kernel_check`` appends that ending to a check
script and runs it (tests/workers/engine/interpreted.py), so each test file writes only its own cases.
``check_switch_turns_it_off``: a kernel's environment variable turns it off."""

from __future__ import annotations

from collections.abc import Callable
from types import ModuleType

import pytest
import torch

from tests.workers.engine.interpreted import run_interpreted
from workers.engine.kernels.triton_switch import TritonSwitch


def run_kernel_check(check: str, kernel: str, dtype: str, timeout: float = 600) -> None:
    """Run ``check`` under Triton's interpreter, then ``workers.engine.kernels.<kernel>``'s probe in ``dtype``."""
    probe = (
        "import torch\n"
        f"from workers.engine.kernels import {kernel}\n"
        f'assert {kernel}.probe(torch.device("cpu"), torch.{dtype}) and not {kernel}.SWITCH.broken\n'
        'print("ok")\n'
    )
    run_interpreted("-c", check + probe, timeout=timeout)


def check_switch_turns_it_off(
    monkeypatch: pytest.MonkeyPatch,
    kernel: ModuleType,
    switch: TritonSwitch | None = None,
    available: Callable[[], bool] | None = None,
    probe: Callable[[torch.device, torch.dtype], bool] | None = None,
) -> None:
    """``kernel``'s environment variable at "0" turns it off, its probe with it, and says so. A module with a second
    switch passes it with its own ``available`` and ``probe`` (default: the module's ``SWITCH`` and theirs)."""
    switch = switch or kernel.SWITCH
    monkeypatch.setenv(switch.env, "0")
    switch.reset()
    try:
        assert not (available or kernel.available)()
        assert not (probe or kernel.probe)(torch.device("cpu"), torch.float32)
        assert switch.why_off() == f"{switch.env}=0"
    finally:
        monkeypatch.delenv(switch.env)
        switch.reset()
