"""``Router``: the front door's core, small by design -- it validates and tokenizes a
request and hands it to the three parts that do the work:

* ``workers.WorkerSet`` -- who is in routing (health probes, joins, restarts, the
  P x D channels), the fault model's rules;
* ``admission.Admission`` -- where the tokens will be made and whether there is room
  (reservations, the bounded wait, 429);
* ``fanout.Fanout`` -- the token streams from the workers to each attempt, one hop;

and ``orchestrator.RequestRun`` runs one request over them (attempts, retries, text).

Request state machine (one attempt per worker pair or colocated worker tried)::

    QUEUED --admitted--> DISPATCHED --first token--> STREAMING --finished--> DONE
      |  no room past queue timeout: OVERLOADED        |
      |                                                +--attempt failed--> QUEUED (retry,
      +--deadline: DEADLINE_EXCEEDED                        prompt += emitted tokens)
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, replace
from typing import Any

from pdserve.engine.sampling.sampling_params import SamplingParams, request_problem
from pdserve.engine.tokenizer import Tokenizer
from pdserve.messages import ServingLimits, WorkerLoad
from pdserve.owned_task import OwnedTask
from pdserve.router.admission import Admission
from pdserve.router.clients import WorkerHandle
from pdserve.router.fanout import Fanout
from pdserve.router.orchestrator import RequestRun
from pdserve.router.placement import MODES, Slo
from pdserve.router.policies import PrefixIndex, get_policy
from pdserve.router.rebalance import Rebalancer
from pdserve.router.services import Services
from pdserve.router.types import (
    ErrorKind,
    FinalChunk,
    GenerateRequest,
    ModelInfo,
    RouterError,
    StreamChunk,
)
from pdserve.router.workers import HealthConfig, WorkerSet, WorkerState
from pdserve.tracing import Tracing

log = logging.getLogger("pdserve.router")


@dataclass(frozen=True)
class RouterConfig:
    policy: str = "least_loaded"
    max_waiting: int = 256  # requests waiting for decode blocks before 429s
    queue_timeout_s: float = 30.0  # how long one request may wait for blocks
    default_timeout_s: float = 600.0  # request deadline when the client sets none
    max_retries: int = 2  # attempts after the first one failed (the retry budget)
    stats_interval_s: float = 0.25  # health probe / load refresh period
    probe_timeout_s: float = 2.0  # a health probe not answered this soon failed
    health_timeout_s: float = 10.0  # probes failing this long: the worker leaves routing
    block_size: int = 16
    # A decode worker whose own prefix cache holds all but this many tokens of a prompt
    # (a conversation's next turn) computes them itself: no prefill worker, no KV
    # moved (docs/kv_transfer.md). 0: every prompt goes through a prefill worker.
    local_prefill_max_tokens: int = 64
    # Where each prompt is computed (router/placement.py): "measured" -- per request, a
    # prefill worker or the decode worker itself, from the workers' measured step
    # times, queues and the SLOs; "static" -- always a prefill worker (but for the
    # rule above): the decision off.
    placement: str = "measured"
    # A decode worker drained (``pdserve scale``, the autoscaler) moves its running
    # requests to the others with their KV (router/migration.py) instead of waiting for
    # them to finish; False: it waits (up to the drain timeout, then they fail over).
    move_on_drain: bool = True
    # Rebalancing (router/rebalance.py; off: not measured to pay yet): every
    # ``rebalance_interval_s`` a decode worker with more than ``rebalance_ratio`` x the
    # pool's mean of running requests, and ``rebalance_min_excess`` above it, moves half
    # its excess to the others with their KV.
    rebalance: bool = False
    rebalance_interval_s: float = 1.0
    rebalance_ratio: float = 1.5
    rebalance_min_excess: int = 4

    def __post_init__(self) -> None:
        get_policy(self.policy)
        if self.placement not in MODES:
            raise ValueError(f"router placement must be one of {MODES}, got {self.placement!r}")
        for name in ("max_waiting", "max_retries", "local_prefill_max_tokens"):
            if getattr(self, name) < 0:
                raise ValueError(f"router {name} must be >= 0")
        if self.rebalance_ratio < 1 or self.rebalance_min_excess < 1:
            raise ValueError("router rebalance_ratio must be >= 1 and rebalance_min_excess "
                             ">= 1")
        for name in ("queue_timeout_s", "default_timeout_s", "stats_interval_s",
                     "probe_timeout_s", "health_timeout_s", "rebalance_interval_s"):
            if getattr(self, name) <= 0:
                raise ValueError(f"router {name} must be > 0")


class Router:
    def __init__(self, model_name: str, tokenizer: Tokenizer, max_model_len: int,
                 workers: Sequence[WorkerHandle], config: RouterConfig | None = None,
                 metrics: Any = None, slo: Slo | None = None,
                 tracing: Tracing | None = None) -> None:
        """``workers``: handles of every worker, any role (``router/clients.py``);
        ``slo``: the deployment's targets, which the placement rule serves;
        ``tracing``: this process's tracer (pdserve/tracing.py), None: off."""
        self.model_name = model_name
        self.tokenizer = tokenizer
        self.max_model_len = max_model_len
        self.config = cfg = config or RouterConfig()
        self.fanout = Fanout()
        self.workers = WorkerSet(workers, self.fanout, HealthConfig(
            cfg.stats_interval_s, cfg.probe_timeout_s, cfg.health_timeout_s),
            ServingLimits(cfg.block_size, max_model_len, model_name),
            on_change=self._worker_changed)
        self.prefix = PrefixIndex()
        self.admission = Admission(self.workers, get_policy(cfg.policy), self.prefix,
                                   cfg.max_waiting, cfg.queue_timeout_s, cfg.block_size,
                                   cfg.local_prefill_max_tokens, cfg.placement, slo)
        self._services = Services(self.workers, self.admission, self.fanout, self.prefix,
                                  tokenizer, cfg.block_size, cfg.max_retries, None, tracing,
                                  model_name)
        self._rebalancing = OwnedTask("rebalance", Rebalancer(
            lambda: {w.worker_id: w.outstanding_requests for w in self.workers.live("decode")},
            self.fanout.request_moves, cfg.rebalance_interval_s, cfg.rebalance_ratio,
            cfg.rebalance_min_excess).run) if cfg.rebalance else None
        self._active: set[str] = set()  # request ids in flight (client ids are unique)
        self._draining = False
        self._idle = asyncio.Event()  # set whenever nothing is in flight
        self._idle.set()
        self.metrics = metrics  # the setter: they also see this router's workers

    @property
    def metrics(self) -> Any:
        """The ``RouterMetrics`` every request reports to (None: not recorded)."""
        return self._services.metrics

    @metrics.setter
    def metrics(self, metrics: Any) -> None:
        self._services.metrics = metrics
        if metrics is not None:
            metrics.watch(self.max_model_len, self._engine_loads, self.config.block_size)

    def _engine_loads(self) -> dict[str, WorkerLoad]:
        """Each worker in routing's last answered load (the metrics' per-engine gauges)."""
        return {wid: w.load for wid, w in self.workers.workers.items()
                if w.alive and w.load is not None}

    # ----------------------------------------------------------------- lifecycle
    async def start(self) -> None:
        await self.workers.start()
        if self._rebalancing is not None:
            self._rebalancing.start()

    async def stop(self) -> None:
        if self._rebalancing is not None:
            await self._rebalancing.stop()
        await self.workers.stop()
        if self._services.tracing is not None:  # what is left goes out (a few seconds at most)
            await asyncio.to_thread(self._services.tracing.shutdown)

    def ready(self) -> bool:
        return not self._draining and self.workers.ready()

    def begin_drain(self) -> None:
        """Admit nothing more (NOT_READY with a retry hint, ``ready()`` False at once);
        what is in flight goes on (a graceful shutdown, ``pdserve serve`` on SIGTERM)."""
        self._draining = True

    @property
    def num_in_flight(self) -> int:
        return len(self._active)

    async def drained(self, timeout_s: float) -> int:
        """Wait until nothing is in flight, at most ``timeout_s``; the number left."""
        if self._active:
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(timeout_s):
                    await self._idle.wait()
        return len(self._active)

    def models(self) -> list[ModelInfo]:
        return [ModelInfo(id=self.model_name, max_model_len=self.max_model_len)]

    def worker_states(self) -> dict[str, bool]:
        """worker id -> in routing."""
        return {wid: w.alive for wid, w in self.workers.workers.items()}

    def worker_info(self) -> list[dict[str, Any]]:
        """Every worker as an operator sees it (``/admin/workers``)."""
        out = []
        for w in self.workers.workers.values():
            load = w.load
            out.append({
                "id": w.worker_id, "role": w.role, "state": w.state, "restarts": w.restarts,
                "requests": w.outstanding_requests,
                "free_blocks": load.num_free_blocks if load else None,
                "blocks": load.num_blocks if load else None,
                "metrics": f"{w.metrics[0]}:{w.metrics[1]}" if w.metrics else None,
            })
        return out

    async def add_worker(self, handle: WorkerHandle) -> None:
        """A worker started at runtime joins routing (see ``WorkerSet.add``)."""
        await self.workers.add(handle)

    async def drain_worker(self, worker_id: str, timeout_s: float) -> int:
        """No new requests for ``worker_id``; once its attempts end (or ``timeout_s``
        passes: they fail over) it leaves for good. Returns the number cut off. A
        decode worker's running requests move to the others first (``move_on_drain``)."""
        evacuate = ((lambda: self.fanout.request_moves(worker_id, "drain"))
                    if self.config.move_on_drain else None)
        return await self.workers.drain(worker_id, timeout_s, evacuate)

    def metrics_targets(self) -> dict[str, tuple[str, int]]:
        """worker id -> its ``/metrics`` (host, port), for the workers joined (a
        draining one still reports)."""
        return {wid: w.metrics for wid, w in self.workers.workers.items()
                if w.alive and w.metrics is not None}

    # ------------------------------------------------------------------ generate
    async def generate(self, req: GenerateRequest) -> AsyncIterator[StreamChunk | FinalChunk]:
        """The request's stream: ``StreamChunk``s, then one ``FinalChunk``; raises
        ``RouterError`` (before or during the stream)."""
        arrival = time.monotonic()
        try:
            if self._draining:
                raise RouterError(ErrorKind.NOT_READY, "the server is shutting down",
                                  retry_after_s=1.0)
            if (problem := req.problem()) is not None:
                raise RouterError(ErrorKind.INVALID, problem[1], param=problem[0])
            prompt = self._tokenize(req)
            if req.prediction:
                ids = self.tokenizer.encode(req.prediction, add_special_tokens=False)
                req.params = replace(req.params, prediction=tuple(ids))
            if req.bad_words:
                try:
                    req.params = replace(req.params, bad_words=self._bad_words(req.bad_words))
                except ValueError as exc:  # too many tokens
                    raise RouterError(ErrorKind.INVALID, str(exc), param="bad_words") from exc
            self._validate(prompt, req.params)
            await self._wait_ready()
            if self.admission.full():
                raise RouterError(ErrorKind.OVERLOADED, "too many requests waiting for KV blocks",
                                  retry_after_s=1.0)
            if req.request_id in self._active:
                raise RouterError(ErrorKind.INVALID,
                                  f"request id {req.request_id!r} is already in flight")
        except RouterError as exc:
            self._reject(exc.kind)
            raise
        self._active.add(req.request_id)
        self._idle.clear()
        deadline = arrival + (req.timeout_s or self.config.default_timeout_s)
        try:
            async for item in RequestRun(self._services, req, prompt, arrival, deadline).stream():
                yield item
        except RouterError as exc:
            self._reject(exc.kind)
            raise
        finally:
            self._active.discard(req.request_id)
            if not self._active:
                self._idle.set()

    # ------------------------------------------------------------------ helpers
    async def _wait_ready(self) -> None:
        """Nobody serving: wait (at most ``health_timeout_s``) for a worker rejoining."""
        give_up = time.monotonic() + self.config.health_timeout_s
        self.admission.watch()
        while not self.ready():
            if time.monotonic() >= give_up:
                raise RouterError(ErrorKind.NOT_READY, "no worker is serving right now",
                                  retry_after_s=1.0)
            await self.admission.wait_for_change(give_up - time.monotonic())
            self.admission.watch()

    def prompt_ids(self, req: GenerateRequest) -> list[int]:
        """The request's prompt as token ids, checked as ``generate`` checks them
        (``RouterError`` INVALID: no prompt, ids outside the vocabulary, too long)."""
        prompt = self._tokenize(req)
        self._validate(prompt, req.params)
        return prompt

    def _tokenize(self, req: GenerateRequest) -> list[int]:
        """The prompt's ids, cut to its last ``truncate_prompt_tokens`` (-1: to what
        leaves ``max_tokens`` of the context)."""
        given = [x is not None for x in (req.prompt, req.messages, req.prompt_token_ids)]
        if sum(given) != 1:
            raise RouterError(ErrorKind.INVALID,
                              "give exactly one of prompt, messages, prompt_token_ids")
        try:
            if req.prompt is not None:
                ids = self.tokenizer.encode(req.prompt)
            elif req.messages is not None:
                ids = self.tokenizer.apply_chat_template(req.messages, tools=req.tools,
                                                         **req.chat_template_args)
            else:
                ids = list(req.prompt_token_ids or [])
        except (ValueError, TypeError, UnicodeError) as exc:  # e.g. lone surrogates
            raise RouterError(ErrorKind.INVALID, f"cannot tokenize the prompt: {exc}",
                              param="prompt") from exc
        keep = req.truncate_prompt_tokens
        if keep == -1:
            keep = max(1, self.max_model_len - req.params.max_tokens)
        return ids[-keep:] if keep is not None and len(ids) > keep else ids

    def _bad_words(self, words: Sequence[str]) -> tuple[tuple[int, ...], ...]:
        """Each word's tokens, as it starts the text and as it follows a space (vLLM's
        rule: byte-level BPE spells the two differently); duplicates dropped."""
        seqs: dict[tuple[int, ...], None] = {}
        for word in words:
            for text in (word.lstrip(), " " + word.lstrip()):
                ids = tuple(self.tokenizer.encode(text, add_special_tokens=False))
                if ids:
                    seqs[ids] = None
        if not seqs:
            raise RouterError(ErrorKind.INVALID, "bad_words has no word to ban", param="bad_words")
        return tuple(seqs)

    def _validate(self, prompt: list[int], params: SamplingParams) -> None:
        """The engine's own rules (``request_problem``), before routing: a request no
        worker can serve is a 400 at once, not an attempt."""
        problem = request_problem(prompt, params, self.tokenizer.vocab_size, self.max_model_len)
        if problem:
            raise RouterError(ErrorKind.INVALID, problem[0], param=problem[1])

    def _worker_changed(self, w: WorkerState, what: str) -> None:
        if what in ("left", "removed"):  # its prefix cache is gone from routing
            self.prefix.forget_worker(w.worker_id)
            self.admission.ranking.token_prefix.forget_worker(w.worker_id)
        if what != "left":
            self.admission.wake()  # room may have appeared
        if self.metrics is not None:
            self.metrics.observe_worker(w.worker_id, w.role, what,
                                        len(self.workers.live(w.role)))

    def _reject(self, kind: ErrorKind) -> None:
        if self.metrics is not None:
            self.metrics.observe_rejected(kind)
