"""The launcher's child processes: starting one per role (model worker, encoder worker, scheduler, tokenizer) in a fresh
interpreter with the tuned allocator, tying it to the launcher's life, saying how one ended, and stopping them
all; also systemd readiness and the open-files limit the children inherit. The supervision (what a death means
for the server) stays in launcher.py."""

from __future__ import annotations

import contextlib
import logging
import multiprocessing
import multiprocessing.process
import os
import signal
import socket
import time
from dataclasses import dataclass

from server.config import ServerConfig
from workers.common.memory import tune_malloc

log = logging.getLogger("glimpse.launcher")


@dataclass
class Child:
    role: str
    index: int
    process: multiprocessing.process.BaseProcess

    @property
    def name(self) -> str:
        return f"{self.role}[{self.index}]"


def sd_notify(message: str) -> bool:
    """Tell systemd (Type=notify) about our state; a no-op unless NOTIFY_SOCKET is set."""
    address = os.environ.get("NOTIFY_SOCKET")
    if not address:
        return False
    if address.startswith("@"):  # abstract namespace socket
        address = "\0" + address[1:]
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
            sock.connect(address)
            sock.sendall(message.encode())
    except OSError as exc:
        log.warning("sd_notify(%s) failed: %s", message, exc)
        return False
    return True


def describe_exit(code: int | None) -> str:
    """How a child ended, for the log: the signal by name, since an OOM kill is a SIGKILL."""
    if code is None:
        return "exited (status unknown)"
    if code >= 0:
        return f"exited with code {code}"
    try:
        name = signal.Signals(-code).name
    except ValueError:
        name = f"signal {-code}"
    return f"was killed by {name}" + (" (likely the kernel's OOM killer)" if name == "SIGKILL" else "")


def _child_entry(role: str, config: ServerConfig, index: int) -> None:
    """First code a child runs: die with the launcher, then hand over to the role's entry point."""
    # Before the role starts any thread: arenas already made would stay (workers/common/memory.py says why). A
    # tokenizer keeps glibc's moving mmap threshold: its big buffers (bodies, decoded images) recur per request,
    # and its IdleTrim hands them back once idle.
    tune_malloc(fixed_thresholds=role != "tokenizer")
    if role != "scheduler":
        # The scheduler is the one child that outlives a killed launcher for a moment: it notices
        # (its loop polls the parent) and removes the launch's segments and sockets before it exits.
        _die_with_parent()
    # Until the role's own set-up runs: Ctrl-C and group SIGTERMs are the launcher's to act on.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    if role == "model":
        from workers.model.process import run_model_worker

        run_model_worker(config, index)
    elif role == "scheduler":
        from workers.scheduler.process import run_scheduler

        run_scheduler(config, index)
    elif role == "encoder":
        from workers.encoder.process import run_encoder_worker

        run_encoder_worker(config, index)
    elif role == "tokenizer":
        from workers.tokenizer.process import run_tokenizer

        run_tokenizer(config, index)
    else:
        raise ValueError(f"unknown role {role!r}")


def _die_with_parent() -> None:
    """Ask Linux to kill this process when the launcher dies, so no child outlives a killed server
    (children ignore SIGTERM: the launcher drives every orderly stop)."""
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        pr_set_pdeathsig = 1
        libc.prctl(pr_set_pdeathsig, signal.SIGKILL)
    except (OSError, AttributeError):
        pass


def start_child(config: ServerConfig, role: str, index: int) -> Child:
    """Spawn one child. Call it on the main thread: PR_SET_PDEATHSIG fires when the *thread* that
    started the child exits, so a child started from a short-lived thread would die with it."""
    ctx = multiprocessing.get_context("spawn")
    proc = ctx.Process(target=_child_entry, args=(role, config, index), name=f"glimpse-{role}-{index}")
    # Spawned children inherit the environment: the role in it lets operators (and tests) tell
    # the processes apart with ps/pgrep without asking the server.
    os.environ["GLIMPSE_ROLE"] = f"{role}[{index}]"
    try:
        proc.start()
    finally:
        os.environ.pop("GLIMPSE_ROLE", None)
    log.info("started %s[%d] pid %s", role, index, proc.pid)
    return Child(role, index, proc)


def start_children(config: ServerConfig) -> list[Child]:
    # --dp N: replica r is scheduler r and model workers r * tp .. r * tp + tp - 1 (each on its GPU), and with
    # --encoder-workers E encoder workers r * E .. r * E + E - 1 (with --shared-encoders E in all, 0 .. E - 1, each
    # answering every replica).
    dp = max(1, config.dp_size)
    plan = [("model", i) for i in range(config.engine.tp_size * dp)]
    plan += [("encoder", i) for i in range(config.encoder_count)]
    plan += [("scheduler", r) for r in range(dp)]
    plan += [("tokenizer", i) for i in range(config.tokenizer_workers)]
    return [start_child(config, role, index) for role, index in plan]


def stop_children(children: list[Child], timeout: float) -> None:
    """Wait for children to exit after Shutdown; SIGKILL the ones that don't (children ignore
    SIGTERM: it is the launcher's signal to act on, so a terminate would only waste the wait)."""
    deadline = time.monotonic() + timeout
    for child in children:
        child.process.join(max(0.0, deadline - time.monotonic()))
    alive = [c for c in children if c.process.is_alive()]
    for child in alive:
        log.warning("%s did not exit within %.0f s; killing it", child.name, timeout)
        child.process.kill()
    for child in alive:
        child.process.join(3.0)


def raise_fd_limit() -> int:
    """Raise the soft limit on open files to the hard one (every HTTP connection holds one);
    returns the soft limit now in force. Children inherit it."""
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = hard if hard != resource.RLIM_INFINITY else max(soft, 1 << 20)
    if soft != resource.RLIM_INFINITY and soft < want:
        with contextlib.suppress(ValueError, OSError):
            resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))
    return resource.getrlimit(resource.RLIMIT_NOFILE)[0]


