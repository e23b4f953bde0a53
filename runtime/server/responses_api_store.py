"""Stored responses for `GET /v1/responses/{id}` and `previous_response_id`: in memory, in this
process, bounded to the most recently stored or used MAX_STORED_RESPONSES (least recently used
dropped first). A restart, or another replica, does not have them."""

from __future__ import annotations

import logging
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

logger = logging.getLogger(__name__)

MAX_STORED_RESPONSES = 256


@dataclass(frozen=True, slots=True)
class StoredResponse:
    """A finished response's body, and its conversation as Responses items: the items it was
    given (after those of its own previous response) and the items it output."""

    body: dict[str, Any]
    conversation: list[dict[str, Any]]


@dataclass(slots=True)
class ResponseStore:
    max_responses: int = MAX_STORED_RESPONSES
    entries: OrderedDict[str, StoredResponse] = field(default_factory=OrderedDict)

    def put(self, response_id: str, stored: StoredResponse) -> None:
        self.entries[response_id] = stored
        self.entries.move_to_end(response_id)
        while len(self.entries) > self.max_responses:
            dropped, _ = self.entries.popitem(last=False)
            logger.debug("response store full: dropped %s", dropped)

    def get(self, response_id: str) -> StoredResponse | None:
        stored = self.entries.get(response_id)
        if stored is not None:
            self.entries.move_to_end(response_id)
        return stored

    def delete(self, response_id: str) -> bool:
        return self.entries.pop(response_id, None) is not None
