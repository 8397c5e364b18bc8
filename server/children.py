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
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing.connection import Connection

from server.config import ServerConfig
from workers.common.memory import tune_malloc
from workers.common.proc import collector_paused, watch_startup_gc

log = logging.getLogger("glimpse.launcher")
# A fresh interpreter per child: nothing of the launcher's state (threads, CUDA, sockets) crosses over.
_CONTEXT = multiprocessing.get_context("spawn")


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


def _prepare(role: str) -> None:
    """First code a child runs: the allocator's settings, dying with the launcher, the launcher's signals ignored,
    and (a model worker) a watch on the collector until its start-up ends, which it logs."""
    if role == "model":
        watch_startup_gc()
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


def _role_entry(role: str) -> Callable[[ServerConfig, int], None]:
    """The role's entry point. Importing it is most of a child's start before its own work: torch, transformers and
    the engine take a model worker ~10 s on an H200 host's CPU (the collector paused meanwhile: proc.py)."""
    with collector_paused():
        return _import_role(role)


def _import_role(role: str) -> Callable[[ServerConfig, int], None]:
    if role == "model":
        from workers.model.process import run_model_worker

        return run_model_worker
    if role == "scheduler":
        from workers.scheduler.process import run_scheduler

        return run_scheduler
    if role == "encoder":
        from workers.encoder.process import run_encoder_worker

        return run_encoder_worker
    if role == "tokenizer":
        from workers.tokenizer.process import run_tokenizer

        return run_tokenizer
    raise ValueError(f"unknown role {role!r}")


def _child_entry(role: str, config: ServerConfig, index: int) -> None:
    _prepare(role)
    _role_entry(role)(config, index)


def _early_entry(role: str, index: int, inbox: Connection) -> None:
    """A child started before its config exists: it imports its role while the launcher builds the config, then
    takes the config from ``inbox``. The launcher closing ``inbox`` unsent (a refused flag) ends it quietly."""
    _prepare(role)
    entry = _role_entry(role)
    try:
        config = inbox.recv()
    except EOFError:
        return
    finally:
        inbox.close()
    entry(config, index)


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


def _spawn(role: str, index: int, target: Callable[..., None], args: tuple[object, ...], early: bool = False) -> Child:
    """Spawn one child. Call it on the main thread: PR_SET_PDEATHSIG fires when the *thread* that
    started the child exits, so a child started from a short-lived thread would die with it."""
    proc = _CONTEXT.Process(target=target, args=args, name=f"glimpse-{role}-{index}")
    # A start that a flag then refuses says one line, so an early child's start is a debug line until it has work.
    level = logging.DEBUG if early else logging.INFO
    # Spawned children inherit the environment: the role in it lets operators (and tests) tell
    # the processes apart with ps/pgrep without asking the server.
    os.environ["GLIMPSE_ROLE"] = f"{role}[{index}]"
    try:
        proc.start()
    finally:
        os.environ.pop("GLIMPSE_ROLE", None)
    log.log(level, "started %s[%d] pid %s%s", role, index, proc.pid, " (waiting for its config)" if early else "")
    return Child(role, index, proc)


def start_child(config: ServerConfig, role: str, index: int) -> Child:
    return _spawn(role, index, _child_entry, (role, config, index))


class EarlyChildren:
    """Children started before the launcher has its config, each waiting for it on a pipe. A model worker's imports
    (~10 s on an H200 host) then overlap the launcher's own (torch, the checkpoint's spec and checks: ~4.6 s of a
    ~41 s start of the Qwen3-VL-8B shape) instead of following them."""

    def __init__(self, plan: list[tuple[str, int]]) -> None:
        self._waiting: dict[tuple[str, int], tuple[Child, Connection]] = {}
        try:
            for role, index in plan:
                inbox, outbox = _CONTEXT.Pipe(duplex=False)
                child = _spawn(role, index, _early_entry, (role, index, inbox), early=True)
                inbox.close()  # the child's end: the launcher keeps only its own
                self._waiting[role, index] = (child, outbox)
        except BaseException:  # a spawn failed: those started must not wait on a pipe no one will write
            self.close()
            raise

    @property
    def waiting(self) -> list[Child]:
        """The children still waiting for a config."""
        return [child for child, _ in self._waiting.values()]

    def take(self, config: ServerConfig, role: str, index: int) -> Child | None:
        """The waiting child of ``role`` ``index``, given ``config``; None if none was started early."""
        found = self._waiting.pop((role, index), None)
        if found is None:
            return None
        child, outbox = found
        with contextlib.suppress(OSError):  # it died while importing: the launcher's watch reports how
            outbox.send(config)
        outbox.close()
        log.info("started %s (pid %s) before the config; handed it now", child.name, child.process.pid)
        return child

    def close(self) -> None:
        """Kill the children never given a config (start-up stopped before them, e.g. a refused flag): they were
        only importing, and a refused start should not wait for that."""
        waiting = list(self._waiting.values())
        self._waiting.clear()
        for child, outbox in waiting:
            outbox.close()
            child.process.kill()
        for child, _ in waiting:
            child.process.join(3.0)


def start_children(config: ServerConfig, early: EarlyChildren | None = None) -> list[Child]:
    # --dp N: replica r is scheduler r and model workers r * tp .. r * tp + tp - 1 (each on its GPU), and with
    # --encoder-workers E encoder workers r * E .. r * E + E - 1 (with --shared-encoders E in all, 0 .. E - 1, each
    # answering every replica).
    dp = max(1, config.dp_size)
    plan = worker_plan(config.engine.tp_size * dp, config.encoder_count)
    plan += [("scheduler", r) for r in range(dp)]
    plan += [("tokenizer", i) for i in range(config.tokenizer_workers)]
    children = []
    for role, index in plan:
        child = early.take(config, role, index) if early is not None else None
        children.append(child if child is not None else start_child(config, role, index))
    return children


def worker_plan(model_workers: int, encoders: int) -> list[tuple[str, int]]:
    """The GPU workers of a launch, in start order: (role, index) of each model worker, then each encoder worker."""
    return [("model", i) for i in range(model_workers)] + [("encoder", i) for i in range(encoders)]


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


