"""The tagged union each receiving socket decodes, one per process role (ipc/endpoints.py binds them).

Every member derives from the tagged ``Msg`` (ipc/control.py), so a PULL socket typed with one of these unions
decodes whichever member arrives and rejects anything else at the boundary.
"""

from __future__ import annotations

from ipc.control import AbortRequest, ProcessReady, RequestFailed, Shutdown
from ipc.encode import EncodeDone, EncodeFailed, EncodeRelease, EncodeRequest
from ipc.outputs import OutputBatch
from ipc.prompts import MediaFailed, MediaReady, TokenizedRequest
from ipc.requests import GenerateRequest, RequestAccepted, RequestRendered, RouteRequest
from ipc.stats import EncoderStats, SchedulerStats, TokenizerStats, WorkerStats
from ipc.steps import StepPlan, StepResult, WorkerFailed

FrontendInbound = (
    RequestAccepted | RequestFailed | OutputBatch | SchedulerStats | TokenizerStats | ProcessReady | RouteRequest
    | RequestRendered
)
TokenizerInbound = GenerateRequest | AbortRequest | SchedulerStats | Shutdown
SchedulerInbound = (
    TokenizedRequest | MediaReady | MediaFailed | AbortRequest | StepResult | WorkerFailed | WorkerStats
    | ProcessReady | Shutdown | EncodeDone | EncodeFailed | EncoderStats
)
ModelInbound = StepPlan | Shutdown
EncoderInbound = EncodeRequest | EncodeRelease | Shutdown
