"""Per-launch naming: every address and shm segment of one server launch carries its id.

Two servers on one host therefore never collide, and a launcher (or a later one) can find and
remove everything a dead launch left behind by prefix alone.
"""

from __future__ import annotations

import os
import re
import shutil
import stat

# Short on purpose: the id appears in every shm name and socket path (unix sockets cap at 107 bytes).
_LAUNCH_ID_BYTES = 4
_LAUNCH_ID_RE = re.compile(r"^[0-9A-Za-z_]{1,32}$")
_NAME_RE = re.compile(r"^[0-9A-Za-z_.-]{1,64}$")
# Not tempfile.gettempdir(): a long $TMPDIR (macOS, CI runners) would push socket paths past the limit.
_IPC_ROOT = "/tmp"
# sun_path is 108 bytes including the trailing NUL.
_MAX_UNIX_PATH = 107


def new_launch_id() -> str:
    """Return a fresh id (8 hex chars) identifying one server launch."""
    return os.urandom(_LAUNCH_ID_BYTES).hex()


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
