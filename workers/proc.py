"""Set-up shared by every child process: logging with the role in each line, and signal policy."""

from __future__ import annotations

import logging
import signal
import sys


def setup_child(tag: str, level: str) -> logging.Logger:
    """Configure a child process of the launcher; returns the role's logger.

    Signals: the terminal's Ctrl-C and a process-group SIGTERM (``timeout``, ``kill -- -PGID``,
    systemd without KillMode=mixed) reach every process at once. Only the launcher acts on them: it
    drains the HTTP requests and then sends each child Shutdown, so children ignore both; a child
    that does not exit after Shutdown is killed by the launcher.
    """
    handler = logging.StreamHandler(sys.stderr)
    # Every line carries the role and rank, whichever logger (ours, the engine's, a library's) wrote it.
    handler.setFormatter(logging.Formatter(f"%(asctime)s %(levelname)s [{tag}] %(name)s: %(message)s"))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one INFO line per download is noise
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    return logging.getLogger(tag)
