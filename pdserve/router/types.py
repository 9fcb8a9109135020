"""What crosses the router's front boundary: the request the API layers (gRPC,
HTTP) hand to ``Router.generate``, the chunks it streams back, its errors, and
the per-request stage timings that feed the Prometheus histograms.

No torch, no Ray here: API layers import this module only.
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass, field
from typing import Any

from pdserve.engine.sampling.sampling_params import MAX_BAD_WORD_TEXTS, SamplingParams
from pdserve.messages import TokenLogprob  # the one logprobs shape, worker to API

__all__ = ["ErrorKind", "FinalChunk", "GenerateRequest", "ModelInfo", "RouterError",
           "StageTimings", "StreamChunk", "TokenLogprob", "Usage"]


@dataclass
class GenerateRequest:
    """Filled by an API layer from the client's message."""

    request_id: str  # client's id (X-Request-Id / proto field) or one the API layer made
    params: SamplingParams
    prompt: str | None = None  # plain completion text ...
    messages: list[dict[str, Any]] | None = None  # ... or chat messages (chat template) ...
    prompt_token_ids: list[int] | None = None  # ... or pre-tokenized ids; exactly one is set
    timeout_s: float | None = None  # deadline from arrival; None = the router's default
    # OpenAI tool objects, for a chat template that renders them itself (else the API
    # layer wrote them into the messages)
    tools: list[dict[str, Any]] | None = None
    # How the chat template renders ``messages`` beyond them (vLLM's chat extras):
    # ``Tokenizer.apply_chat_template``'s keywords
    chat_template_args: dict[str, Any] = field(default_factory=dict)
    # Another request with this prompt ran first (a choice of n > 1): prefill where its
    # prompt is cached, whatever the routing policy (``policies.RouteInput``).
    share_prefix: bool = False
    # The client's predicted output (text): tokenized into ``params.prediction``.
    prediction: str | None = None
    # Words the output must not write: tokenized into ``params.bad_words``.
    bad_words: tuple[str, ...] = ()
    # Keep the prompt's last N tokens (-1: as many as leave room for max_tokens).
    truncate_prompt_tokens: int | None = None
    # The client's W3C trace context (traceparent, tracestate): its trace continues
    # through the router and the workers when tracing is on (pdserve/tracing.py)
    trace: dict[str, str] | None = None

    def problem(self) -> tuple[str, str] | None:
        """The first field the router's own rules refuse, and why; None when all hold.
        The one copy of these rules: ``Router.generate`` asks every request, whichever
        front end made it (the HTTP models' pydantic bounds say the same for the schema;
        sampling fields are ``SamplingParams``' own)."""
        t = self.timeout_s
        if t is not None and not (math.isfinite(t) and t > 0):
            return "timeout_s", f"timeout_s must be > 0 and finite, got {t}"
        n = self.truncate_prompt_tokens
        if n is not None and not (n == -1 or n >= 1):
            return "truncate_prompt_tokens", f"truncate_prompt_tokens must be -1 or >= 1, got {n}"
        if len(self.bad_words) > MAX_BAD_WORD_TEXTS or not all(self.bad_words):
            return "bad_words", (f"bad_words must hold at most {MAX_BAD_WORD_TEXTS} words, "
                                 f"none empty")
        return None


@dataclass
class StreamChunk:
    """New tokens of one request (one or more per decode step)."""

    token_ids: list[int]
    text: str  # text delta, safe to show (never half a UTF-8 char or stop string)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    # On a request's first chunk (or its final one when it generated nothing), when it
    # asked for prompt logprobs: one per prompt token, None for the first.
    prompt_logprobs: list[TokenLogprob | None] | None = None
    prompt_tokens: int = 0  # the prompt's length (Usage.prompt_tokens), on every chunk


@dataclass
class Usage:
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int = 0  # prompt tokens served from the prefill worker's prefix cache
    # With a prediction: its drafted tokens the model accepted / rejected (None: none given)
    prediction_tokens: tuple[int, int] | None = None


@dataclass
class StageTimings:
    """Seconds spent in each stage; each measured on one process's clock.
    ``None`` where the stage did not happen (e.g. a request rejected in queue)."""

    router_queue: float | None = None  # router: arrival -> dispatched to a P/D pair
    prefill_queue: float | None = None  # prefill worker: received -> first scheduled
    prefill: float | None = None  # prefill worker: first scheduled -> first token sampled
    kv_transfer: float | None = None  # prefill worker: send started -> acknowledged
    kv_bytes: int | None = None  # prefill worker: KV bytes it sent (the last attempt's)
    decode_queue: float | None = None  # decode worker: KV arrived -> first decode step
    # where the prompt was computed ("remote": a prefill worker, "local": the decode
    # worker, "colocated") and why (router/placement.py), for the last attempt
    placement: str | None = None
    placement_reason: str | None = None
    worker: str | None = None  # the worker that streamed its tokens (the last attempt's)
    ttft: float | None = None  # router: arrival -> first token received
    e2e: float | None = None  # router: arrival -> finished
    # router: gaps between deliveries of tokens (one delivery may carry several: the
    # accepted tokens of a speculative step)
    inter_token: list[float] = field(default_factory=list)
    tokens_after_first: int = 0  # router: output tokens after the first
    # token worker: speculative decoding's draft tokens verified / accepted (all attempts)
    spec_draft_tokens: int = 0
    spec_accepted_tokens: int = 0

    @property
    def tpot(self) -> float | None:
        """Mean time per output token after the first (first token -> last, divided by
        the tokens after the first, as vLLM defines it)."""
        if not self.inter_token or not self.tokens_after_first:
            return None
        return sum(self.inter_token) / self.tokens_after_first


@dataclass
class FinalChunk:
    """Last message of a stream."""

    finish_reason: str  # "stop" | "length" | "abort" | "error"
    usage: Usage
    stop_reason: str | int | None = None  # matched stop string / stop token id
    timings: StageTimings = field(default_factory=StageTimings)
    num_retries: int = 0  # times the request moved to another P/D pair after a failure
    prompt_logprobs: list[TokenLogprob | None] | None = None  # see StreamChunk


class ErrorKind(enum.Enum):
    """Maps to an HTTP status and a gRPC status code in the API layers."""

    INVALID = "invalid_request"  # 400 / INVALID_ARGUMENT
    NOT_FOUND = "not_found"  # 404 / NOT_FOUND (unknown model)
    OVERLOADED = "overloaded"  # 429 / RESOURCE_EXHAUSTED
    NOT_READY = "not_ready"  # 503 / UNAVAILABLE
    DEADLINE = "deadline_exceeded"  # 504 / DEADLINE_EXCEEDED
    INTERNAL = "internal"  # 500 / INTERNAL (worker failures after retries)


class RouterError(Exception):
    """Raised by ``Router.generate`` before or during a stream."""

    def __init__(self, kind: ErrorKind, message: str, retry_after_s: float | None = None,
                 param: str | None = None):
        super().__init__(message)
        self.kind = kind
        self.message = message
        self.retry_after_s = retry_after_s  # OVERLOADED, shutting down: hint for Retry-After
        # INVALID: the request's field at fault (``request_problem``'s: prompt, max_tokens, ...)
        self.param = param


@dataclass
class ModelInfo:
    id: str  # the name clients pass as "model"
    max_model_len: int
    owned_by: str = "pdserve"
