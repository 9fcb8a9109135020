"""Sending a benchmark's requests: the arrival process and the concurrency cap.

This module owns when each request is sent. Arrival offsets (seconds after the
run starts) come from one of:

* ``request_rate = inf``: every request at offset 0;
* a gamma process with mean rate ``request_rate``: gaps are
  Gamma(shape=burstiness, scale=1 / (rate * burstiness)) — mean 1/rate, coefficient
  of variation 1/sqrt(burstiness); ``burstiness = 1`` is a Poisson process, lower is
  burstier, higher is more regular. The first request goes at 0, and (as vLLM's
  ``bench serve`` does) the gaps are rescaled so that the run offers exactly the
  asked rate: the last request goes at ``(n - 1) / rate``. Without this a
  24-request Poisson run is typically ±20% off its rate, which blurs a sweep;
* trace replay: each request's own ``timestamp``.

``max_concurrency`` then caps requests in flight: a request whose time has come
waits for a free slot, and that wait is recorded as its ``queue_time`` (its
``start_time`` is when it was actually sent, as in vLLM).
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from pdserve.client.datasets import SampleRequest
from pdserve.client.openai_stream import OpenAIStreamClient, RequestOutput, request_body


def arrival_offsets(n: int, request_rate: float, burstiness: float = 1.0,
                    seed: int = 0) -> list[float]:
    """Send offsets (s) of `n` requests for a mean `request_rate` (req/s)."""
    if request_rate <= 0:
        raise ValueError(f"--request-rate must be > 0 (or inf), got {request_rate}")
    if burstiness <= 0:
        raise ValueError(f"--burstiness must be > 0, got {burstiness}")
    if n <= 0:
        return []
    if math.isinf(request_rate):
        return [0.0] * n
    rng = np.random.default_rng(seed)
    gaps = rng.gamma(shape=burstiness, scale=1.0 / (request_rate * burstiness), size=n - 1)
    offsets = np.cumsum(gaps)
    if n > 1 and offsets[-1] > 0:
        offsets *= (n - 1) / request_rate / offsets[-1]
    return [0.0, *offsets.tolist()]


def trace_offsets(requests: Sequence[SampleRequest]) -> list[float]:
    """Send offsets taken from the requests' own (already scaled) timestamps."""
    return [r.timestamp or 0.0 for r in requests]


@dataclass(frozen=True)
class RunSpec:
    """What every request of one run shares."""

    endpoint: str  # "/v1/completions" or "/v1/chat/completions"
    model: str
    ignore_eos: bool = False
    max_concurrency: int | None = None  # None: no cap
    extra_body: Mapping[str, Any] | None = None  # merged into every body


async def run_requests(client: OpenAIStreamClient, requests: Sequence[SampleRequest],
                       offsets: Sequence[float], spec: RunSpec,
                       on_done: Callable[[RequestOutput], None] | None = None,
                       ) -> tuple[list[RequestOutput], float]:
    """Send every request at its offset; returns (outputs in request order, duration s).

    The duration runs from the first send slot to the last request's end.
    """
    if len(offsets) != len(requests):
        raise ValueError("one arrival offset per request")
    limit: contextlib.AbstractAsyncContextManager[Any] = (
        asyncio.Semaphore(spec.max_concurrency) if spec.max_concurrency
        else contextlib.nullcontext())

    async def one(req: SampleRequest) -> RequestOutput:
        due = time.perf_counter()
        body = request_body(spec.endpoint, spec.model, req.prompt, req.expected_output_len,
                            spec.ignore_eos, spec.extra_body)
        async with limit:
            out = await client.stream(spec.endpoint, body, prompt_len=req.prompt_len)
        out.queue_time = out.start_time - due
        if on_done is not None:
            on_done(out)
        return out

    start = time.perf_counter()
    tasks: list[asyncio.Task[RequestOutput]] = []
    for req, offset in zip(requests, offsets, strict=True):
        delay = start + offset - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        tasks.append(asyncio.create_task(one(req)))
    outputs = list(await asyncio.gather(*tasks))
    return outputs, time.perf_counter() - start
