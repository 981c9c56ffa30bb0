"""Stored responses for /v1/responses (`store`, `previous_response_id`, GET / DELETE by id).

A response made with `store` true (the default, as OpenAI) is kept with its conversation: the input
items of every turn before it and its own, then its output items (instructions are not kept: as at
OpenAI, each request's own `instructions` apply). `previous_response_id` continues from that
conversation, so the prompt starts with everything the earlier turn's prompt and output were, and the
prefix cache reuses it. The store is in memory, bounded by count and bytes (the JSON size of what an
entry keeps; the conversations an entry shares with the one it continues are counted again, so the bound
is conservative), least recently used first out; `--responses-store-size 0` keeps nothing. With API keys,
each key sees only its own responses (the owner is a digest of the key); another key's id is "not found".
"""

from __future__ import annotations

import hashlib
import json
import logging
import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

from fastapi import Request

logger = logging.getLogger("swaserve.server")

DEFAULT_STORE_SIZE = 1024  # responses (--responses-store-size)
DEFAULT_STORE_BYTES = 256 << 20  # (--responses-store-bytes)


@dataclass(frozen=True)
class StoredResponse:
    response: dict[str, Any]  # the response object as answered
    items: list[dict[str, Any]]  # the conversation as input items, this response's output last
    items_bytes: int
    nbytes: int


def _size(obj: Any) -> int:
    return len(json.dumps(obj, ensure_ascii=False, separators=(",", ":")).encode("utf-8"))


class ResponseStore:
    """An LRU of stored responses keyed by (owner, id), bounded by count and bytes (thread-safe)."""

    def __init__(self, max_count: int = DEFAULT_STORE_SIZE, max_bytes: int = DEFAULT_STORE_BYTES):
        self.max_count, self.max_bytes = max_count, max_bytes
        self._lock = threading.Lock()
        self._entries: OrderedDict[tuple[str, str], StoredResponse] = OrderedDict()
        self.nbytes = 0

    @property
    def enabled(self) -> bool:
        return self.max_count > 0 and self.max_bytes > 0

    def __len__(self) -> int:
        return len(self._entries)

    def put(self, owner: str, response: dict[str, Any], history: StoredResponse | None,
            new_items: list[dict[str, Any]]) -> bool:
        """Keep `response` (its id), its conversation = `history`'s items + `new_items` (this turn's input
        and output). False when the store is off or the entry alone is over the byte bound."""
        if not self.enabled:
            return False
        items_bytes = (history.items_bytes if history else 0) + _size(new_items)
        entry = StoredResponse(response, [*(history.items if history else ()), *new_items], items_bytes,
                               items_bytes + _size(response))
        if entry.nbytes > self.max_bytes:
            logger.warning("%s: not stored: %d bytes, over --responses-store-bytes %d", response["id"],
                           entry.nbytes, self.max_bytes)
            return False
        key = (owner, response["id"])
        with self._lock:
            old = self._entries.pop(key, None)
            if old is not None:
                self.nbytes -= old.nbytes
            self._entries[key] = entry
            self.nbytes += entry.nbytes
            while len(self._entries) > self.max_count or self.nbytes > self.max_bytes:
                _, dropped = self._entries.popitem(last=False)
                self.nbytes -= dropped.nbytes
        return True

    def get(self, owner: str, response_id: str) -> StoredResponse | None:
        """The entry (now the most recently used), or None."""
        with self._lock:
            entry = self._entries.get((owner, response_id))
            if entry is not None:
                self._entries.move_to_end((owner, response_id))
            return entry

    def delete(self, owner: str, response_id: str) -> bool:
        with self._lock:
            entry = self._entries.pop((owner, response_id), None)
            if entry is not None:
                self.nbytes -= entry.nbytes
            return entry is not None


def owner_of(request: Request, keys_set: bool) -> str:
    """Whose responses a request sees: a digest of its API key when the server has keys (the key check
    already passed), else everyone's (one namespace)."""
    if not keys_set:
        return ""
    _, _, token = request.headers.get("authorization", "").partition(" ")
    return hashlib.sha256(token.strip().encode()).hexdigest()


def input_items(value: str | list[dict[str, Any]]) -> list[dict[str, Any]]:
    """A request's `input` as items (a string is one user message)."""
    if isinstance(value, str):
        return [{"type": "message", "role": "user", "content": value}]
    return list(value)
