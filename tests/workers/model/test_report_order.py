"""The model worker reports a finished step while it launches the next one (runner.launch_poll), not after that
launch returns: the loop of workers/model/process.py with a runner whose launch finds the step before it done on
the GPU halfway through, as a long launch of a mixed step does."""

from __future__ import annotations

import logging
from types import SimpleNamespace
from typing import Any

import torch
from torch import nn

from ipc.control import Shutdown
from ipc.steps import StepResult
from workers.engine.runner.launch_poll import LaunchPoll, poll_points
from workers.model.process import _serve


class _Step:
    def __init__(self, step_id: int) -> None:
        self.step_id, self.finished = step_id, False

    def done(self) -> bool:
        return self.finished

    def result(self) -> StepResult:
        assert self.finished, "a result read before its step was done"
        return StepResult(self.step_id, [])


class _Runner:
    """launch(plan): the previous step's GPU work ends halfway through this launch (between two layers)."""

    def __init__(self, events: list[tuple[str, int]]) -> None:
        self.events, self.steps = events, []  # type: ignore[var-annotated]
        self.launch_poll = LaunchPoll([])
        self.device, self.vision = torch.device("cpu"), None
        self.counters = SimpleNamespace(images_encoded=0, vit_calls=0)
        self.weight_bytes = self.vision_weight_bytes = 0
        self.ahead = SimpleNamespace(images=0, waits=0)
        self.landings = SimpleNamespace(nixl=SimpleNamespace(reads=0, bytes_read=0))

    def launch(self, plan: Any) -> _Step:
        self.events.append(("launch begins", plan.step_id))
        self.launch_poll()  # the first layers: the step before is still running
        if self.steps:
            self.steps[-1].finished = True
        self.launch_poll()  # a later layer
        self.events.append(("launch ends", plan.step_id))
        self.steps.append(_Step(plan.step_id))
        return self.steps[-1]


class _Inbound:
    def __init__(self, msgs: list[Any]) -> None:
        self.msgs = msgs

    def recv(self, timeout_ms: int | None = None) -> Any:
        return self.msgs.pop(0) if self.msgs else None


class _ToScheduler:
    def __init__(self, events: list[tuple[str, int]]) -> None:
        self.events = events

    def send(self, msg: Any) -> None:
        if isinstance(msg, StepResult):
            self.events.append(("result", msg.step_id))


def test_a_step_is_reported_inside_the_next_launch_once_done() -> None:
    events: list[tuple[str, int]] = []
    reader = SimpleNamespace(broadcast=lambda _: None, reads=0, bytes_read=0, steps=0, broadcast_s_sum=0.0,
                             broadcast_s_max=0.0)
    gc_watch = SimpleNamespace(collections=0, pause_s_max=0.0, frozen=0, full=0, pause_s_sum=0.0, idle_full=0)
    plans = [SimpleNamespace(step_id=i, sent_at=0.0) for i in (1, 2)]
    _serve(_Runner(events), reader, 0, _Inbound([*plans, Shutdown()]), _ToScheduler(events),  # type: ignore[arg-type]
           logging.getLogger("test"), gc_watch)  # type: ignore[arg-type]
    assert events == [("launch begins", 1), ("launch ends", 1), ("launch begins", 2), ("result", 1), ("launch ends", 2)]


def test_layers_call_it_only_while_a_launch_sets_it() -> None:
    tower = nn.Module()
    tower.layers = nn.ModuleList(nn.Linear(2, 2) for _ in range(3))
    vision = nn.Module()
    vision.blocks = nn.ModuleList([nn.Identity()])
    poll = LaunchPoll(poll_points(tower, vision, None))
    calls: list[int] = []
    x = torch.zeros(1, 2)
    for layer in tower.layers:
        x = layer(x)
    with poll.calling(lambda: calls.append(1)):
        for layer in tower.layers:
            x = layer(x)
        vision.blocks[0](x)
    for layer in tower.layers:
        x = layer(x)
    assert len(calls) == 4 and poll.callback is None
