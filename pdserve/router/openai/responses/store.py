"""The responses kept for ``previous_response_id`` and ``GET`` / ``DELETE
/v1/responses/{id}`` (``ResponseStore``): in the router's memory, with the
conversation that led to each."""

from __future__ import annotations

import json
from collections import OrderedDict
from typing import Any

from pydantic import TypeAdapter

from pdserve.router.openai.request_models import InvalidRequest
from pdserve.router.openai.responses.request import InputItem, ResponsesRequest

STORED = 1024  # responses kept for previous_response_id (each with its conversation)
STORED_BYTES = 256 << 20  # and their JSON at most (a long context's chain is large)
_ITEMS: TypeAdapter[list[Any]] = TypeAdapter(list[InputItem])


class ResponseStore:
    """The last ``limit`` responses that asked to be stored, with the conversation
    that led to each (input items, its own output last), at most ``max_bytes`` of
    JSON in all, the least recently used forgotten first. One router's memory: a
    restart forgets them."""

    def __init__(self, limit: int = STORED, max_bytes: int = STORED_BYTES):
        self._limit, self._max_bytes = limit, max_bytes
        self._bytes = 0
        # id -> (response, conversation, their JSON size)
        self._kept: OrderedDict[str, tuple[dict[str, Any], list[dict[str, Any]], int]] = (
            OrderedDict())

    def __len__(self) -> int:
        return len(self._kept)

    @property
    def bytes(self) -> int:
        return self._bytes

    def get(self, response_id: str) -> dict[str, Any] | None:
        kept = self._kept.get(response_id)
        return None if kept is None else kept[0]

    def delete(self, response_id: str) -> bool:
        kept = self._kept.pop(response_id, None)
        self._bytes -= 0 if kept is None else kept[2]
        return kept is not None

    def continued(self, r: ResponsesRequest) -> ResponsesRequest:
        """``r`` with the conversation of its ``previous_response_id`` before its own
        input; InvalidRequest when that response is not kept."""
        if r.previous_response_id is None:
            return r
        kept = self._kept.get(r.previous_response_id)
        if kept is None:
            raise InvalidRequest(
                f"previous_response_id {r.previous_response_id!r} is not a response this "
                f"server keeps (the last {self._limit} stored, until it restarts)",
                "previous_response_id")
        self._kept.move_to_end(r.previous_response_id)
        return r.model_copy(update={"input": [*_ITEMS.validate_python(kept[1]),
                                              *r.own_items()]})

    def keep(self, r: ResponsesRequest, response: dict[str, Any]) -> None:
        """Keep a finished ``response`` to ``r`` (already continued), if it asked."""
        if not r.store:
            return
        conversation = [*(item.model_dump(by_alias=True, exclude_none=True)
                          for item in r.own_items()), *response["output"]]
        size = len(json.dumps(conversation)) + len(json.dumps(response))
        self.delete(response["id"])
        self._kept[response["id"]] = (response, conversation, size)
        self._bytes += size
        while len(self._kept) > self._limit or self._bytes > self._max_bytes:
            self._bytes -= self._kept.popitem(last=False)[1][2]
