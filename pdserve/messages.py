"""What crosses the router <-> worker boundary. Plain types of built-in values, so
they pickle cheaply (Ray calls, the token stream) and carry no torch.

Per request: ``PrefillTask`` (router -> prefill worker) and its ``PrefillResult``;
per engine step of a decode or colocated worker: one list of ``RequestDelta`` on the
worker's token stream (``output_stream``). Per worker: ``WorkerLoad`` (small, for
routing and health probes, asked for every ``stats_interval_s``) and
``WorkerMetrics`` (observability, read by the worker's own ``/metrics``).
"""

from __future__ import annotations

from bisect import bisect_left
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, NamedTuple

from pdserve.engine.sampling.logprobs import TokenLogprob
from pdserve.engine.sampling.sampling_params import SamplingParams
from pdserve.failures import FailReason

__all__ = ["TokenLogprob"]  # re-exported: the workers' and the API layers' shape

if TYPE_CHECKING:
    from pdserve.engine.results import StepInfo

# Histogram bucket upper bounds (``le``) of the per-step statistics in ``WorkerMetrics``.
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

# One request's KV transfer (vLLM's NIXL bounds, v1/.../nixl/stats.py): seconds from
# the last send to the acknowledgement, and bytes.
KV_XFER_SECONDS_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.2, 0.3, 0.5, 0.75, 1.0, 5.0)
KV_XFER_BYTES_BUCKETS = tuple(float(2 ** (10 + i)) for i in range(1, 25, 2))

ROLES = ("prefill", "decode", "colocated")


class LocalPrefill(NamedTuple):
    """Router -> decode worker: when it computes a prompt itself, not a prefill worker
    (``router/placement.py`` decides). ``any_tokens``: whenever at most this many of
    the prompt's tokens are not in its prefix cache (the router chose local);
    ``after_reuse``: when its prefix cache holds the prompt's first blocks and leaves
    at most this many (a conversation's next turn; ``local_prefill_max_tokens``)."""

    after_reuse: int = 0
    any_tokens: int = 0

    def applies(self, uncached: int, reused_blocks: int) -> bool:
        return uncached <= self.any_tokens or (reused_blocks > 0
                                               and uncached <= self.after_reuse)


NO_LOCAL_PREFILL = LocalPrefill()  # every prompt from a prefill worker


@dataclass(frozen=True)
class Reservation:
    """Decode worker -> router: the blocks reserved for a prompt's KV, in token order.
    The first ``reused`` already hold the KV of the prompt's first blocks (the decode
    worker's own prefix cache): nothing is sent into them. ``local``: the decode worker
    computes the rest of the prompt itself (it held all but a short suffix), so no
    prefill worker takes part and the first token comes on its output stream.
    ``draft_blocks``: the draft model's blocks for the prompt's draft KV (speculative
    decoding with a draft model), which the prefill worker sends too; [] for none."""

    blocks: list[int]
    reused: int = 0
    local: bool = False
    draft_blocks: list[int] = field(default_factory=list)


@dataclass
class PrefillTask:
    """Router -> prefill worker: compute a prompt, push its KV to a decode worker."""

    request_id: str  # router: the attempt's id (unique per attempt)
    prompt_token_ids: list[int]  # router: prompt + tokens already streamed by a failed attempt
    params: SamplingParams  # router
    decode_worker: str  # router: id of the decode worker whose blocks were reserved
    dst_block_ids: list[int]  # decode worker (reserve): its blocks, in token order
    dst_reused: int = 0  # decode worker (reserve): leading blocks it holds already: not sent
    # decode worker (reserve): its draft model's blocks for the prompt's draft KV, all
    # of it (a draft caches no prefix); []: none is sent
    draft_dst_block_ids: list[int] = field(default_factory=list)
    trace: dict[str, str] | None = None  # router: its attempt's trace context (tracing.py)


@dataclass
class FirstToken:
    """Prefill worker -> router (``prefill``'s answer), as soon as the prompt is
    computed and its first token sampled: the router streams it at once, before the
    KV hand-over ends. The same token goes to the decode worker with the KV."""

    request_id: str
    token_id: int | None  # None: max_tokens=0, the prompt scored and nothing handed off
    logprob: TokenLogprob | None  # with params.logprobs
    # The token ends the request by the engine's rules (EOS, a stop token id, the
    # last of max_tokens): the router waits for the decode worker's final delta.
    final: bool
    num_cached_tokens: int  # prompt tokens served by this worker's prefix cache
    prefill_queue_s: float  # received -> first scheduled (prefill worker's clock)
    prefill_s: float  # first scheduled -> first token sampled
    # With params.prompt_logprobs: one entry per prompt token (None for the first).
    prompt_logprobs: list[TokenLogprob | None] | None = None


@dataclass
class PrefillResult:
    """Prefill worker -> router (``handoff``'s answer), once the decode worker
    acknowledged the KV."""

    request_id: str
    kv_transfer_s: float  # last chunk's send started -> acknowledged (not hidden by compute)
    kv_bytes: int


class Stages(NamedTuple):
    """Stage timings a token worker measured (its own clock), sent with the delta
    that carries a request's first token (colocated) or first decode step (decode)."""

    prefill_queue_s: float | None = None  # colocated: received -> first scheduled
    prefill_s: float | None = None  # colocated: first scheduled -> first token
    decode_queue_s: float | None = None  # decode: KV arrived -> first decode step
    num_cached_tokens: int = 0  # colocated: prompt tokens served by the prefix cache


class RequestDelta(NamedTuple):
    """One request's part of one engine step (decode or colocated worker -> router).
    Tokens only: text and stop strings are the router's (``engine/output.py``)."""

    request_id: str
    token_ids: list[int]  # new tokens (usually one)
    logprobs: list[TokenLogprob] | None = None  # one per token when asked for
    finish_reason: str | None = None  # engine: "stop" | "length" | "abort" | "error"
    stop_reason: int | None = None  # the stop token id that ended it (None for EOS)
    failure: FailReason | None = None  # finish_reason == "error": why
    error: str = ""  # finish_reason == "error": detail for the log
    stages: Stages | None = None
    # colocated, with the first delta of a request that asked: see PrefillResult
    prompt_logprobs: list[TokenLogprob | None] | None = None
    # with the last delta of a request that speculated: (draft tokens, accepted)
    spec: tuple[int, int] | None = None


@dataclass(frozen=True)
class WorkerLoad:
    """A worker's load and identity: the routing policies' input and the health
    probe's answer (filled on the worker's loop thread)."""

    worker_id: str
    role: str  # "prefill" | "decode" | "colocated"
    incarnation: str  # new on every start of the worker (Ray restarts included)
    num_running: int
    num_waiting: int  # queued for computation
    num_waiting_for_kv: int  # decode: reserved, KV not arrived
    num_free_blocks: int  # allocatable: free + evictable cached
    num_blocks: int
    queued_prefill_tokens: int  # prompt tokens not yet computed
    # Blocks granted by reserve/admit since the worker started: the router's own count
    # minus this is what it reserved that the snapshot does not show yet.
    blocks_granted: int = 0
    compute: Compute | None = None  # its threads and measured step times (None: not a CPU worker yet)
    # its last published metrics snapshot (the router serves its engine counters under
    # vLLM's names: router/vllm_metrics.py)
    metrics: WorkerMetrics | None = None


@dataclass(frozen=True)
class StepCost:
    """A worker's step times as measured at one thread count (``worker/step_fit.py``):
    ``decode``: (rows, seconds) of steps that only decoded, by batch size; a step of
    prompt tokens takes ``prompt_base_s``, and each token ``token_s + pair_s x`` the
    tokens it attends (inside a decode step, only the latter). ``decode_steps`` /
    ``prefill_steps``: recent steps of each kind measured (decayed counts)."""

    decode: tuple[tuple[float, float], ...]
    prompt_base_s: float
    token_s: float
    pair_s: float
    decode_steps: float = 0.0
    prefill_steps: float = 0.0

    def decode_s(self, rows: float) -> float:
        """A step of ``rows`` decoding sequences (interpolated between the batch sizes
        measured; beyond them, along the last two, or in proportion to one)."""
        pts = self.decode
        if not pts:
            return 0.0
        if len(pts) == 1:
            return pts[0][1] * max(rows, 1.0) / pts[0][0] if rows > pts[0][0] else pts[0][1]
        i = next((i for i in range(1, len(pts) - 1) if rows <= pts[i][0]), len(pts) - 1)
        (r0, s0), (r1, s1) = pts[i - 1], pts[i]
        if rows <= r0 or r1 <= r0:
            return s0 if rows <= r0 else s1
        return max(0.0, s0 + (s1 - s0) * (rows - r0) / (r1 - r0))

    def prefill_s(self, tokens: int, cached: int) -> float:
        """What ``tokens`` prompt tokens after ``cached`` ones add to a step."""
        return tokens * (self.token_s + self.pair_s * (cached + (tokens + 1) / 2))

    def queue_s(self, tokens: int) -> float:
        """A queue of ``tokens`` prompt tokens of other requests (short contexts)."""
        return tokens * self.token_s


@dataclass(frozen=True)
class Compute:
    """A worker's compute: its own and largest thread counts, the node's core-sharing
    group it lends and borrows in (``worker/core_share.py``; None: none), and its step times
    by thread count."""

    own_threads: int
    most_threads: int
    core_group: str | None
    costs: dict[int, StepCost] = field(default_factory=dict)


@dataclass(frozen=True)
class ServingLimits:
    """What the router and every worker must agree on; the worker's own, from its
    engine, sent at join (the router refuses a worker that disagrees)."""

    block_size: int  # tokens per KV block: the router counts blocks and hashes prefixes
    max_model_len: int  # the longest sequence the worker serves (>= the router's limit)
    model: str  # the model it serves (its directory's name: what the router serves as)


@dataclass(frozen=True)
class JoinInfo:
    """What the router needs once per incarnation to put a worker in routing."""

    incarnation: str
    stream: tuple[str, int, str] | None  # token workers: host, port, token of the stream
    kv_endpoint: dict[str, Any] | None  # decode: the receiver's endpoint for P.connect
    metrics: tuple[str, int] | None  # its ``/metrics`` (None in-process)
    limits: ServingLimits


@dataclass
class WorkerMetrics:
    """A worker's observability snapshot (its ``/metrics``; never used for routing)."""

    worker_id: str
    role: str
    num_running: int = 0
    num_waiting: int = 0
    num_free_blocks: int = 0
    num_blocks: int = 0
    queued_prefill_tokens: int = 0
    num_waiting_for_kv: int = 0
    prefix_queries: int = 0
    prefix_hits: int = 0
    num_preemptions: int = 0
    local_prefills: int = 0  # decode: reserved prompts whose suffix it computed itself
    # speculative decoding (engine/spec/spec_decode.py), cumulative: drafts verified, their
    # tokens, and the tokens accepted
    spec_drafts: int = 0
    spec_draft_tokens: int = 0
    spec_accepted_tokens: int = 0
    kv_transfer_bytes: int = 0
    kv_transfer_failures: int = 0
    kv_empty_blocks: int = 0  # blocks with no KV where there must be (sent / arrived)
    kv_transfers: int = 0
    kv_sends: int = 0  # send calls: one per step that completed blocks, plus the last
    kv_transfer_seconds: float = 0.0
    # per transfer (a request's), counts per bucket of KV_XFER_*_BUCKETS plus +Inf
    kv_xfer_seconds_buckets: tuple[int, ...] = (0,) * (len(KV_XFER_SECONDS_BUCKETS) + 1)
    kv_xfer_bytes_buckets: tuple[int, ...] = (0,) * (len(KV_XFER_BYTES_BUCKETS) + 1)
    blocks_in_flight: int = 0  # blocks held for transfers not yet acknowledged
    # core sharing (worker/core_share.py): the last step's threads, steps run on another
    # worker's cores too, seconds waited for its own cores back
    threads: int = 0
    borrowed_steps: int = 0
    core_wait_seconds: float = 0.0
    # Per engine step that ran a batch, cumulative (``observe_step``): the step-time and
    # batch histograms keep one count per bucket of the *_BUCKETS bounds plus +Inf (not
    # cumulative across buckets; the exporter sums them). Tuples, replaced on every step,
    # so a snapshot copied with ``WorkerMetrics(**vars(s))`` never changes under a reader.
    steps: int = 0
    step_seconds: float = 0.0  # forward + sampling time (``StepInfo.seconds``)
    step_seconds_buckets: tuple[int, ...] = (0,) * (len(STEP_SECONDS_BUCKETS) + 1)
    seqs_computed: int = 0  # sum of batch sizes
    batch_size_buckets: tuple[int, ...] = (0,) * (len(BATCH_SIZE_BUCKETS) + 1)
    tokens_computed: int = 0
    batch_tokens_buckets: tuple[int, ...] = (0,) * (len(BATCH_TOKENS_BUCKETS) + 1)
    model_flops: float = 0.0  # model FLOPs of those steps (``engine/cost.py``)
    memory_bytes_read: float = 0.0  # weights + KV bytes read by those steps

    def observe_transfer(self, seconds: float, nbytes: int) -> None:
        """One request's KV sent and acknowledged (``seconds``: its last send to the ack)."""
        self.kv_transfers += 1
        self.kv_transfer_bytes += nbytes
        self.kv_transfer_seconds += seconds
        self.kv_xfer_seconds_buckets = _bump(self.kv_xfer_seconds_buckets,
                                             KV_XFER_SECONDS_BUCKETS, seconds)
        self.kv_xfer_bytes_buckets = _bump(self.kv_xfer_bytes_buckets, KV_XFER_BYTES_BUCKETS,
                                           nbytes)

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


def bucket_samples(bounds: tuple[float, ...], counts: tuple[int, ...]) -> list[tuple[str, float]]:
    """Per-bucket counts -> Prometheus cumulative ``(le, count)`` pairs ending in +Inf."""
    out, total = [], 0
    for le, n in zip((*(repr(float(b)) for b in bounds), "+Inf"), counts, strict=True):
        total += n
        out.append((le, float(total)))
    return out


def _bump(counts: tuple[int, ...], bounds: tuple[float, ...], value: float) -> tuple[int, ...]:
    """``counts`` with the bucket of ``value`` (first bound >= value, else +Inf) plus one."""
    i = bisect_left(bounds, value)
    return (*counts[:i], counts[i] + 1, *counts[i + 1:])
