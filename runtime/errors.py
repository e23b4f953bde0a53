"""The runtime's error tree: every user-facing failure is an IfbError naming the field or limit."""

from __future__ import annotations


class IfbError(Exception):
    """Base of every error the runtime raises on purpose."""


class EngineFormatError(IfbError):
    """The engine folder is missing files, corrupted, or of another format version."""


class LimitExceededError(IfbError):
    """A runtime setting asks for more than the engine was built with."""


class AdmissionError(IfbError):
    """A request is invalid; `field` names the offending parameter."""

    def __init__(self, message: str, field: str | None = None) -> None:
        super().__init__(message)
        self.field = field


class QueueFullError(IfbError):
    """Running seats and the waiting queue are both full."""


class EngineUnavailableError(IfbError):
    """The step loop is dead or stuck: nothing new is accepted (HTTP 503)."""
