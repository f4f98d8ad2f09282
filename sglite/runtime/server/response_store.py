"""Stored Responses API responses (`previous_response_id`), bounded and least-recently-used."""

from __future__ import annotations

from collections import OrderedDict
from typing import Any

# A response as returned, and its conversation through its output (chat messages without the
# instructions).
Entry = tuple[dict[str, Any], list[dict[str, Any]]]


class ResponseStore:
    """Responses by id; past `capacity` the least recently used is dropped."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.entries: OrderedDict[str, Entry] = OrderedDict()

    def put(self, response: dict[str, Any], conversation: list[dict[str, Any]]) -> None:
        """Store (or replace) a response and its conversation."""
        self.entries[response["id"]] = (response, conversation)
        self.entries.move_to_end(response["id"])
        while len(self.entries) > self.capacity:
            self.entries.popitem(last=False)

    def get(self, response_id: str) -> Entry | None:
        """A stored response and its conversation, or None (never stored, or dropped)."""
        entry = self.entries.get(response_id)
        if entry is not None:
            self.entries.move_to_end(response_id)
        return entry
