"""``BaseReceiver``: the half of ``KVReceiver`` every backend shares, written once --
the layout checked against the tensor, the request bookkeeping (``RecvTracker``),
``expect``, the plain ``poll`` (expire, then hand out what ended), ``abort`` (ends the
request at once: right for backends whose writes happen on the receiver's side under
the tracker lock; nixl's one-sided writes override it with a handshake), failing every
pending request on close, ``num_pending``, and the endpoint's common fields.

A backend adds ``endpoint`` (``_endpoint`` with its own fields), ``close`` (calling
``_fail_pending``) and whatever moves its bytes.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from .base import FailReason, KVReceiver, RecvEvent
from .layout import KVLayout
from .recv_state import RecvTracker


class BaseReceiver(KVReceiver):
    def __init__(self, kv: torch.Tensor, layout: KVLayout) -> None:
        self.layout = layout
        self.kv = kv
        self.num_blocks = layout.check_tensor(kv)
        self._state = RecvTracker(self.num_blocks)

    def _endpoint(self, backend: str, **fields: Any) -> dict[str, Any]:
        """What a sender needs to connect: the backend's ``fields``, the layout (checked
        by the sender) and the block count."""
        return {"backend": backend, **fields, "layout": self.layout.to_dict(),
                "num_blocks": self.num_blocks}

    def expect(self, request_id: str, dst_block_ids: Sequence[int], timeout_s: float) -> None:
        self._state.expect(request_id, dst_block_ids, timeout_s)

    def poll(self) -> list[RecvEvent]:
        return self._state.expire_and_drain()

    def abort(self, request_id: str) -> None:
        # Writes land under the tracker lock, so once end() returns none can land.
        self._state.end(request_id, FailReason.ABORTED, "aborted by receiver")

    def _fail_pending(self) -> None:
        """Every request still expected ends failed (CLOSED): the receiver is closing."""
        for rid in self._state.pending_ids():
            self._state.end(rid, FailReason.CLOSED, "receiver closed")

    @property
    def num_pending(self) -> int:
        return self._state.num_pending
