"""Per-launch naming: every address and shm segment of one server launch carries its id.

Two servers on one host therefore never collide, and a launcher (or a later one) can find and
remove everything a dead launch left behind by prefix alone.

An id made here also names its owner: ``p{pid}n{pid namespace}_{random}``. A later start can then
tell a launch whose owner is gone (its leftovers are garbage) from a live one without asking
anyone. The pid namespace is part of it because /dev/shm may be shared between containers
(``--ipc host``) whose pids mean nothing to each other: a launch of another namespace is never
judged, only left alone.
"""

from __future__ import annotations

import os
import re
import shutil
import stat

# Short on purpose: the id appears in every shm name and socket path (unix sockets cap at 107 bytes).
_LAUNCH_ID_BYTES = 4
_LAUNCH_ID_RE = re.compile(r"^[0-9A-Za-z_]{1,32}$")
_OWNED_ID_RE = re.compile(r"^p(?P<pid>[0-9]{1,10})n(?P<ns>[0-9a-f]{1,12})_[0-9a-f]{8}$")
_NAME_RE = re.compile(r"^[0-9A-Za-z_.-]{1,64}$")
# Not tempfile.gettempdir(): a long $TMPDIR (macOS, CI runners) would push socket paths past the limit.
_IPC_ROOT = "/tmp"
# sun_path is 108 bytes including the trailing NUL.
_MAX_UNIX_PATH = 107


def _pid_namespace() -> int:
    try:
        return os.stat("/proc/self/ns/pid").st_ino
    except OSError:  # no procfs: 0 never matches a real namespace, so nothing is judged dead
        return 0


def new_launch_id(owner_pid: int | None = None) -> str:
    """A fresh id for one server launch, naming its owner (default: this process)."""
    pid = os.getpid() if owner_pid is None else owner_pid
    return f"p{pid}n{_pid_namespace():x}_{os.urandom(_LAUNCH_ID_BYTES).hex()}"


def launch_owner_gone(launch_id: str) -> bool:
    """True only when `launch_id` names an owner of this pid namespace that no longer exists.

    Any doubt answers False (a hand-made id, another namespace, a pid now reused by another
    process): leaving garbage is recoverable, sweeping a live server's pixels is not."""
    m = _OWNED_ID_RE.match(launch_id)
    if m is None or int(m.group("ns"), 16) != _pid_namespace() or _pid_namespace() == 0:
        return False
    try:
        os.kill(int(m.group("pid")), 0)
    except ProcessLookupError:
        return True
    except (PermissionError, OverflowError):  # alive under another user / not a pid at all
        return False
    return False


def dead_launch_dirs() -> list[str]:
    """Ids of launch socket directories in /tmp whose owner is gone (see `launch_owner_gone`)."""
    try:
        entries = os.listdir(_IPC_ROOT)
    except OSError:
        return []
    ids = [e.removeprefix("glimpse-") for e in entries if e.startswith("glimpse-")]
    return [i for i in ids if _LAUNCH_ID_RE.match(i) and launch_owner_gone(i)]


def _check_launch_id(launch_id: str) -> None:
    # The id becomes part of file names and a sweep prefix: reject anything that could escape a
    # directory or widen the prefix (an empty id would sweep every launch).
    if not _LAUNCH_ID_RE.match(launch_id):
        raise ValueError(f"invalid launch id {launch_id!r}")


def shm_prefix(launch_id: str) -> str:
    """Prefix of every /dev/shm segment name that belongs to `launch_id`."""
    _check_launch_id(launch_id)
    return f"glimpse-{launch_id}-"


def launch_dir(launch_id: str) -> str:
    """Directory holding the launch's unix sockets (not created here)."""
    _check_launch_id(launch_id)
    return os.path.join(_IPC_ROOT, f"glimpse-{launch_id}")


def _ensure_private_dir(path: str) -> None:
    os.makedirs(path, mode=0o700, exist_ok=True)
    # /tmp is world-writable: if someone else pre-created the directory they could own our sockets.
    st = os.lstat(path)
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid():
        raise PermissionError(f"{path} is not a directory owned by this user")


def ipc_address(launch_id: str, name: str) -> str:
    """Return `ipc:///tmp/glimpse-<id>/<name>.sock`, creating the launch dir on demand."""
    if not _NAME_RE.match(name):
        raise ValueError(f"invalid channel name {name!r}")
    directory = launch_dir(launch_id)
    path = os.path.join(directory, f"{name}.sock")
    if len(path.encode()) > _MAX_UNIX_PATH:
        raise ValueError(f"socket path {path!r} exceeds the {_MAX_UNIX_PATH}-byte unix socket limit")
    _ensure_private_dir(directory)
    return f"ipc://{path}"


def cleanup_launch_dir(launch_id: str) -> None:
    """Remove the launch's socket directory; a missing directory is fine (idempotent)."""
    shutil.rmtree(launch_dir(launch_id), ignore_errors=True)
