"""The tagged base every socket message derives from, and the control messages that several hops share.

``Msg`` is tagged by class name, so a receiving socket decodes a union of messages (ipc/inbound.py) no matter
which module defines each one. Beside it live the messages that belong to no single hop: a child's ready ack and
the launcher's shutdown, a request's abort (frontend -> tokenizer and scheduler) and its failure (any child ->
frontend).
"""

from __future__ import annotations

import msgspec


class Msg(msgspec.Struct, frozen=True, tag=True, tag_field="kind"):
    """Base of every message that travels alone on a socket: tagged, so a channel decodes a union."""


class AbortRequest(Msg, frozen=True):
    """Frontend -> scheduler: the client went away or the server is failing the request. Also
    frontend -> the request's tokenizer while that one has not answered yet: it stops fetching
    and preparing the request, and answers RequestFailed so the frontend frees its slot."""

    rid: str


class Shutdown(Msg, frozen=True):
    """Launcher -> any child: exit cleanly."""

    reason: str = ""


class RequestFailed(Msg, frozen=True):
    """Any child -> frontend: the request failed; answer with this OpenAI-shaped error."""

    rid: str
    status: int
    message: str
    type: str = "invalid_request_error"
    param: str | None = None
    code: str | None = None


class ProcessReady(Msg, frozen=True):
    """Child -> launcher: started and ready to serve."""

    role: str
    index: int
    pid: int
    num_kv_blocks: int = 0
    num_state_slots: int = 0  # hybrid models: slots of the linear-attention state pool
    num_window_blocks: int = 0  # sliding-window models (Gemma 4): blocks of the sliding layers' own KV pool
    num_kv_host_slots: int = 0  # --kv-host-cache-mb: KV blocks the rank's host tier holds (0: off)
