"""Logging for the `ifb` CLI: the root logger's one handler, writing text lines or JSON lines.

Library code only calls `logging.getLogger(__name__)`; this module is the one place that
installs a handler (house style: only the CLI configures handlers).
"""

from __future__ import annotations

import json
import logging
import sys
from datetime import UTC, datetime
from typing import TextIO

LOG_LEVELS = ("debug", "info", "warning", "error")
LOG_FORMATS = ("text", "json")
TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


class JsonFormatter(logging.Formatter):
    """One JSON object per record on one line: time (UTC, ISO 8601), level, logger, message, and
    exc_info (the formatted traceback) when the record carries one."""

    def format(self, record: logging.LogRecord) -> str:
        entry = {
            "time": datetime.fromtimestamp(record.created, tz=UTC).isoformat(timespec="milliseconds"),
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
        }
        if record.exc_info and not record.exc_text:
            record.exc_text = self.formatException(record.exc_info)  # cached, as logging.Formatter does
        if record.exc_text:
            entry["exc_info"] = record.exc_text
        if record.stack_info:
            entry["stack_info"] = self.formatStack(record.stack_info)
        # json.dumps escapes newlines, so a multi-line message or traceback stays one line.
        return json.dumps(entry, ensure_ascii=False)


class _StderrHandler(logging.StreamHandler):  # type: ignore[type-arg]
    """Writes to whatever sys.stderr is at emit time: when stderr is swapped (click's CliRunner,
    pytest's capture) a handler bound at setup would keep writing to the old, maybe closed, one."""

    @property  # type: ignore[override]
    def stream(self) -> TextIO:
        return sys.stderr

    @stream.setter
    def stream(self, _value: TextIO) -> None:  # StreamHandler.__init__ assigns it; ignored
        pass


def make_formatter(log_format: str) -> logging.Formatter:
    if log_format == "json":
        return JsonFormatter()
    if log_format == "text":
        return logging.Formatter(TEXT_FORMAT)
    raise ValueError(f"log format must be one of {', '.join(LOG_FORMATS)}, got {log_format!r}")


def configure_logging(level: str, log_format: str = "text") -> None:
    """Set the root logger's level and replace the handler a previous call installed; handlers
    installed by others (pytest's capture, say) are left alone."""
    root = logging.getLogger()
    for handler in [h for h in root.handlers if isinstance(h, _StderrHandler)]:
        root.removeHandler(handler)
    handler = _StderrHandler()
    handler.setFormatter(make_formatter(log_format))
    root.addHandler(handler)
    root.setLevel(level.upper())
