"""Static checks of the deployment files (docker/) and of the README's flag table.

No docker engine or systemd is needed: the Dockerfile and the unit are parsed, their command lines are
run through glimpse's own argument parser (parse only, nothing is served), and the health check's
Python is run against a local HTTP server.
"""

from __future__ import annotations

import argparse
import configparser
import http.server
import json
import re
import shlex
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from server.cli import build_parser
from server.config import ServerConfig
from server.serve_cli import run_serve
from workers.engine.config import EngineConfig

ROOT = Path(__file__).resolve().parent.parent
DOCKERFILE = ROOT / "docker" / "Dockerfile"
UNIT = ROOT / "docker" / "glimpse.service"
README = ROOT / "README.md"
DEFAULTS = ServerConfig(EngineConfig(model="unused"), launch_id="defaults", served_model_name="unused")


# ---- Dockerfile ----------------------------------------------------------------------------------


def dockerfile_stages() -> list[list[tuple[str, str]]]:
    """Instructions (KEYWORD, arguments) per build stage, continuation lines joined, comments dropped."""
    stages: list[list[tuple[str, str]]] = []
    logical = ""
    for line in DOCKERFILE.read_text().splitlines():
        stripped = line.strip()
        if not stripped or stripped.startswith("#"):
            continue  # comments may also sit between continuation lines
        if stripped.endswith("\\"):
            logical += stripped[:-1] + " "
            continue
        logical += stripped
        keyword, _, rest = logical.partition(" ")
        logical = ""
        if keyword.upper() == "FROM":
            stages.append([])
        elif not stages:
            continue  # ARG before the first FROM
        stages[-1].append((keyword.upper(), rest.strip()))
    return stages


def final_stage() -> list[tuple[str, str]]:
    stages = dockerfile_stages()
    assert stages, "no FROM in the Dockerfile"
    return stages[-1]


def instructions(keyword: str) -> list[str]:
    return [rest for kw, rest in final_stage() if kw == keyword]


def exec_form(keyword: str) -> list[str]:
    """The last KEYWORD of the final stage, which must be in JSON (exec) form."""
    found = instructions(keyword)
    assert found, f"the final stage has no {keyword}"
    value = json.loads(found[-1])
    assert isinstance(value, list) and all(isinstance(v, str) for v in value), value
    return value


def serve_args(argv: list[str]) -> argparse.Namespace:
    """What `glimpse ARGV` would run with; ARGV must start with `serve`."""
    args = build_parser().parse_args(argv)
    assert args.handler is run_serve, argv
    return args


def test_dockerfile_runs_as_a_non_root_user() -> None:
    users = instructions("USER")
    assert users, "the final stage must switch to a non-root USER"
    user = users[-1].split(":")[0]
    assert user not in ("root", "0"), users


def test_dockerfile_exposes_the_default_port() -> None:
    ports = {p.split("/")[0] for e in instructions("EXPOSE") for p in e.split()}
    assert DEFAULTS.port == 8000 and "8000" in ports, ports


def test_dockerfile_entrypoint_serves_on_every_interface_and_takes_user_flags() -> None:
    entrypoint = exec_form("ENTRYPOINT")
    assert "glimpse" in entrypoint, entrypoint
    argv = entrypoint[entrypoint.index("glimpse") + 1 :]
    # CMD must be empty, so `docker run IMAGE --model ...` appends the user's flags.
    assert exec_form("CMD") == []
    args = serve_args([*argv, "--model", "/models/Qwen2.5-VL-7B-Instruct", "--tp", "2"])
    assert args.host == "0.0.0.0" and args.model == "/models/Qwen2.5-VL-7B-Instruct" and args.tp == 2
    # PID 1 is an init (tini) that forwards signals, or the README must tell users to pass --init.
    assert Path(entrypoint[0]).name == "tini" or "--init" in (ROOT / "docker" / "README.md").read_text()
    assert instructions("STOPSIGNAL")[-1:] == ["SIGTERM"]


def test_dockerfile_copies_every_package_it_installs() -> None:
    copies = [rest.split() for kw, rest in dockerfile_stages()[0] if kw == "COPY"]
    sources = {src.rstrip("/") for parts in copies for src in parts[:-1] if not src.startswith("--")}
    assert {"pyproject.toml", "README.md", "server", "workers", "ipc"} <= sources, sources
    for src in sources:
        assert (ROOT / src).exists(), f"COPY {src}: no such path in the repository"
    ignored = (ROOT / ".dockerignore").read_text().split()
    assert ".venv" in ignored and ".git" in ignored


class _Health(http.server.BaseHTTPRequestHandler):
    status = 200

    def do_GET(self) -> None:  # noqa: N802 (the name http.server calls)
        code = self.status if self.path == "/health" else 404
        self.send_response(code)
        self.end_headers()
        self.wfile.write(b'{"status":"ok"}' if code == 200 else b"{}")

    def log_message(self, format: str, *args: object) -> None:
        pass


@pytest.fixture
def health_server() -> Iterator[tuple[http.server.HTTPServer, type[_Health]]]:
    handler = type("Handler", (_Health,), {})
    server = http.server.HTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield server, handler
    server.shutdown()
    server.server_close()


def test_dockerfile_healthcheck_probes_health_with_python_alone(
    health_server: tuple[http.server.HTTPServer, type[_Health]],
) -> None:
    checks = instructions("HEALTHCHECK")
    assert len(checks) == 1, checks
    options, sep, command = checks[0].partition("CMD ")
    assert sep, "HEALTHCHECK must have a CMD (not NONE)"
    argv = json.loads(command)
    assert argv[:2] == ["python3", "-c"], "the health check needs nothing but the image's python (no curl)"
    code = argv[2]
    assert "http://127.0.0.1:8000/health" in code
    assert "--start-period" in options  # model loading must not count as failures
    # Run the probe for real, pointed at a stand-in server: 0 when healthy, non-zero on 503 or no server.
    server, handler = health_server
    probe = code.replace("127.0.0.1:8000", f"127.0.0.1:{server.server_address[1]}")
    assert subprocess.run([sys.executable, "-c", probe], capture_output=True, timeout=30).returncode == 0
    handler.status = 503
    assert subprocess.run([sys.executable, "-c", probe], capture_output=True, timeout=30).returncode != 0


# ---- systemd unit --------------------------------------------------------------------------------


def unit() -> configparser.ConfigParser:
    parser = configparser.ConfigParser(strict=False, interpolation=None)
    parser.optionxform = str  # type: ignore[assignment,method-assign]  # systemd keys are case-sensitive
    parser.read_string(UNIT.read_text())
    return parser


def test_unit_is_a_notify_service_that_drains_on_stop() -> None:
    service = unit()["Service"]
    assert service["Type"] == "notify"
    assert service["NotifyAccess"] == "main"  # READY=1 comes from the launcher, the main process
    assert service["Restart"] == "on-failure"
    assert service["KillMode"] == "mixed"
    assert service.get("KillSignal", "SIGTERM") == "SIGTERM"
    assert service["User"] not in ("root", "0")
    # The stop timeout must outlast the drain plus the children's shutdown (launcher: 10 s).
    assert int(service["TimeoutStopSec"]) > DEFAULTS.drain_timeout_s + 10
    assert int(service["TimeoutStartSec"]) >= 300
    assert "PYTHONUNBUFFERED=1" in UNIT.read_text()
    # These would break the GPU (/dev/nvidia*) or run-time kernel compilation.
    assert service.get("PrivateDevices", "no") == "no"
    assert service.get("MemoryDenyWriteExecute", "no") == "no"
    assert unit()["Install"]["WantedBy"] == "multi-user.target"


def test_unit_exec_start_is_a_valid_glimpse_serve_command() -> None:
    argv = shlex.split(unit()["Service"]["ExecStart"])
    assert Path(argv[0]).name == "glimpse", argv
    args = serve_args(argv[1:])
    assert args.model and args.host == "127.0.0.1" and args.port == 8000


# ---- README --------------------------------------------------------------------------------------


SWITCH = object()


def serve_flags() -> dict[str, object]:
    """Every long flag of `glimpse serve` with its default."""
    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    serve = sub.choices["serve"]
    flags: dict[str, object] = {}
    for action in serve._actions:
        for option in action.option_strings:
            if option.startswith("--") and option != "--help":
                # A switch (--no-prefix-caching) takes no value: by default it is simply not given.
                flags[option] = SWITCH if action.nargs == 0 else action.default
    assert len(flags) > 20, flags
    return flags


def readme_flag_rows() -> dict[str, str]:
    """`--flag` -> its default cell, from the table under the "Serving flags" heading (up to the next heading)."""
    text = README.read_text()
    start = text.index("## Serving flags")
    end = text.index("\n#", start + 1)
    rows = {}
    for line in text[start:end].splitlines():
        if m := re.match(r"^\| `(--[a-z0-9-]+)[^`]*` \| (.*?) \| .* \|$", line):
            rows[m.group(1)] = m.group(2)
    return rows


def test_readme_documents_every_serve_flag_with_its_default() -> None:
    flags, rows = serve_flags(), readme_flag_rows()
    assert sorted(set(flags) - set(rows)) == [], "flags missing from README's 'Serving flags' table"
    assert sorted(set(rows) - set(flags)) == [], "README documents flags that `glimpse serve` lacks"
    for flag, default in flags.items():
        if default is None:
            continue  # computed at start-up; the cell says how, in words
        if default is SWITCH:
            assert rows[flag].startswith("off"), f"{flag} is a switch: its default cell should read 'off'"
            continue
        literal = '""' if default == "" else str(default)
        assert f"`{literal}`" in rows[flag], f"{flag}: README says {rows[flag]!r}, the default is {default!r}"
