"""Runs one ``ScheduledBatch``: step inputs from the persistent ``InputBatch``,
the model on the KV cache, and the sampler for the requests that caught up with
their tokens this step."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pdserve.engine.input_batch import InputBatch
from pdserve.engine.model import LlamaModel
from pdserve.engine.request import Request
from pdserve.engine.sampler import Sampler, SamplingRow, TokenLogprobs
from pdserve.engine.scheduler import ScheduledBatch


@dataclass
class Sampled:
    request: Request
    token_id: int
    logprobs: TokenLogprobs | None


class ModelRunner:
    def __init__(self, model: LlamaModel, kv_cache: torch.Tensor, inputs: InputBatch,
                 eos_token_ids: frozenset[int]) -> None:
        self.model = model
        self.kv_cache = kv_cache
        self.inputs = inputs
        self.sampler = Sampler()
        self.eos_token_ids = eos_token_ids

    def execute(self, batch: ScheduledBatch) -> list[Sampled]:
        step = self.inputs.prepare(batch.work)
        logits = self.model(step.input_ids, self.kv_cache, step.meta, step.logits_indices)
        if not step.sampled:
            return []
        rows = [SamplingRow(r.params, r.token_ids, r.num_prompt_tokens, r.generator,
                            self.eos_token_ids) for r in step.sampled]
        out = self.sampler(logits, rows)
        return [Sampled(r, t, lp) for r, t, lp in zip(step.sampled, out.token_ids, out.logprobs,
                                                      strict=True)]
