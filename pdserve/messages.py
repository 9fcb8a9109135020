"""What crosses the router <-> worker boundary (Ray actor calls). Plain
dataclasses of built-in types, so they pickle cheaply and carry no torch."""

from __future__ import annotations

from bisect import bisect_left
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from pdserve.engine.sampling_params import SamplingParams

if TYPE_CHECKING:
    from pdserve.engine.engine import StepInfo

# Histogram bucket upper bounds (``le``) of the per-step statistics in ``WorkerStats``.
# Step time: a tiny model's decode step on a GPU (~0.1 ms) to a long prompt chunk on a
# few CPU threads (minutes).
STEP_SECONDS_BUCKETS = (
    0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.0075, 0.01, 0.015, 0.02, 0.03,
    0.04, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0,
    120.0, 300.0,
)  # fmt: skip
# Sequences per step (decode batch size; prefill chunks per step).
BATCH_SIZE_BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 192, 256, 384, 512, 1024)
# Tokens computed per step (prefill chunks + one per decode).
BATCH_TOKENS_BUCKETS = (
    1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384, 32768,
)  # fmt: skip


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
    # Per engine step that ran a batch, cumulative (``observe_step``): the step-time and
    # batch histograms keep one count per bucket of the *_BUCKETS bounds plus +Inf (not
    # cumulative across buckets; the exporter sums them). Tuples, replaced on every step,
    # so a snapshot copied with ``WorkerStats(**vars(s))`` never changes under a reader.
    steps: int = 0
    step_seconds: float = 0.0  # forward + sampling time (``StepInfo.seconds``)
    step_seconds_buckets: tuple[int, ...] = (0,) * (len(STEP_SECONDS_BUCKETS) + 1)
    seqs_computed: int = 0  # sum of batch sizes
    batch_size_buckets: tuple[int, ...] = (0,) * (len(BATCH_SIZE_BUCKETS) + 1)
    tokens_computed: int = 0
    batch_tokens_buckets: tuple[int, ...] = (0,) * (len(BATCH_TOKENS_BUCKETS) + 1)
    model_flops: float = 0.0  # model FLOPs of those steps (``deploy/efficiency.py``)
    memory_bytes_read: float = 0.0  # weights + KV bytes read by those steps

    def observe_step(self, info: StepInfo, flops: float, bytes_read: float) -> None:
        """Add one engine step that ran a batch (the worker's loop thread, after the step)."""
        self.steps += 1
        self.step_seconds += info.seconds
        self.step_seconds_buckets = _bump(self.step_seconds_buckets, STEP_SECONDS_BUCKETS,
                                          info.seconds)
        self.seqs_computed += info.num_seqs
        self.batch_size_buckets = _bump(self.batch_size_buckets, BATCH_SIZE_BUCKETS,
                                        info.num_seqs)
        self.tokens_computed += info.num_tokens
        self.batch_tokens_buckets = _bump(self.batch_tokens_buckets, BATCH_TOKENS_BUCKETS,
                                          info.num_tokens)
        self.model_flops += flops
        self.memory_bytes_read += bytes_read


def _bump(counts: tuple[int, ...], bounds: tuple[float, ...], value: float) -> tuple[int, ...]:
    """``counts`` with the bucket of ``value`` (first bound >= value, else +Inf) plus one."""
    i = bisect_left(bounds, value)
    return (*counts[:i], counts[i] + 1, *counts[i + 1:])
