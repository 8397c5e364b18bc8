"""Every socket endpoint of a launch in one table: its name, the tagged union its PULL end decodes, which
process binds it and who sends to it. Processes open their sockets through ``pull`` / ``push`` (and the
asyncio twins), so an endpoint's address and message type are written once.

| endpoint | decodes | bound by | senders |
|---|---|---|---|
| ``frontend`` | FrontendInbound | the launcher's HTTP frontend | tokenizers, scheduler |
| ``tok{i}`` | TokenizerInbound | tokenizer worker i | frontend, scheduler |
| ``sched`` | SchedulerInbound | the scheduler | frontend, tokenizers, model workers |
| ``model{i}`` | ModelInbound | model worker rank i | scheduler |
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Generic, TypeVar

import zmq
import zmq.asyncio

from ipc.channels import AsyncPullSocket, AsyncPushSocket, PullSocket, PushSocket
from ipc.launch import ipc_address
from ipc.messages import FrontendInbound, ModelInbound, SchedulerInbound, TokenizerInbound

T = TypeVar("T")


@dataclass(frozen=True)
class Endpoint(Generic[T]):
    name: str  # "{i}" is the worker index or TP rank
    inbound: Any  # the tagged union (or Struct) the bound PULL socket decodes: T at run time
    bound_by: str
    senders: tuple[str, ...]

    def address(self, launch_id: str, index: int = 0) -> str:
        return ipc_address(launch_id, self.name.format(i=index))


FRONTEND: Endpoint[FrontendInbound] = Endpoint("frontend", FrontendInbound, "frontend", ("tokenizer", "scheduler"))
TOKENIZER: Endpoint[TokenizerInbound] = Endpoint("tok{i}", TokenizerInbound, "tokenizer", ("frontend", "scheduler"))
SCHEDULER: Endpoint[SchedulerInbound] = Endpoint(
    "sched", SchedulerInbound, "scheduler", ("frontend", "tokenizer", "model")
)
MODEL: Endpoint[ModelInbound] = Endpoint("model{i}", ModelInbound, "model", ("scheduler",))
ENDPOINTS: tuple[Endpoint[Any], ...] = (FRONTEND, TOKENIZER, SCHEDULER, MODEL)


def pull(ctx: zmq.Context[Any], launch_id: str, endpoint: Endpoint[T], index: int = 0) -> PullSocket[T]:
    """The endpoint's receiving end: bound by its owner."""
    return PullSocket[T](ctx, endpoint.address(launch_id, index), endpoint.inbound, bind=True)


def push(ctx: zmq.Context[Any], launch_id: str, endpoint: Endpoint[T], index: int = 0) -> PushSocket[T]:
    """A sender's end: connects to the endpoint."""
    return PushSocket[T](ctx, endpoint.address(launch_id, index), endpoint.inbound, bind=False)


def apull(ctx: zmq.asyncio.Context, launch_id: str, endpoint: Endpoint[T], index: int = 0) -> AsyncPullSocket[T]:
    return AsyncPullSocket[T](ctx, endpoint.address(launch_id, index), endpoint.inbound, True)


def apush(ctx: zmq.asyncio.Context, launch_id: str, endpoint: Endpoint[T], index: int = 0) -> AsyncPushSocket[T]:
    return AsyncPushSocket[T](ctx, endpoint.address(launch_id, index), endpoint.inbound, False)
