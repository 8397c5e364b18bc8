"""Whether one of the hand-written Triton kernels may run in this process (SiLU*up, the skinny GEMM, the KV write).

A kernel is on unless its environment variable is "0", Triton does not import, or its start-up probe failed. The
probe runs the kernel once against a reference: an exception (no C compiler for Triton's launcher, an unsupported
card) or a wrong answer turns it off for the rest of the process, so its fallback serves instead of a request failing
mid-serving. Call sites ask on every step, so the answer is kept until something changes it.
"""

from __future__ import annotations

import os
from collections.abc import Callable


class TritonSwitch:
    def __init__(self, env: str) -> None:
        self.env = env
        self.broken: list[str] = []  # why the probe turned the kernel off
        self._on: bool | None = None

    def on(self) -> bool:
        if self._on is None:
            self._on = os.environ.get(self.env, "1") != "0" and not self.broken and _triton_imports()
        return self._on

    def reset(self) -> None:
        """Ask again (after the environment variable changed, or to forget a failed probe in tests)."""
        self.broken.clear()
        self._on = None

    def probe(self, check: Callable[[], bool]) -> bool:
        """Run ``check`` (True: the kernel's answer matched its reference) once, if the kernel is on; whether it
        stays on."""
        if not self.on():
            return False
        try:
            right = check()
        except Exception as exc:  # noqa: BLE001 - any failure means: do not use it
            self.broken.append(f"{type(exc).__name__}: {exc}")
        else:
            if not right:
                self.broken.append("wrong result")
        self._on = None
        return self.on()

    def why_off(self) -> str:
        if self.broken:
            return "; ".join(self.broken)
        return f"{self.env}=0" if os.environ.get(self.env, "1") == "0" else "no Triton"


def _triton_imports() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True
