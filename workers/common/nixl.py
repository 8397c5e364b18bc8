"""NIXL (NVIDIA's inference transfer library, ``nixl`` on the package index) for ``--encoder-transport nixl``: the
one place that imports it. The wheels name the module after their CUDA build (``nixl_cu12``, ``nixl_cu13``; the
``nixl`` meta-package re-exports whichever is installed), so each is tried. Agents use the UCX backend: shared
memory or TCP between processes of a host, RDMA between hosts where the fabric has it, GPU memory included.
"""

from __future__ import annotations

import importlib
from typing import Any

MODULES = ("nixl._api", "nixl_cu12._api", "nixl_cu13._api")
BACKEND = "UCX"
INSTALL_HINT = "pip install nixl-cu12 (or nixl-cu13, to match the host's CUDA)"


class NixlMissing(RuntimeError):
    """No NIXL build can be imported here."""


def nixl_api() -> Any:
    """NIXL's Python API module (``nixl_agent``, ``nixl_agent_config``)."""
    errors = []
    for name in MODULES:
        try:
            return importlib.import_module(name)
        except ImportError as exc:
            errors.append(f"{name}: {exc}")
    raise NixlMissing(f"--encoder-transport nixl needs NIXL: {INSTALL_HINT} ({'; '.join(errors)})")


def make_agent(name: str) -> Any:
    """An agent named ``name`` (unique among the agents that will meet it) with the UCX backend and a progress
    thread; no listener: metadata travels in glimpse's own messages."""
    api = nixl_api()
    agent = api.nixl_agent(name, api.nixl_agent_config(enable_prog_thread=True, backends=[BACKEND]))
    if BACKEND not in agent.backends:
        raise NixlMissing(f"NIXL here has no {BACKEND} backend (plugins: {agent.get_plugin_list()})")
    return agent


def mem_type(tensor: Any) -> str:
    """NIXL's memory kind of a torch tensor's storage."""
    return "VRAM" if tensor.is_cuda else "DRAM"
