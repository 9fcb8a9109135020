"""One request's state inside an engine: tokens, progress, blocks and status.

Token regions of a request (``token_ids`` = prompt + output)::

    |<------------- num_tokens ------------->|
    | prompt ............ | output ......... |
    |<-- num_computed_tokens -->|            |   KV for these is in ``block_ids``
    |<- num_cached ->|                           (prefix hits, never recomputed)

The scheduler's one rule: each step, computed tokens catch up with total tokens.
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from pdserve.engine.sampling.sampling_params import SamplingParams

if TYPE_CHECKING:
    from llguidance import LLMatcher

    from pdserve.engine.sampling.logprobs import TokenLogprob
    from pdserve.engine.spec.spec_decode import SpecState


class RequestStatus(enum.Enum):
    WAITING = "waiting"  # queued for computation (new, or preempted for recompute)
    WAITING_FOR_KV = "waiting_for_kv"  # decode role: blocks reserved, KV written from outside
    RUNNING = "running"  # scheduled every step until it finishes
    PREFILLED = "prefilled"  # prefill role: first token sampled, KV held for hand-off
    FINISHED = "finished"  # done; blocks released

    @property
    def is_finished(self) -> bool:
        return self in (RequestStatus.PREFILLED, RequestStatus.FINISHED)


@dataclass
class Request:
    request_id: str  # caller
    prompt_token_ids: list[int]  # caller (tokenized prompt)
    params: SamplingParams  # caller
    arrival_time: float = field(default_factory=time.monotonic)  # engine, at add
    token_ids: list[int] = field(default_factory=list)  # engine: prompt + output
    num_computed_tokens: int = 0  # scheduler: tokens whose KV is in the cache
    num_cached_tokens: int = 0  # scheduler: prompt tokens served by prefix hits
    block_ids: list[int] = field(default_factory=list)  # scheduler
    block_hashes: list[int] = field(default_factory=list)  # scheduler: chained, full blocks
    num_registered_blocks: int = 0  # scheduler: leading blocks published to the prefix cache
    status: RequestStatus = RequestStatus.WAITING  # scheduler
    finish_reason: str | None = None  # engine: "stop" | "length" | "abort"
    num_preemptions: int = 0  # scheduler
    generator: torch.Generator | None = None  # engine, from params.seed
    # engine: the structured-output grammar's state, advanced by every token appended
    # (None without a constraint, and on tensor-parallel followers: rank 0 samples)
    grammar: LLMatcher | None = None
    first_scheduled_time: float | None = None  # scheduler (queue time ends)
    first_token_time: float | None = None  # engine
    # runner: logprobs of prompt tokens 1.. as their positions are computed (kept
    # through preemption: recomputed positions are not recorded twice)
    prompt_logprobs: list[TokenLogprob] = field(default_factory=list)
    # engine: speculative decoding's proposer and draft length (None: not speculating)
    spec: SpecState | None = None
    # engine -> scheduler: this step's draft, computed after the request's next token
    # when the scheduler makes room for it (it may shorten or drop it)
    spec_token_ids: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        if not self.token_ids:
            self.token_ids = list(self.prompt_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - len(self.prompt_token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[len(self.prompt_token_ids) :]

    @property
    def num_new_tokens(self) -> int:
        """Tokens still to compute before the next sample."""
        return self.num_tokens - self.num_computed_tokens

    @property
    def is_finished(self) -> bool:
        return self.status.is_finished
