"""LiveRequest: everything the executor holds for one request between its submission and its
final delta — the torch-free Request the scheduler moves, its sampling state (generator,
grammar matcher), its detokenizer and the caller's sink. The executor creates it when the
request arrives and drops it in one place when the request finishes (executor.py `_deliver`)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from ifb.runtime.detokenizer import IncrementalDetokenizer
from ifb.runtime.outputs import RequestOutput
from ifb.runtime.request import Request
from ifb.runtime.sampling_state import SamplingState

Sink = Callable[[RequestOutput], None]


@dataclass(frozen=True, slots=True)
class LiveRequest:
    request: Request
    sampling: SamplingState
    detokenizer: IncrementalDetokenizer
    sink: Sink

    @property
    def request_id(self) -> str:
        return self.request.request_id
