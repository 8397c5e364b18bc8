"""The server's configuration lives in workers/config.py (config flows down: workers never import server/);
re-exported here for the launcher and the HTTP side."""

from __future__ import annotations

from workers.config import ServerConfig

__all__ = ["ServerConfig"]
