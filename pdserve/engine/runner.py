"""Turns a ``ScheduledBatch`` into tensors, runs the model on the KV cache and
samples the requests that caught up with their tokens this step."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pdserve.engine.attention import AttentionBackend, AttentionMetadata, PrefillChunk
from pdserve.engine.config import ceil_div
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
    def __init__(self, model: LlamaModel, kv_cache: torch.Tensor, attn: AttentionBackend,
                 block_size: int, eos_token_ids: frozenset[int]) -> None:
        self.model = model
        self.kv_cache = kv_cache
        self.attn = attn
        self.block_size = block_size
        self.device = kv_cache.device
        self.sampler = Sampler()
        self.eos_token_ids = eos_token_ids

    def execute(self, batch: ScheduledBatch) -> list[Sampled]:
        # Single-token work (decodes, and 1-token prefill tails) first: it runs as one
        # padded attention batch. Longer chunks follow, each attended on its own.
        work = sorted(batch.work, key=lambda rn: rn[1] != 1)
        bs = self.block_size
        ids: list[int] = []
        positions: list[int] = []
        slot_blocks: list[int] = []
        slot_offsets: list[int] = []
        logits_rows: list[int] = []
        sampled_reqs: list[Request] = []
        decode_tables: list[list[int]] = []
        decode_lens: list[int] = []
        prefills: list[PrefillChunk] = []
        for req, n in work:
            start = req.num_computed_tokens
            end = start + n
            qstart = len(ids)
            ids.extend(req.token_ids[start:end])
            positions.extend(range(start, end))
            for p in range(start, end):
                slot_blocks.append(req.block_ids[p // bs])
                slot_offsets.append(p % bs)
            nblocks = ceil_div(end, bs)
            if n == 1:
                decode_tables.append(req.block_ids[:nblocks])
                decode_lens.append(end)
            else:
                prefills.append(PrefillChunk(
                    qstart, n, end,
                    torch.tensor(req.block_ids[:nblocks], dtype=torch.long, device=self.device),
                ))
            if end == req.num_tokens:  # caught up: sample the next token
                logits_rows.append(len(ids) - 1)
                sampled_reqs.append(req)

        meta = AttentionMetadata(
            slot_blocks=self._long(slot_blocks),
            slot_offsets=self._long(slot_offsets),
            num_decode=len(decode_tables),
            decode_block_table=None,
            decode_mask=None,
            prefills=prefills,
        )
        if decode_tables:
            width = max(len(t) for t in decode_tables)
            meta.decode_block_table = self._long([t + [0] * (width - len(t)) for t in decode_tables])
            lens = self._long(decode_lens)
            cols = torch.arange(width * bs, device=self.device)
            meta.decode_mask = (cols.unsqueeze(0) < lens.unsqueeze(1))[:, None, None, :]

        logits = self.model(self._long(ids), self._long(positions), self.kv_cache, meta,
                            self.attn, self._long(logits_rows))
        if not sampled_reqs:
            return []
        rows = [
            SamplingRow(
                params=r.params,
                prompt_token_ids=r.prompt_token_ids,
                output_token_ids=r.output_token_ids,
                generator=r.generator,
                eos_token_ids=self.eos_token_ids,
            )
            for r in sampled_reqs
        ]
        out = self.sampler(logits, rows)
        return [
            Sampled(r, t, lp) for r, t, lp in zip(sampled_reqs, out.token_ids, out.logprobs,
                                                   strict=True)
        ]

    def _long(self, values: list[int] | list[list[int]]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.long, device=self.device)
