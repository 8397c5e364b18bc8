"""Every socket endpoint of a launch in one table: its name, the tagged union its PULL end decodes, which
process binds it and who sends to it. Processes open their sockets through ``pull`` / ``push`` (and the
asyncio twins), so an endpoint's address and message type are written once.

| endpoint | decodes | bound by | senders |
|---|---|---|---|
| ``frontend`` | FrontendInbound | the launcher's HTTP frontend | tokenizers, schedulers |
| ``tok{i}`` | TokenizerInbound | tokenizer worker i | frontend, schedulers |
| ``sched`` / ``sched{i}`` | SchedulerInbound | the scheduler of replica i (``sched`` for replica 0) | frontend, tokenizers (``--dp 1``), its model workers and encoder workers (shared ones: every replica's) |
| ``model{i}`` | ModelInbound | model worker i = replica * tp + rank | its replica's scheduler |
| ``enc{i}`` | EncoderInbound | encoder worker i = replica * encoder_workers + j (``--encoder-workers``), or j with ``--shared-encoders`` | its replica's scheduler; every replica's when shared |
| ``kvev`` | encoded KV-event batches (ipc/kv_events.py) | the launcher's KV-event publisher (ipc/kv_event_publisher.py) | schedulers |
| ``--kv-events-endpoint`` | (vLLM's KV-event batches) | the launcher's KV-event publisher, every replica on one PUB | - (external subscribers) |

With ``--dp 1`` tokenizers hand a prepared request straight to ``sched``; with more replicas they hand it
to the frontend (``RouteRequest``), whose router forwards it to the chosen ``sched{i}``. Replica 0 keeps
the unnumbered name so single-replica tools and tests address the scheduler as before.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Generic, TypeVar

import zmq
import zmq.asyncio

from ipc.channels import AsyncPullSocket, AsyncPushSocket, PullSocket, PushSocket
from ipc.inbound import EncoderInbound, FrontendInbound, ModelInbound, SchedulerInbound, TokenizerInbound
from ipc.launch import ipc_address

T = TypeVar("T")


@dataclass(frozen=True)
class Endpoint(Generic[T]):
    name: str  # "{i}" is the worker index or TP rank
    inbound: Any  # the tagged union (or Struct) the bound PULL socket decodes: T at run time
    bound_by: str
    senders: tuple[str, ...]
    first: str = ""  # the name of index 0 when it differs from the pattern's

    def address(self, launch_id: str, index: int = 0) -> str:
        return ipc_address(launch_id, self.first if index == 0 and self.first else self.name.format(i=index))


FRONTEND: Endpoint[FrontendInbound] = Endpoint("frontend", FrontendInbound, "frontend", ("tokenizer", "scheduler"))
TOKENIZER: Endpoint[TokenizerInbound] = Endpoint("tok{i}", TokenizerInbound, "tokenizer", ("frontend", "scheduler"))
SCHEDULER: Endpoint[SchedulerInbound] = Endpoint(
    "sched{i}", SchedulerInbound, "scheduler", ("frontend", "tokenizer", "model", "encoder"), first="sched"
)
MODEL: Endpoint[ModelInbound] = Endpoint("model{i}", ModelInbound, "model", ("scheduler",))
ENCODER: Endpoint[EncoderInbound] = Endpoint("enc{i}", EncoderInbound, "encoder", ("scheduler",))
# Raw frames (already-encoded vLLM batches), not a glimpse message: opened as plain zmq sockets.
KV_EVENTS: Endpoint[bytes] = Endpoint("kvev", bytes, "launcher", ("scheduler",))
ENDPOINTS: tuple[Endpoint[Any], ...] = (FRONTEND, TOKENIZER, SCHEDULER, MODEL, ENCODER, KV_EVENTS)


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
