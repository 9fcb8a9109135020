"""``Router``: the front door's core. Validates and tokenizes a request, picks a
prefill/decode pair, reserves KV blocks on the decode worker (admission), starts
the prefill, streams the decode worker's tokens, and on a worker failure retries
on another pair without sending any token twice.

Request state machine (one ``_Attempt`` per pair tried)::

    QUEUED --reserve ok--> DISPATCHED --first token--> STREAMING --finished--> DONE
      |  no room past queue timeout: OVERLOADED        |
      |                                                +--worker failed--> QUEUED (retry,
      +--deadline: DEADLINE_EXCEEDED                        prompt += emitted tokens)

Token delivery: one poller task per decode worker collects each engine step's
output batch and fans it out to the request streams.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import itertools
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from pdserve.engine.block_pool import prefix_block_hashes
from pdserve.engine.sampling_params import SamplingParams
from pdserve.engine.tokenizer import Tokenizer
from pdserve.messages import DecodeOutput, PrefillResult, PrefillTask, WorkerStats
from pdserve.router.clients import DecodeClient, PrefillClient
from pdserve.router.policies import ClusterSnapshot, PrefixIndex, RouteInput, WorkerView, get_policy
from pdserve.router.types import (
    ErrorKind,
    FinalChunk,
    GenerateRequest,
    ModelInfo,
    RouterError,
    StageTimings,
    StreamChunk,
    TokenLogprob,
    Usage,
)

log = logging.getLogger("pdserve.router")


@dataclass(frozen=True)
class RouterConfig:
    policy: str = "least_loaded"
    max_waiting: int = 256  # requests waiting for decode blocks before 429s
    queue_timeout_s: float = 30.0  # how long one request may wait for blocks
    default_timeout_s: float = 600.0  # request deadline when the client sets none
    max_retries: int = 2  # pairs tried after the first one failed
    stats_interval_s: float = 0.25  # worker stats refresh
    poll_timeout_s: float = 0.05  # decode output long-poll
    block_size: int = 16

    def __post_init__(self) -> None:
        get_policy(self.policy)
        for name in ("max_waiting", "max_retries"):
            if getattr(self, name) < 0:
                raise ValueError(f"router {name} must be >= 0")
        for name in ("queue_timeout_s", "default_timeout_s", "stats_interval_s", "poll_timeout_s"):
            if getattr(self, name) <= 0:
                raise ValueError(f"router {name} must be > 0")


class _WorkerFailed(Exception):
    """This attempt's pair failed; the request may be retried elsewhere."""


@dataclass
class _Worker:
    client: PrefillClient | DecodeClient
    alive: bool = True
    stats: WorkerStats | None = None
    outstanding_tokens: int = 0
    outstanding_requests: int = 0
    streams: set[str] = field(default_factory=set)  # decode: attempt ids it serves


class Router:
    def __init__(self, model_name: str, tokenizer: Tokenizer, max_model_len: int,
                 prefill: list[PrefillClient], decode: list[DecodeClient],
                 config: RouterConfig | None = None, metrics: object | None = None) -> None:
        self.model_name = model_name
        self.tokenizer = tokenizer
        self.max_model_len = max_model_len
        self.config = config or RouterConfig()
        self.metrics = metrics
        self._policy = get_policy(self.config.policy)
        self._prefill = {c.worker_id: _Worker(c) for c in prefill}
        self._decode = {c.worker_id: _Worker(c) for c in decode}
        self._streams: dict[str, asyncio.Queue[DecodeOutput | _WorkerFailed]] = {}
        self._prefix = PrefixIndex()
        self._seq = itertools.count()
        self._attempts = itertools.count()
        self._num_waiting = 0
        self._active: set[str] = set()  # request ids in flight (client ids are unique)
        self._capacity = asyncio.Event()  # set whenever a request finishes somewhere
        self._tasks: list[asyncio.Task[None]] = []

    # ----------------------------------------------------------------- lifecycle
    async def start(self) -> None:
        for wid in self._decode:
            self._tasks.append(asyncio.create_task(self._poll_decode(wid)))
        self._tasks.append(asyncio.create_task(self._refresh_stats()))
        await self._refresh_once()

    async def stop(self) -> None:
        for t in self._tasks:
            t.cancel()
        for t in self._tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await t
        self._tasks.clear()

    def ready(self) -> bool:
        return any(w.alive for w in self._prefill.values()) and any(
            w.alive for w in self._decode.values())

    def models(self) -> list[ModelInfo]:
        return [ModelInfo(id=self.model_name, max_model_len=self.max_model_len)]

    def worker_states(self) -> dict[str, bool]:
        return {wid: w.alive for wid, w in (self._prefill | self._decode).items()}

    # ------------------------------------------------------------------ generate
    async def generate(self, req: GenerateRequest) -> AsyncIterator[StreamChunk | FinalChunk]:
        arrival = time.monotonic()
        prompt = self._tokenize(req)
        self._validate(prompt, req.params)
        if not self.ready():
            raise RouterError(ErrorKind.NOT_READY, "no live prefill/decode worker pair")
        if self._num_waiting >= self.config.max_waiting:
            self._reject(ErrorKind.OVERLOADED)
            raise RouterError(ErrorKind.OVERLOADED, "too many requests waiting for KV blocks",
                              retry_after_s=1.0)
        if req.request_id in self._active:
            raise RouterError(ErrorKind.INVALID,
                              f"request id {req.request_id!r} is already in flight")
        self._active.add(req.request_id)
        try:
            async for item in self._run(req, prompt, arrival):
                yield item
        finally:
            self._active.discard(req.request_id)

    async def _run(self, req: GenerateRequest, prompt: list[int], arrival: float,
                   ) -> AsyncIterator[StreamChunk | FinalChunk]:
        """The retry loop: one ``_attempt`` per worker pair tried."""
        deadline = arrival + (req.timeout_s or self.config.default_timeout_s)
        timings = StageTimings()
        emitted: list[int] = []
        last_token_at: list[float] = []
        cached = 0
        failures: list[str] = []
        for attempt in range(self.config.max_retries + 1):
            try:
                async for item in self._attempt(req.request_id, attempt, prompt, emitted,
                                                req.params, deadline, arrival, timings):
                    if isinstance(item, PrefillResult):  # may come after the last token
                        cached = cached or item.num_cached_tokens
                        timings.prefill_queue, timings.prefill = (item.prefill_queue_s,
                                                                  item.prefill_s)
                        timings.kv_transfer = item.kv_transfer_s
                        continue
                    if isinstance(item, StreamChunk):
                        now = time.monotonic()
                        if timings.ttft is None:
                            timings.ttft = now - arrival
                        elif last_token_at:
                            timings.inter_token.append(now - last_token_at[-1])
                        last_token_at[:] = [now]
                        emitted.extend(item.token_ids)
                        yield item
                        continue
                    timings.e2e = time.monotonic() - arrival
                    final = dataclasses.replace(
                        item, usage=Usage(len(prompt), len(emitted), cached),
                        timings=timings, num_retries=attempt)
                    self._observe(final)
                    yield final
                    return
            except _WorkerFailed as exc:
                failures.append(str(exc))
                log.warning("request %s attempt %d failed: %s", req.request_id, attempt, exc)
                if time.monotonic() >= deadline:
                    break
        self._reject(ErrorKind.INTERNAL)
        raise RouterError(ErrorKind.INTERNAL,
                          f"request failed on {len(failures)} worker pair(s): "
                          + "; ".join(failures))

    async def _attempt(self, rid: str, attempt: int, prompt: list[int], emitted: list[int],
                       params: SamplingParams, deadline: float, arrival: float,
                       timings: StageTimings,
                       ) -> AsyncIterator[StreamChunk | FinalChunk | PrefillResult]:
        # Worker-side id: unique per attempt even when a client reuses its id right
        # after a cancel whose abort has not reached the workers yet.
        aid = f"{rid}#{next(self._attempts)}"
        ids = prompt + emitted
        if emitted:  # continue where the failed pair stopped
            params = dataclasses.replace(
                params, max_tokens=params.max_tokens - len(emitted),
                min_tokens=max(0, params.min_tokens - len(emitted)))
        hashes = prefix_block_hashes(ids, self.config.block_size)
        d_id, blocks = await self._admit(aid, ids, params, hashes, deadline)
        if timings.router_queue is None:
            timings.router_queue = time.monotonic() - arrival
        # Pick P only now, and count the work against it before the next await, so
        # that concurrent admissions see each other's choices.
        p_id = self._policy(self._snapshot(), RouteInput(len(ids), hashes))[0]
        p, d = self._prefill[p_id], self._decode[d_id]
        queue: asyncio.Queue[DecodeOutput | _WorkerFailed] = asyncio.Queue()
        self._streams[aid] = queue
        d.streams.add(aid)
        p.outstanding_tokens += len(ids)
        p.outstanding_requests += 1
        d.outstanding_requests += 1
        self._prefix.record(hashes, p_id)
        task = PrefillTask(aid, ids, params, d_id, blocks)
        prefill = asyncio.ensure_future(p.client.prefill(task))  # type: ignore[union-attr]
        finished = False
        try:
            get: asyncio.Future[DecodeOutput | _WorkerFailed] = asyncio.ensure_future(queue.get())
            while True:
                waits: set[asyncio.Future[object]] = {get}  # type: ignore[arg-type]
                if not prefill.done():
                    waits.add(prefill)
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise RouterError(ErrorKind.DEADLINE, f"request {rid} passed its deadline")
                done, _ = await asyncio.wait(waits, timeout=remaining,
                                             return_when=asyncio.FIRST_COMPLETED)
                if prefill in done:
                    p.outstanding_tokens -= len(ids)
                    p.outstanding_requests -= 1
                    try:
                        res = prefill.result()
                    except Exception as exc:
                        self._mark(p_id, exc)
                        raise _WorkerFailed(f"prefill worker {p_id}: {exc}") from exc
                    yield res
                if get not in done:
                    continue
                out = get.result()
                get = asyncio.ensure_future(queue.get())
                if isinstance(out, _WorkerFailed):
                    raise out
                if out.error is not None:
                    raise _WorkerFailed(f"decode worker {d_id}: {out.error}")
                if out.decode_queue_s is not None:
                    timings.decode_queue = out.decode_queue_s
                if out.token_ids or out.text:
                    yield StreamChunk(out.token_ids, out.text, [
                        TokenLogprob(t, lp, list(top)) for t, lp, top in out.logprobs])
                if out.finished:
                    finished = True
                    if not prefill.done():
                        # P's stage timings come with its transfer ack, which normally
                        # lands before the first decode step; only a request done in a
                        # token or two, on a loaded machine, gets here.
                        with contextlib.suppress(Exception):
                            yield await asyncio.wait_for(prefill, timeout=5.0)
                    yield FinalChunk(out.finish_reason or "stop", Usage(0, 0),
                                     stop_reason=out.stop_reason)
                    return
        finally:
            get.cancel()
            self._streams.pop(aid, None)
            d.streams.discard(aid)
            d.outstanding_requests -= 1
            if not prefill.done():
                prefill.cancel()
                p.outstanding_tokens -= len(ids)
                p.outstanding_requests -= 1
            if not finished:  # cancelled, failed or past deadline: free both sides
                await self._abort(aid, p_id, d_id)
            self._capacity.set()

    # ------------------------------------------------------------------ admission
    async def _admit(self, aid: str, ids: list[int], params: SamplingParams,
                     hashes: list[int], deadline: float) -> tuple[str, list[int]]:
        """Reserve decode blocks on the best-ranked decode worker with room; wait
        (bounded) while all are full."""
        give_up = min(deadline, time.monotonic() + self.config.queue_timeout_s)
        self._num_waiting += 1
        try:
            while True:
                if not self.ready():
                    raise _WorkerFailed("no live prefill/decode worker pair")
                _, order = self._policy(self._snapshot(), RouteInput(len(ids), hashes))
                for d_id in order:
                    self._capacity.clear()
                    try:
                        blocks = await self._decode[d_id].client.reserve(  # type: ignore[union-attr]
                            aid, ids, params)
                    except ValueError as exc:
                        raise RouterError(ErrorKind.INVALID, str(exc)) from exc
                    except Exception as exc:
                        self._mark(d_id, exc)
                        continue
                    if blocks is not None:
                        return d_id, blocks
                remaining = give_up - time.monotonic()
                if remaining <= 0:
                    self._reject(ErrorKind.OVERLOADED)
                    raise RouterError(ErrorKind.OVERLOADED,
                                      "no decode worker has room for this request",
                                      retry_after_s=1.0)
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(self._capacity.wait(), timeout=min(remaining, 0.5))
        finally:
            self._num_waiting -= 1

    def _snapshot(self) -> ClusterSnapshot:
        def view(wid: str, w: _Worker) -> WorkerView:
            s = w.stats
            return WorkerView(wid, w.outstanding_tokens, w.outstanding_requests,
                              s.num_free_blocks if s else 0, s.num_blocks if s else 1)

        return ClusterSnapshot(
            prefill=[view(i, w) for i, w in self._prefill.items() if w.alive],
            decode=[view(i, w) for i, w in self._decode.items() if w.alive],
            sequence=next(self._seq),
            prefix_owner=self._prefix.view(),
        )

    # ------------------------------------------------------------- background
    async def _poll_decode(self, wid: str) -> None:
        w = self._decode[wid]
        client: DecodeClient = w.client  # type: ignore[assignment]
        while w.alive:
            try:
                batch = await client.poll_outputs(self.config.poll_timeout_s)
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                self._mark(wid, exc)
                break
            for out in batch:
                q = self._streams.get(out.request_id)
                if q is not None:
                    q.put_nowait(out)
                if out.finished:
                    self._capacity.set()
        failure = _WorkerFailed(f"decode worker {wid} is gone")
        for aid in list(w.streams):
            q = self._streams.get(aid)
            if q is not None:
                q.put_nowait(failure)

    async def _refresh_stats(self) -> None:
        while True:
            await asyncio.sleep(self.config.stats_interval_s)
            await self._refresh_once()

    async def _refresh_once(self) -> None:
        workers = [(i, w) for i, w in (self._prefill | self._decode).items() if w.alive]
        results = await asyncio.gather(*(w.client.stats() for _, w in workers),
                                       return_exceptions=True)
        for (wid, w), res in zip(workers, results, strict=True):
            if isinstance(res, BaseException):
                self._mark(wid, res)
            else:
                w.stats = res

    def _mark(self, wid: str, exc: BaseException) -> None:
        """A call failed: treat the worker as dead (Ray restarts are deploy's job)."""
        w = self._prefill.get(wid) or self._decode.get(wid)
        if w is not None and w.alive:
            log.error("worker %s failed, taking it out of rotation: %r", wid, exc)
            w.alive = False
            self._prefix.forget_worker(wid)
            self._capacity.set()

    async def _abort(self, aid: str, p_id: str, d_id: str) -> None:
        for w in (self._prefill[p_id], self._decode[d_id]):
            if w.alive:
                with contextlib.suppress(Exception):
                    await w.client.abort(aid)

    # ------------------------------------------------------------------ helpers
    def _tokenize(self, req: GenerateRequest) -> list[int]:
        given = [x is not None for x in (req.prompt, req.messages, req.prompt_token_ids)]
        if sum(given) != 1:
            raise RouterError(ErrorKind.INVALID,
                              "give exactly one of prompt, messages, prompt_token_ids")
        try:
            if req.prompt is not None:
                return self.tokenizer.encode(req.prompt)
            if req.messages is not None:
                return self.tokenizer.apply_chat_template(req.messages)
        except ValueError as exc:
            raise RouterError(ErrorKind.INVALID, str(exc)) from exc
        return list(req.prompt_token_ids or [])

    def _validate(self, prompt: list[int], params: SamplingParams) -> None:
        n, limit = len(prompt), self.max_model_len
        vocab = self.tokenizer.vocab_size
        problem = None
        if n == 0:
            problem = "prompt is empty"
        elif any(not 0 <= t < vocab for t in prompt):
            problem = f"prompt token ids must be in [0, {vocab})"
        elif n >= limit:
            problem = f"prompt has {n} tokens; the model's context is {limit} tokens"
        elif n + params.max_tokens > limit:
            problem = (f"max_tokens={params.max_tokens} cannot fit: prompt ({n}) + max_tokens "
                       f"exceeds the context of {limit} tokens (at most {limit - n} new tokens)")
        if problem:
            self._reject(ErrorKind.INVALID)
            raise RouterError(ErrorKind.INVALID, problem)

    def _observe(self, final: FinalChunk) -> None:
        if self.metrics is not None:
            self.metrics.observe_finished(final)  # type: ignore[attr-defined]

    def _reject(self, kind: ErrorKind) -> None:
        if self.metrics is not None:
            self.metrics.observe_rejected(kind)  # type: ignore[attr-defined]
