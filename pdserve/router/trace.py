"""The router's spans of one request (``pdserve/tracing.py``): ``llm_request`` (the
client's trace continued, or a new one), ``queue`` and one ``attempt`` per attempt,
whose context goes to the workers with the attempt (``carrier``). With tracing off
every method does nothing."""

from __future__ import annotations

from typing import Any

from pdserve.engine.sampling.sampling_params import SamplingParams
from pdserve.router.types import FinalChunk
from pdserve.tracing import Carrier, Tracing, now_ns


class RequestTrace:
    def __init__(self, tracing: Tracing | None, client: Carrier | None, request_id: str,
                 model: str, params: SamplingParams, prompt_tokens: int) -> None:
        self._tracing = tracing
        self._arrival_ns = now_ns()
        self._attempt: Any = None
        self._queued = False
        self._span: Any = None
        if tracing is not None:
            self._span = tracing.start("llm_request", client, {
                "gen_ai.request.id": request_id, "gen_ai.response.model": model,
                "gen_ai.request.max_tokens": params.max_tokens,
                "gen_ai.request.temperature": params.temperature,
                "gen_ai.request.top_p": params.top_p,
                "gen_ai.usage.prompt_tokens": prompt_tokens,
            }, self._arrival_ns, kind="server")
            if not self._span.is_recording():  # not sampled: nothing below records either
                self._tracing, self._span = None, None

    def attempt(self, number: int) -> Carrier | None:
        """An attempt begins: its span; the context its workers' spans join."""
        if self._tracing is None:
            return None
        self.attempt_ended()
        self._attempt = self._tracing.start("attempt", self._span, {"pdserve.attempt": number})
        return self._tracing.carrier(self._attempt)

    def admitted(self, attributes: dict[str, Any]) -> None:
        """The attempt found its workers (the first one ends ``queue``)."""
        if self._tracing is None or self._attempt is None:
            return
        if not self._queued:
            self._queued = True
            self._tracing.start("queue", self._span, {}, self._arrival_ns).end()
        self._attempt.set_attributes({k: v for k, v in attributes.items() if v is not None})

    def attempt_ended(self, failure: str | None = None, message: str = "") -> None:
        if self._attempt is None:
            return
        if failure is not None:
            self._attempt.set_attribute("pdserve.failure", failure)
            self._attempt.add_event("attempt failed", {"reason": failure, "message": message})
        self._attempt.end()
        self._attempt = None

    def finished(self, final: FinalChunk | None, error: str | None = None) -> None:
        """The request ended (``final``), or failed with ``error``."""
        if self._span is None:
            return
        self.attempt_ended()
        span, t = self._span, None if final is None else final.timings
        if final is not None and t is not None:
            span.set_attributes({
                k: v for k, v in {
                    "gen_ai.usage.completion_tokens": final.usage.completion_tokens,
                    "gen_ai.latency.time_in_queue": t.router_queue,
                    "gen_ai.latency.time_to_first_token": t.ttft,
                    "gen_ai.latency.e2e": t.e2e,
                    "gen_ai.latency.time_in_model_prefill": t.prefill,
                    "pdserve.kv_transfer_seconds": t.kv_transfer,
                    "pdserve.placement": t.placement,
                    "pdserve.placement_reason": t.placement_reason,
                    "pdserve.retries": final.num_retries,
                    "pdserve.finish_reason": final.finish_reason,
                }.items() if v is not None})
        if error is not None:
            from opentelemetry.trace import Status, StatusCode

            span.set_status(Status(StatusCode.ERROR, error))
        span.end()
        self._span = None
