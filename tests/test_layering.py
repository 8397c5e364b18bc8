"""Config and code flow down: the launcher (server/) builds the config and starts workers; workers/ and ipc/
never import server/, and ipc/ imports nothing of glimpse but itself."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def imported_modules(path: Path) -> set[str]:
    tree = ast.parse(path.read_text(), str(path))
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module)
    return found


@pytest.mark.parametrize(("package", "forbidden"), [("workers", ("server",)), ("ipc", ("server", "workers"))])
def test_lower_layers_do_not_import_upper_ones(package: str, forbidden: tuple[str, ...]) -> None:
    offenders = [
        f"{path.relative_to(ROOT)} imports {module}"
        for path in sorted((ROOT / package).rglob("*.py"))
        for module in sorted(imported_modules(path))
        if module.split(".")[0] in forbidden
    ]
    assert offenders == []


def test_a_family_package_is_one_registry_line_away() -> None:
    """Nothing outside workers/engine/models names a family package: runner, graphs, scheduler, caches and
    IPC go through the registry and the family interface only."""
    offenders = [
        f"{path.relative_to(ROOT)} imports {module}"
        for package in ("workers", "ipc", "server")
        for path in sorted((ROOT / package).rglob("*.py"))
        if "models" not in path.relative_to(ROOT).parts
        for module in sorted(imported_modules(path))
        if module.startswith("workers.engine.models.") and module != "workers.engine.models.base"
    ]
    assert offenders == []
