"""Attention over the paged KV cache, behind a backend switch.

The runner builds one ``AttentionMetadata`` per step (from ``InputBatch``'s
persistent buffers); every layer reuses it. A step's tokens are ordered by
sequence, decodes first, then prefill chunks::

    tokens: | d0 | d1 | ... | d(B-1) | p0 chunk ......... | p1 chunk .... |
             one token per decode seq  n0 new tokens        n1 new tokens

Sequence s owns tokens ``query_start[s] : query_start[s] + query_len[s]``, at
positions ``context_len[s] - query_len[s] ..  context_len[s] - 1``; its blocks are
row ``seq_rows[s]`` of ``block_table``.

KV cache (the worker's one block-major tensor)::

    kv_cache[block, layer, 0 = K | 1 = V, kv head, slot in block, row]

(a row: head_dim values, or in an int8 cache head_dim int8 values and their float32
scale -- kv_cache.py),

(heads outside slots, "HND": a range of KV heads of one block-layer is contiguous,
so a tensor-parallel hand-off moves it as one region).

A backend takes the layer's fused ``qkv`` projection, applies the rotary embedding
to q and k, stores k and v into the step's slots (``slot_mapping``: block * block
size + offset), and returns the attention output ``[T, H * D]``.

Backends:

* ``torch`` -- the reference: plain torch ops (SDPA on gathered cache rows). Slow,
  obviously right, runs on any device; the oracle the other backends are tested
  against.
* ``cpu-FAMILY`` -- pdserve's C++ kernels (``csrc/attention*.cpp``,
  ``csrc/pointwise.cpp``): one fused rotary + cache-write op, then paged attention
  that reads K/V in place through the block table, for decodes and prefill chunks
  with a cached prefix alike, in one of three kernel families
  (``kernels.DENSE_FAMILIES``):

  - ``avx2``: float32 FMA; a bfloat16 or int8 cache is widened as it is read. Every
    cache dtype, every x86-64 CPU the kernels run on.
  - ``avx512bf16`` and ``amx``: both products as bfloat16 dot products, for a
    bfloat16 cache (``vdpbf16ps``; the tile unit's ``tdpbf16ps``): q is rounded to
    bfloat16, and so is each softmax chunk's P; scores, sums and the softmax stay
    float32. Where the dense GEMM's family of the same name runs.

  In every family a token's output bits depend on its query, its position and the
  cache only (not on the step, the tile or the other sequences); the families agree
  with each other to bfloat16 rounding, not bit for bit. ``cpu`` picks the fastest family that
  runs here for the cache's dtype.

``auto`` picks ``cpu`` on a CPU that can run the kernels, else ``torch``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch
import torch.nn.functional as F

from pdserve.engine import kernels
from pdserve.engine.model.kv_cache import is_quantized, read_rows, to_rows
from pdserve.engine.model.linear import cpu_families
from pdserve.engine.model.rope import RotaryEmbedding, apply_rotary


@dataclass
class AttentionMetadata:
    """One step's attention inputs (filled by ``InputBatch.prepare``)."""

    positions: torch.Tensor  # [T] int64, position of each new token
    slot_mapping: torch.Tensor  # [T] int64, block * block_size + offset receiving its K/V
    block_table: torch.Tensor  # [rows, max_blocks] int32, persistent; row per sequence
    seq_rows: torch.Tensor  # [S] int32, block_table row of each sequence
    query_start: torch.Tensor  # [S] int32
    query_len: torch.Tensor  # [S] int32
    context_len: torch.Tensor  # [S] int32, tokens in the cache after this step
    num_decode: int  # sequences with query_len == 1, at the front
    # The same per-sequence values as Python ints, for backends that loop in Python
    # (no device sync per layer).
    seq_rows_list: list[int]
    query_start_list: list[int]
    query_len_list: list[int]
    context_len_list: list[int]


class AttentionBackend(Protocol):
    def __call__(self, qkv: torch.Tensor, kv_cache: torch.Tensor, layer: int,
                 meta: AttentionMetadata) -> torch.Tensor:
        """qkv [T, (H + 2 KVH) * D] for the new tokens; rotates q/k, stores k/v
        into the cache and returns the attention output [T, H * D]."""
        ...


class TorchAttention:
    """Reference backend: SDPA on gathered cache rows. Decodes run as one padded
    batch with a length mask; each prefill chunk runs causally on its own."""

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int,
                 rotary: RotaryEmbedding) -> None:
        self.h, self.kvh, self.d = num_heads, num_kv_heads, head_dim
        self.scale = head_dim ** -0.5
        self.rotary = rotary

    def __call__(self, qkv: torch.Tensor, kv_cache: torch.Tensor, layer: int,
                 meta: AttentionMetadata) -> torch.Tensor:
        t, h, kvh, d = qkv.shape[0], self.h, self.kvh, self.d
        cos, sin = self.rotary.tables(meta.positions)
        qk = apply_rotary(qkv[:, : (h + kvh) * d].view(t, h + kvh, d), cos, sin)
        q, k = qk.split([h, kvh], dim=1)
        v = qkv[:, (h + kvh) * d :].view(t, kvh, d)
        kv_layer = kv_cache[:, layer]
        bs = kv_layer.shape[3]
        blocks, offsets = meta.slot_mapping // bs, meta.slot_mapping % bs
        k_rows, v_rows = to_rows(k, kv_layer), to_rows(v, kv_layer)  # [T, KVH, row]
        kv_layer[blocks, 0, :, offsets] = k_rows
        kv_layer[blocks, 1, :, offsets] = v_rows
        if is_quantized(kv_layer):  # fresh K/V as the cache holds them (as the kernels read)
            k, v = read_rows(k_rows, q.dtype), read_rows(v_rows, q.dtype)
        out = torch.empty_like(q)
        nd = meta.num_decode
        if nd:
            lens = meta.context_len[:nd].long()
            width = -(-int(max(meta.context_len_list[:nd])) // bs)
            table = meta.block_table[meta.seq_rows[:nd].long(), :width].long()
            kc = _gather(kv_layer, table, 0).transpose(1, 2)  # [B, KVH, L, D]
            vc = _gather(kv_layer, table, 1).transpose(1, 2)
            mask = (torch.arange(width * bs, device=q.device)[None, :] < lens[:, None])
            o = F.scaled_dot_product_attention(
                q[:nd].unsqueeze(2), read_rows(kc, q.dtype), read_rows(vc, q.dtype),
                attn_mask=mask[:, None, None, :], scale=self.scale, enable_gqa=True,
            )  # [B, H, 1, D]
            out[:nd] = o.squeeze(2)
        for s in range(nd, len(meta.query_len_list)):
            start, n = meta.query_start_list[s], meta.query_len_list[s]
            ctx = meta.context_len_list[s]
            qc = q[start : start + n].transpose(0, 1).unsqueeze(0)  # [1, H, n, D]
            if ctx == n:  # no cached prefix: attend to the fresh K/V
                kc = k[start : start + n].transpose(0, 1).unsqueeze(0)
                vc = v[start : start + n].transpose(0, 1).unsqueeze(0)
                o = F.scaled_dot_product_attention(
                    qc, kc, vc, is_causal=True, scale=self.scale, enable_gqa=True)
            else:  # prefix in the cache: query i sits at position ctx - n + i
                table = meta.block_table[meta.seq_rows_list[s], : -(-ctx // bs)].long()
                kc = read_rows(_gather(kv_layer, table, 0)[:ctx], q.dtype)
                vc = read_rows(_gather(kv_layer, table, 1)[:ctx], q.dtype)
                qpos = torch.arange(ctx - n, ctx, device=q.device).unsqueeze(1)
                mask = torch.arange(ctx, device=q.device).unsqueeze(0) <= qpos  # [n, ctx]
                o = F.scaled_dot_product_attention(
                    qc, kc.transpose(0, 1).unsqueeze(0), vc.transpose(0, 1).unsqueeze(0),
                    attn_mask=mask, scale=self.scale, enable_gqa=True,
                )
            out[start : start + n] = o.squeeze(0).transpose(0, 1)
        return out.reshape(t, h * d)


def _gather(kv_layer: torch.Tensor, block_ids: torch.Tensor, which: int) -> torch.Tensor:
    """Cache rows of ``block_ids`` as one sequence: [..., n_blocks * block_size, KVH, D]."""
    g = kv_layer[block_ids, which]  # [..., nb, KVH, bs, D]
    return g.transpose(-3, -2).flatten(-4, -3)


class CpuPagedAttention:
    """pdserve's C++ kernels: fused rotary + cache write, paged attention in place."""

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int,
                 rotary: RotaryEmbedding, family: str = "avx2") -> None:
        self.k = kernels.require()
        self.family = kernels.family_id(family)
        self.h, self.kvh, self.d = num_heads, num_kv_heads, head_dim
        self.scale = head_dim ** -0.5
        self.cos = rotary.cos.float().contiguous()
        self.sin = rotary.sin.float().contiguous()

    def __call__(self, qkv: torch.Tensor, kv_cache: torch.Tensor, layer: int,
                 meta: AttentionMetadata) -> torch.Tensor:
        in_dtype = qkv.dtype  # float32 unless the linear layers are the reference
        if in_dtype != torch.float32:
            qkv = qkv.float().contiguous()
        out = self.k.attention_step(
            qkv, meta.positions, self.cos, self.sin, kv_cache, layer, meta.slot_mapping,
            meta.block_table, meta.seq_rows, meta.query_start, meta.query_len,
            meta.context_len, self.h, self.kvh, self.scale, self.family)
        return out if in_dtype == torch.float32 else out.to(in_dtype)


def attention_families(kv_cache_dtype: str) -> list[str]:
    """The families this CPU runs for a KV cache of ``kv_cache_dtype``, fastest last:
    for a bfloat16 cache also avx512bf16 and amx, where the dense GEMM's families of
    those names run (the same flags; amx: and the tile state)."""
    if kernels.load() is None:
        return []
    if kv_cache_dtype != "bfloat16":
        return ["avx2"]
    dense = cpu_families(torch.bfloat16)
    return ["avx2", *(f for f in ("avx512bf16", "amx") if f in dense)]


def resolve_attention_backend(name: str, device: str, head_dim: int, block_size: int,
                              kv_cache_dtype: str) -> str:
    """``auto`` -> the fastest backend that runs here (``torch`` or ``cpu-FAMILY``);
    ``cpu`` -> the fastest family for the cache; a forced family is checked (the name
    itself was, by ``EngineConfig``)."""
    fits = head_dim % 16 == 0 and head_dim <= 256 and block_size % 8 == 0 and block_size <= 64
    family = name.removeprefix("cpu-")
    if kv_cache_dtype != "bfloat16":
        why = "needs a bfloat16 KV cache"
    elif family == "amx":
        why = "needs AMX-BF16 and the tile state from Linux"
    else:
        why = "needs AVX512-BF16"
    return kernels.resolve_backend(
        "attention", name, device, fits,
        "head_dim a multiple of 16 (<= 256) and block_size a multiple of 8 (<= 64)",
        lambda: attention_families(kv_cache_dtype), lambda: f"the {family} family {why}")


def make_attention(name: str, num_heads: int, num_kv_heads: int, head_dim: int,
                   rotary: RotaryEmbedding) -> AttentionBackend:
    """The backend ``resolve_attention_backend`` named (``torch`` or ``cpu-FAMILY``)."""
    if name == "torch":
        return TorchAttention(num_heads, num_kv_heads, head_dim, rotary)
    return CpuPagedAttention(num_heads, num_kv_heads, head_dim, rotary,
                             name.removeprefix("cpu-"))
