"""Attention over the paged KV cache, behind a backend switch.

The runner builds one ``AttentionMetadata`` per step; every layer reuses it. The
batch's tokens are ordered decodes first, then prefill chunks::

    tokens: | d0 | d1 | ... | d(B-1) | p0 chunk ......... | p1 chunk .... |
             one token per decode seq  n0 new tokens        n1 new tokens

KV cache of one layer (a view of the worker's block-major cache)::

    kv_layer[block, 0 = K | 1 = V, slot in block, kv head, head dim]

``torch`` is the reference backend (plain torch, runs on CPU). A CUDA kernel
(FlashAttention / FlashInfer) is added by registering another ``AttentionBackend``
under a new name; the scheduler and model do not change.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch
import torch.nn.functional as F


@dataclass
class PrefillChunk:
    query_start: int  # index of the chunk's first token in the batch
    num_new: int  # tokens computed now
    context_len: int  # tokens in the cache after this step (prefix + chunk)
    block_ids: torch.Tensor  # [ceil(context_len / block_size)] long


@dataclass
class AttentionMetadata:
    """Filled by the runner once per step."""

    slot_blocks: torch.Tensor  # [T] block id receiving each new token's K/V
    slot_offsets: torch.Tensor  # [T] slot inside that block
    num_decode: int  # decode tokens (= decode sequences) at the front of the batch
    decode_block_table: torch.Tensor | None  # [B, max_blocks] long, padded with 0
    decode_mask: torch.Tensor | None  # [B, 1, 1, max_blocks * block_size] bool, True = attend
    prefills: list[PrefillChunk]


class AttentionBackend(Protocol):
    def __call__(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
        kv_layer: torch.Tensor, meta: AttentionMetadata,
    ) -> torch.Tensor:
        """q [T, H, D], k/v [T, KVH, D] for the new tokens; stores k/v into the
        cache and returns the attention output [T, H, D]."""
        ...


def write_kv(kv_layer: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
             meta: AttentionMetadata) -> None:
    kv_layer[meta.slot_blocks, 0, meta.slot_offsets] = k
    kv_layer[meta.slot_blocks, 1, meta.slot_offsets] = v


def _gather(kv_layer: torch.Tensor, block_ids: torch.Tensor, which: int) -> torch.Tensor:
    """Cache rows of ``block_ids`` as one sequence: [..., n_blocks * block_size, KVH, D]."""
    g = kv_layer[block_ids, which]  # [..., nb, bs, KVH, D]
    return g.flatten(-4, -3)


class TorchAttention:
    """Reference backend: SDPA on gathered cache rows. Decodes run as one padded
    batch with a length mask; each prefill chunk runs causally on its own."""

    def __init__(self, scale: float) -> None:
        self.scale = scale

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 kv_layer: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        write_kv(kv_layer, k, v, meta)
        out = torch.empty_like(q)
        nd = meta.num_decode
        if nd:
            assert meta.decode_block_table is not None and meta.decode_mask is not None
            kc = _gather(kv_layer, meta.decode_block_table, 0).transpose(1, 2)  # [B,KVH,L,D]
            vc = _gather(kv_layer, meta.decode_block_table, 1).transpose(1, 2)
            o = F.scaled_dot_product_attention(
                q[:nd].unsqueeze(2), kc, vc, attn_mask=meta.decode_mask,
                scale=self.scale, enable_gqa=True,
            )  # [B, H, 1, D]
            out[:nd] = o.squeeze(2)
        for c in meta.prefills:
            s, n = c.query_start, c.num_new
            qc = q[s : s + n].transpose(0, 1).unsqueeze(0)  # [1, H, n, D]
            if c.context_len == n:  # no cached prefix: attend to the fresh K/V
                kc = k[s : s + n].transpose(0, 1).unsqueeze(0)
                vc = v[s : s + n].transpose(0, 1).unsqueeze(0)
                o = F.scaled_dot_product_attention(
                    qc, kc, vc, is_causal=True, scale=self.scale, enable_gqa=True)
            else:  # prefix in the cache: query i sits at position context_len - n + i
                kc = _gather(kv_layer, c.block_ids, 0)[: c.context_len]
                vc = _gather(kv_layer, c.block_ids, 1)[: c.context_len]
                qpos = torch.arange(c.context_len - n, c.context_len, device=q.device).unsqueeze(1)
                mask = torch.arange(c.context_len, device=q.device).unsqueeze(0) <= qpos  # [n, ctx]
                o = F.scaled_dot_product_attention(
                    qc, kc.transpose(0, 1).unsqueeze(0), vc.transpose(0, 1).unsqueeze(0),
                    attn_mask=mask, scale=self.scale, enable_gqa=True,
                )
            out[s : s + n] = o.squeeze(0).transpose(0, 1)
        return out


ATTENTION_BACKENDS = {"torch": TorchAttention}


def make_attention(name: str, scale: float) -> AttentionBackend:
    try:
        cls = ATTENTION_BACKENDS[name]
    except KeyError:
        raise ValueError(
            f"unknown attention backend {name!r}; available: {sorted(ATTENTION_BACKENDS)}"
        ) from None
    return cls(scale)
