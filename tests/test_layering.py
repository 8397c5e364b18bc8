"""The tree is the architecture: each room imports only the rooms below it, and nothing imports in a circle.

Rooms, bottom up (``ALLOWED`` says exactly what each may import besides itself):
- ``ipc``: messages, sockets, shared memory; nothing of glimpse.
- ``workers.common``: what several process roles share (errors, tool calls, detokenizer, process set-up).
- the engine, a library every role may use: ``kernels`` (attention backends, Triton/fused ops) <- ``layers``
  (tensor-parallel linears, vision attention) <- ``models`` (family interface, registry, families) <- ``prompt``
  (processor, pixel frames, video prompts); ``core`` (sequences, KV and embedding caches, the scheduling core);
  ``runner`` (model runner, sampling, graphs, warm-up) over all of those; ``offline`` (the in-process engine).
- ``workers.config``: the frozen config every process is given.
- the process roles ``workers.tokenizer``, ``workers.scheduler``, ``workers.model``, ``workers.encoder``: each talks to the others
  only through ``ipc`` messages, so none imports another.
- ``server``: the frontend, launcher and CLI, which start the roles.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("ipc", "workers", "server", "benchmarks")

ENGINE = "workers.engine"
ALLOWED: dict[str, set[str]] = {
    "ipc": set(),
    "workers.common": {"ipc"},
    f"{ENGINE}.kernels": set(),
    f"{ENGINE}.layers": {f"{ENGINE}.kernels"},
    f"{ENGINE}.models": {f"{ENGINE}.kernels", f"{ENGINE}.layers", "ipc"},
    f"{ENGINE}.config": {f"{ENGINE}.models"},
    f"{ENGINE}.prompt": {f"{ENGINE}.models", "ipc", "workers.common"},
    f"{ENGINE}.core": {"ipc", "workers.common"},
    f"{ENGINE}.runner": {
        f"{ENGINE}.{room}" for room in ("kernels", "layers", "models", "config", "prompt", "core")
    } | {"ipc", "workers.common"},
    f"{ENGINE}.offline": {f"{ENGINE}.{room}" for room in ("config", "core", "prompt", "runner")}
    | {"ipc", "workers.common"},
    "workers.config": {f"{ENGINE}.config", "ipc"},
}
_ROLE_BASE = {"ipc", "workers.common", "workers.config"} | {r for r in ALLOWED if r.startswith(ENGINE)}
ROLES = ("workers.tokenizer", "workers.scheduler", "workers.model", "workers.encoder")
ALLOWED.update({role: _ROLE_BASE for role in ROLES})


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def modules() -> dict[str, Path]:
    return {module_name(p): p for pkg in PACKAGES for p in sorted((ROOT / pkg).rglob("*.py"))}


def imported(source: str, name: str, is_package: bool, known: dict[str, Path]) -> set[str]:
    """The glimpse modules module ``name`` imports, TYPE_CHECKING blocks and function-level imports included; a
    ``from package import name`` counts the submodule when ``name`` is one."""
    tree = ast.parse(source, name)
    package = name if is_package else name.rpartition(".")[0]
    found: set[str] = set()

    def add(module: str) -> None:
        while module and module not in known:
            module = module.rpartition(".")[0]
        if module and module != name:
            found.add(module)

    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                add(alias.name)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parent = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                base = ".".join([*parent, base] if base else parent)
            for alias in node.names:
                add(f"{base}.{alias.name}")
    return found


GRAPH = {name: imported(path.read_text(), name, path.name == "__init__.py", modules()) for name, path in modules().items()}


def room(module: str) -> str:
    """The longest room in ALLOWED (or a top-level package) that holds ``module``."""
    parts = module.split(".")
    for n in range(len(parts), 0, -1):
        if ".".join(parts[:n]) in ALLOWED:
            return ".".join(parts[:n])
    return parts[0]


def edges() -> Iterator[tuple[str, str]]:
    for source, targets in GRAPH.items():
        for target in targets:
            yield source, target


@pytest.mark.parametrize("source_room", sorted(ALLOWED))
def test_a_room_imports_only_the_rooms_below_it(source_room: str) -> None:
    offenders = [
        f"{source} imports {target}"
        for source, target in sorted(edges())
        if room(source) == source_room and room(target) not in ALLOWED[source_room] | {source_room}
    ]
    assert offenders == []


def test_every_workers_module_sits_in_a_room() -> None:
    """A new module lands in a room whose rules it obeys, not loose beside them."""
    loose = [m for m in GRAPH if m.startswith("workers.") and room(m) not in ALLOWED]
    loose = [m for m in loose if m not in ("workers.engine",)]
    assert loose == []


def test_no_import_cycles() -> None:
    """Tarjan's strongly connected components over every import, type-only ones included."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(GRAPH[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                cycles.append(sorted(component))

    for v in sorted(GRAPH):
        if v not in index:
            visit(v)
    assert cycles == []


def test_type_only_and_relative_imports_count() -> None:
    """The checks above read TYPE_CHECKING imports and resolve relative ones: a type-only import back from a
    module's importee is a cycle too."""
    source = (
        "from typing import TYPE_CHECKING\nfrom . import batching\n"
        "if TYPE_CHECKING:\n    from workers.engine.runner.model_runner import ModelRunner\n"
    )
    found = imported(source, "workers.engine.runner.warmup", False, modules())
    assert found == {"workers.engine.runner.model_runner", "workers.engine.runner.batching"}


def test_nothing_but_the_registry_names_a_family_package() -> None:
    """Nothing outside workers/engine/models names a family package: runner, graphs, scheduler, caches and IPC go
    through the registry and the family interface only."""
    packages = {m for m, path in modules().items() if path.name == "__init__.py" and m.startswith(f"{ENGINE}.models.")}
    families = {m for m in GRAPH if any(m == p or m.startswith(f"{p}.") for p in packages)}
    offenders = [
        f"{s} imports {t}"
        for s, t in sorted(edges())
        if t in families and not s.startswith(f"{ENGINE}.models") and s.split(".")[0] in ("workers", "ipc", "server")
    ]
    assert families and offenders == []


def test_workers_never_import_server() -> None:
    offenders = [f"{s} imports {t}" for s, t in sorted(edges()) if s.startswith(("workers", "ipc")) and t.startswith("server")]
    assert offenders == []
