"""The error a request is refused with, carrying the fields of OpenAI's error object."""

from __future__ import annotations

from ipc.control import RequestFailed


class BadRequest(Exception):
    """A request the server refuses, carrying the OpenAI error object's fields."""

    def __init__(
        self,
        message: str,
        *,
        status: int = 400,
        param: str | None = None,
        code: str | None = None,
        type: str = "invalid_request_error",
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.type = type

    def to_failed(self, rid: str) -> RequestFailed:
        return RequestFailed(rid, self.status, self.message, self.type, self.param, self.code)

    def __repr__(self) -> str:
        return f"BadRequest({self.status}, {self.message!r}, param={self.param!r}, code={self.code!r})"
