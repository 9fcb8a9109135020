"""What crosses the router <-> worker boundary (Ray actor calls). Plain
dataclasses of built-in types, so they pickle cheaply and carry no torch."""

from __future__ import annotations

from dataclasses import dataclass, field

from pdserve.engine.sampling_params import SamplingParams


@dataclass
class PrefillTask:
    """Router -> prefill worker: compute a prompt, push its KV to a decode worker."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    decode_worker: str  # id of the decode worker whose blocks were reserved
    dst_block_ids: list[int]  # reserved blocks on that worker, in token order


@dataclass
class PrefillResult:
    """Prefill worker -> router, once the decode worker acknowledged the KV."""

    request_id: str
    first_token: int
    num_cached_tokens: int  # prompt tokens served by this worker's prefix cache
    prefill_queue_s: float  # received -> first scheduled (prefill worker's clock)
    prefill_s: float  # first scheduled -> first token sampled
    kv_transfer_s: float  # send started -> acknowledged
    kv_bytes: int


@dataclass
class DecodeOutput:
    """One request's part of a decode step's output batch (decode worker -> router)."""

    request_id: str
    token_ids: list[int]
    text: str
    finished: bool
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    logprobs: list[tuple[int, float, list[tuple[int, float]]]] = field(default_factory=list)
    decode_queue_s: float | None = None  # with the first token: KV arrived -> decoding
    error: str | None = None  # the request failed on this worker (e.g. KV never arrived)


@dataclass
class WorkerStats:
    """A worker's load, for routing policies and metrics (worker's snapshot)."""

    worker_id: str
    role: str  # "prefill" | "decode"
    num_running: int
    num_waiting: int
    num_free_blocks: int
    num_blocks: int
    queued_prefill_tokens: int = 0
    num_waiting_for_kv: int = 0
    prefix_queries: int = 0
    prefix_hits: int = 0
    num_preemptions: int = 0
    kv_transfer_bytes: int = 0
    kv_transfer_failures: int = 0
    kv_transfers: int = 0
    kv_transfer_seconds: float = 0.0
    blocks_in_flight: int = 0  # blocks held for transfers not yet acknowledged
    steps: int = 0
    step_seconds: float = 0.0
    tokens_computed: int = 0
