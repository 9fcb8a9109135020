"""``OwnedTask``: the one asyncio task a long-lived object runs in the background (the
scaler's, the autoscaler's and the rebalancer's loops), started by its owner and
cancelled and awaited on ``stop``."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable, Coroutine
from typing import Any


class OwnedTask:
    def __init__(self, name: str, run: Callable[[], Coroutine[Any, Any, Any]]) -> None:
        self.name = name
        self._run = run
        self._task: asyncio.Task[Any] | None = None

    def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name=self.name)

    async def stop(self) -> None:
        """Cancel the task and wait until it ended (idempotent)."""
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
