"""What the engine hands out: ``RequestOutput`` (one request's share of a step),
``StepOutput`` and ``StepInfo`` (a step's outputs and shape), ``EngineStats`` (a
snapshot for routing and metrics) and ``Completion`` (a whole request's result, as
``LLMEngine.generate`` returns it). Plain data: the workers, the metrics and the cost
model read these without importing the engine."""

from __future__ import annotations

from dataclasses import dataclass, field

from pdserve.engine.output import OutputProcessor
from pdserve.engine.sampling.logprobs import TokenLogprob
from pdserve.engine.sampling.stop import StopDecision
from pdserve.engine.spec.spec_decode import SpecStats


@dataclass
class RequestOutput:
    """What one step produced for one request (filled by the engine)."""

    request_id: str
    new_token_ids: list[int]  # tokens of this step (0, 1, or more with speculation)
    finished: bool
    finish_reason: str | None  # "stop" | "length" | "abort" | None
    num_prompt_tokens: int
    num_cached_tokens: int  # prompt tokens served by the prefix cache
    num_output_tokens: int
    logprobs: list[TokenLogprob] = field(default_factory=list)
    stop_reason: int | None = None  # the stop token id that ended it (None for EOS)
    prefilled: bool = False  # prefill role: KV held for hand-off
    first_scheduled_time: float | None = None  # monotonic; ends the request's queue time
    # With the request's first output when it asked for prompt logprobs: one entry per
    # prompt token, None for the first (nothing predicts it).
    prompt_logprobs: list[TokenLogprob | None] | None = None
    # speculative decoding: (draft tokens verified, accepted) so far (None: not speculating)
    spec: tuple[int, int] | None = None


@dataclass
class StepOutput:
    """What ``step`` returns: the requests that changed and the step's shape."""

    outputs: list[RequestOutput]
    info: StepInfo | None  # None when nothing was scheduled


@dataclass
class Completion:
    """A whole request's result, accumulated from its ``RequestOutput``s."""

    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: str | None = None
    prompt_tokens: int = 0
    cached_tokens: int = 0
    logprobs: list[TokenLogprob] = field(default_factory=list)
    prompt_logprobs: list[TokenLogprob | None] | None = None

    def add(self, out: RequestOutput, processor: OutputProcessor) -> bool:
        """Add one step's output; True once the request is over."""
        if self.finish_reason is not None:
            return True
        if out.prompt_logprobs is not None:
            self.prompt_logprobs = out.prompt_logprobs
        engine = (StopDecision(out.finish_reason, out.stop_reason)  # type: ignore[arg-type]
                  if out.finished and out.finish_reason in ("stop", "length") else None)
        text, decision, n = processor.push(out.new_token_ids, engine)
        self.token_ids.extend(out.new_token_ids[:n])
        self.text += text
        self.logprobs.extend(out.logprobs[:n])
        self.cached_tokens = out.num_cached_tokens
        if decision is not None:
            self.finish_reason = decision.finish_reason
        elif out.finished:
            self.text += processor.flush()
            self.finish_reason = out.finish_reason
        return self.finish_reason is not None


@dataclass(frozen=True)
class EngineStats:
    """A snapshot for routing policies and worker metrics."""

    num_running: int
    num_waiting: int
    num_waiting_for_kv: int
    num_blocks: int
    num_free_blocks: int  # allocatable: free + evictable cached
    num_cached_blocks: int
    queued_prefill_tokens: int  # prompt tokens not yet computed
    prefix_queries: int  # cumulative, in blocks
    prefix_hits: int  # cumulative, in blocks
    num_preemptions: int  # cumulative
    spec: SpecStats | None = None  # cumulative speculation counters (None: not speculating)


@dataclass(frozen=True)
class StepInfo:
    """Shape and duration of one engine step (for batch-size, step-time, MFU and
    MBU metrics: FLOPs ~ 2 x params x num_tokens + attention over context_tokens;
    bytes ~ weights + KV of context_tokens)."""

    num_seqs: int  # sequences in the batch
    num_tokens: int  # tokens computed (prefill chunks + one per decode)
    num_decode: int  # sequences computing exactly one token
    context_tokens: int  # sum over sequences of the tokens attended (cached + new)
    seconds: float  # wall time of the forward pass + sampling
    num_draft_tokens: int = 0  # speculative draft tokens verified (each a logits row too)
    # what the prompt chunks' new tokens attend, summed (a chunk of n after c computed
    # tokens: n·c + n(n+1)/2); None where unknown (step-time models then estimate it)
    prompt_pairs: float | None = None
