"""``InputBatch``: the step's model inputs, built from persistent buffers.

Each request that is being computed owns a row of a persistent block table for as
long as it holds blocks; the row is written by deltas (only blocks allocated since
the last step) and given back when the request finishes, is preempted or hands
its KV off. Per step the work is O(sequences + new tokens) in vectorised numpy,
never proportional to a context length or a generation's history.

Buffers (numpy, shared with torch tensors without copies)::

    block_table [max_num_seqs, max_blocks]  int32   row r = blocks of one request
    tokens / positions / slots [max_tokens]  int64   this step's new tokens, in order:
                                                     decodes first, then prefill chunks
    per-sequence [max_num_seqs]              int32   row, query start/len, context len

On a GPU the buffers are pinned host memory and each step's slices go to the device
with non-blocking copies (one per tensor, none per layer).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from pdserve.engine.config import ceil_div
from pdserve.engine.model.attention import AttentionMetadata
from pdserve.engine.request import Request


@dataclass
class StepInputs:
    """What ``InputBatch.prepare`` produced for one step."""

    input_ids: torch.Tensor  # [T] int64
    meta: AttentionMetadata
    # Rows the model computes logits for: first 1 + len(draft) per request that
    # samples (its last token, then each draft token), then the prompt positions of
    # requests that asked for prompt logprobs.
    logits_indices: torch.Tensor  # [R + P] int64 token indices
    sampled: list[Request]  # the requests of the first R rows, in order
    drafts: list[list[int]]  # per sampled request: the draft tokens it verifies
    # (request, target tokens) per prompt-logprob request, in row order: row j of
    # its part predicts target j.
    prompt_targets: list[tuple[Request, list[int]]]


def _host(shape: tuple[int, ...], dtype: torch.dtype, pinned: bool) -> np.ndarray:
    """A zeroed host buffer as numpy, backed by pinned memory when asked."""
    return torch.zeros(shape, dtype=dtype, pin_memory=pinned).numpy()


class InputBatch:
    def __init__(self, max_num_seqs: int, max_model_len: int, max_num_tokens: int,
                 block_size: int, device: str = "cpu") -> None:
        self.block_size = block_size
        self.device = torch.device(device)
        pinned = self.device.type == "cuda"
        self.max_blocks = ceil_div(max_model_len, block_size)
        self.block_table_np = _host((max_num_seqs, self.max_blocks), torch.int32, pinned)
        self.block_table = torch.from_numpy(self.block_table_np)
        self._free_rows = list(range(max_num_seqs - 1, -1, -1))
        self._rows: dict[str, int] = {}  # request id -> row
        self._written: dict[str, int] = {}  # request id -> blocks written into its row
        n = max_num_tokens
        self._tokens = _host((n,), torch.int64, pinned)
        self._positions = _host((n,), torch.int64, pinned)
        self._slots = _host((n,), torch.int64, pinned)
        self._arange = np.arange(n, dtype=np.int64)
        self._seq = _host((4, max_num_seqs), torch.int32, pinned)  # row, q start, q len, ctx
        # GPU: the last step's copies must be done before its buffers are rewritten.
        self._copied: torch.cuda.Event | None = None

    # ------------------------------------------------------------------ rows
    def release(self, req: Request) -> None:
        """The request gave its blocks back (finished, preempted, handed off)."""
        row = self._rows.pop(req.request_id, None)
        if row is not None:
            self._written.pop(req.request_id)
            self._free_rows.append(row)

    def _row(self, req: Request) -> int:
        rid = req.request_id
        row = self._rows.get(rid)
        if row is None:
            row = self._rows[rid] = self._free_rows.pop()
            self._written[rid] = 0
        done, have = self._written[rid], len(req.block_ids)
        if have < done:  # blocks given back (a rejected draft's): rewrite from there
            self._written[rid] = done = have
        if have > done:  # blocks allocated since the last step
            self.block_table_np[row, done:have] = req.block_ids[done:have]
            self._written[rid] = have
        return row

    def _to_device(self, a: np.ndarray) -> torch.Tensor:
        """A buffer slice as a tensor on the engine's device (no copy on the CPU)."""
        t = torch.from_numpy(a)
        return t if self.device.type == "cpu" else t.to(self.device, non_blocking=True)

    # ------------------------------------------------------------------ step
    def prepare(self, work: list[tuple[Request, int]]) -> StepInputs:
        """Inputs for computing ``n`` new tokens of each ``(request, n)``; single
        tokens first so that decodes lead the batch. ``n`` past the request's own new
        tokens are its draft (``spec_token_ids``), verified after them."""
        work = sorted(work, key=lambda rn: rn[1] != 1)
        if self._copied is not None:
            self._copied.synchronize()
        s_count = len(work)
        seq = self._seq[:, :s_count]
        tokens: list[int] = []
        sampled: list[Request] = []
        drafts: list[list[int]] = []
        logits_rows: list[int] = []
        prompt_rows: list[int] = []
        prompt_targets: list[tuple[Request, list[int]]] = []
        num_decode = 0
        t = 0
        for i, (req, n) in enumerate(work):
            start = req.num_computed_tokens
            end = start + n
            k = max(0, n - req.num_new_tokens)  # draft tokens
            seq[0, i] = self._row(req)
            seq[1, i] = t
            seq[2, i] = n
            seq[3, i] = end
            if n == 1:
                tokens.append(req.token_ids[start])
                num_decode += 1
            else:
                tokens.extend(req.token_ids[start : end - k])
                tokens.extend(req.spec_token_ids[:k])
            if req.params.prompt_logprobs is not None:
                # positions p predict token p + 1; each prompt position is recorded once
                lo = max(start, len(req.prompt_logprobs))
                hi = min(end, req.num_prompt_tokens - 1)
                if hi > lo:
                    prompt_rows.extend(range(t + lo - start, t + hi - start))
                    prompt_targets.append((req, req.token_ids[lo + 1 : hi + 1]))
            t += n
            if end - k == req.num_tokens and req.params.max_tokens > 0:
                # caught up: this row samples the next token (and each draft token's)
                logits_rows.extend(range(t - 1 - k, t))
                sampled.append(req)
                drafts.append(req.spec_token_ids[:k])
        self._tokens[:t] = tokens
        # position of token j of sequence s = ctx_s - len_s + (j - start_s)
        qlen = seq[2].astype(np.int64)
        offset = np.repeat(seq[3] - seq[2] - seq[1], qlen)
        positions = self._positions[:t]
        np.add(self._arange[:t], offset, out=positions)
        rows = np.repeat(seq[0], qlen)
        bs = self.block_size
        blocks = self.block_table_np[rows, positions // bs]
        np.add(blocks.astype(np.int64) * bs, positions % bs, out=self._slots[:t])
        dev = self._to_device
        meta = AttentionMetadata(
            positions=dev(positions),
            slot_mapping=dev(self._slots[:t]),
            block_table=dev(self.block_table_np),
            seq_rows=dev(seq[0]),
            query_start=dev(seq[1]),
            query_len=dev(seq[2]),
            context_len=dev(seq[3]),
            num_decode=num_decode,
            seq_rows_list=seq[0].tolist(),
            query_start_list=seq[1].tolist(),
            query_len_list=seq[2].tolist(),
            context_len_list=seq[3].tolist(),
        )
        input_ids = dev(self._tokens[:t])
        if self.device.type == "cuda":
            self._copied = torch.cuda.Event()
            self._copied.record()
        return StepInputs(
            input_ids=input_ids,
            meta=meta,
            logits_indices=torch.tensor(logits_rows + prompt_rows, dtype=torch.long,
                                        device=self.device),
            sampled=sampled,
            drafts=drafts,
            prompt_targets=prompt_targets,
        )
