"""pdserve's C++ CPU kernels against plain-torch references, op by op."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from pdserve.engine import kernels
from pdserve.engine.config import RopeConfig
from pdserve.engine.model import quant
from pdserve.engine.model.attention import (
    AttentionMetadata,
    CpuPagedAttention,
    TorchAttention,
    attention_families,
)
from pdserve.engine.model.kv_cache import dequantize_rows, quantize_rows
from pdserve.engine.model.rope import RotaryEmbedding

pytestmark = pytest.mark.skipif(kernels.cpu_supported() is not None,
                                reason=str(kernels.cpu_supported()))


@pytest.fixture(scope="module")
def k():  # type: ignore[no-untyped-def]
    return kernels.require()  # on a CPU that can run them they must be built


def test_kernels_are_built_and_current() -> None:
    assert kernels.reason() is None


# ------------------------------------------------------------------ linear
# Dense, W8A8 and int8 / int4 layers: test_gemm.py. Quantizers and GGUF blocks:
def test_quantizers_round_trip() -> None:
    g = torch.Generator().manual_seed(0)
    w = torch.randn(8, 128, generator=g)
    w8 = quant.dequantize(quant.quantize_int8(w))
    step8 = w.abs().amax(dim=1, keepdim=True) / 127
    assert bool(((w8 - w).abs() <= step8 * 0.51).all())  # half a step, per channel
    for group in quant.GROUP_SIZES:
        w4 = quant.dequantize(quant.quantize_int4(w, group))
        gw = w.view(8, -1, group)
        step4 = (gw.amax(dim=2) - gw.amin(dim=2)) / 15
        err = (w4 - w).view(8, -1, group).abs().amax(dim=2)
        assert bool((err <= step4 * 0.51 + 1e-3).all())


def test_gguf_q4_0_becomes_q4_1_without_float_detour() -> None:
    # two Q4_0 blocks by hand: d = 0.5 and 2.0, nibbles 0..15
    qs = bytes((j | ((15 - j) << 4)) for j in range(16))
    raw = [torch.tensor([0.5], dtype=torch.float16).view(torch.uint8).tolist() + list(qs),
           torch.tensor([2.0], dtype=torch.float16).view(torch.uint8).tolist() + list(qs)]
    import numpy as np
    qw = quant.from_gguf(np.array([raw[0] + raw[1]], dtype=np.uint8), "Q4_0", "t")
    assert qw.bits == 4 and qw.in_features == 64
    q = torch.tensor(list(range(16)) + [15 - j for j in range(16)], dtype=torch.float32)
    want = torch.cat([0.5 * (q - 8), 2.0 * (q - 8)])
    assert torch.equal(quant.dequantize(qw)[0], want)
    with pytest.raises(ValueError, match="Q6_K"):
        quant.from_gguf(np.zeros((1, 210), dtype=np.uint8), "Q6_K", "blk.0.ffn_down.weight")


def test_quantization_rejects_bad_groups() -> None:
    with pytest.raises(ValueError, match="group size"):
        quant.check_quantizable("layer", 256, 48)
    with pytest.raises(ValueError, match="multiple"):
        quant.check_quantizable("layer", 96, 64)


# --------------------------------------------------------------- pointwise
@pytest.mark.parametrize("wdtype", [torch.float32, torch.bfloat16])
def test_rms_norm_and_fused_residual(k, wdtype: torch.dtype) -> None:  # type: ignore[no-untyped-def]
    g = torch.Generator().manual_seed(1)
    x, res = torch.randn(5, 64, generator=g), torch.randn(5, 64, generator=g)
    w = torch.randn(64, generator=g).to(wdtype)
    ref = F.rms_norm(x, (64,), w.float(), 1e-5)
    torch.testing.assert_close(k.rms_norm(x, w, 1e-5), ref, rtol=1e-5, atol=1e-5)
    want_res = res + x
    out = k.add_rms_norm(x, res, w, 1e-5)
    torch.testing.assert_close(res, want_res)  # residual updated in place
    torch.testing.assert_close(out, F.rms_norm(want_res, (64,), w.float(), 1e-5),
                               rtol=1e-5, atol=1e-5)


@pytest.mark.skipif("avx512_bf16" not in kernels.cpu_flags(), reason="needs AVX512-BF16")
def test_norms_give_bfloat16_rows_rounded_as_the_bf16_gemms_round(k) -> None:  # type: ignore[no-untyped-def]
    # bf16_out: the float32 result rounded to nearest even (for normal values, as
    # torch rounds); the residual is updated as before
    g = torch.Generator().manual_seed(2)
    x, res = torch.randn(9, 576, generator=g), torch.randn(9, 576, generator=g)
    w = torch.randn(576, generator=g).bfloat16()
    out = k.rms_norm(x, w, 1e-5, True)
    assert out.dtype == torch.bfloat16
    assert torch.equal(out, k.rms_norm(x, w, 1e-5).bfloat16())
    res2 = res.clone()
    want = k.add_rms_norm(x, res2, w, 1e-5)
    out = k.add_rms_norm(x, res, w, 1e-5, True)
    assert torch.equal(out, want.bfloat16()) and torch.equal(res, res2)


def test_silu_mul(k) -> None:  # type: ignore[no-untyped-def]
    gu = torch.randn(7, 2 * 48) * 4
    gate, up = gu.chunk(2, dim=-1)
    torch.testing.assert_close(k.silu_mul(gu), F.silu(gate) * up, rtol=1e-5, atol=1e-5)


# ---------------------------------------------------------------- attention
def _case(dtype: torch.dtype, head_dim: int, block_size: int, heads: tuple[int, int],
          seqs: list[tuple[int, int]], seed: int = 0,
          ) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata, RotaryEmbedding]:
    """A random cache with a few sequences, each (new tokens, context after the step);
    blocks handed out shuffled so that no sequence is contiguous."""
    g = torch.Generator().manual_seed(seed)
    h, kvh = heads
    layers = 2
    need = [-(-ctx // block_size) for _, ctx in seqs]
    num_blocks = sum(need) + 3
    cache = torch.randn(num_blocks, layers, 2, kvh, block_size, head_dim, generator=g)
    cache = quantize_rows(cache) if dtype == torch.int8 else cache.to(dtype)
    perm = torch.randperm(num_blocks, generator=g).tolist()
    table = torch.zeros(len(seqs) + 2, max(need) + 1, dtype=torch.int32)
    rows = [len(seqs) + 1 - i for i in range(len(seqs))]  # rows out of order too
    qs, ql, cl, positions, slots = [], [], [], [], []
    t = 0
    for i, ((n, ctx), nb) in enumerate(zip(seqs, need, strict=True)):
        blocks = [perm.pop() for _ in range(nb)]
        table[rows[i], :nb] = torch.tensor(blocks, dtype=torch.int32)
        qs.append(t)
        ql.append(n)
        cl.append(ctx)
        for p in range(ctx - n, ctx):
            positions.append(p)
            slots.append(blocks[p // block_size] * block_size + p % block_size)
        t += n
    meta = AttentionMetadata(
        positions=torch.tensor(positions), slot_mapping=torch.tensor(slots),
        block_table=table, seq_rows=torch.tensor(rows, dtype=torch.int32),
        query_start=torch.tensor(qs, dtype=torch.int32),
        query_len=torch.tensor(ql, dtype=torch.int32),
        context_len=torch.tensor(cl, dtype=torch.int32),
        num_decode=sum(1 for n, _ in seqs if n == 1), seq_rows_list=rows,
        query_start_list=qs, query_len_list=ql, context_len_list=cl)
    qkv = torch.randn(t, (h + 2 * kvh) * head_dim, generator=g)
    rotary = RotaryEmbedding(RopeConfig(), head_dim, 4096, torch.float32)
    return cache, qkv, meta, rotary


# Every attention family with every cache dtype it serves; those this CPU lacks skip.
FAMILY_CASES = [pytest.param(dtype, family, id=f"{family}-{str(dtype).removeprefix('torch.')}")
                for family, dtypes in (("avx2", (torch.float32, torch.bfloat16, torch.int8)),
                                       ("avx512bf16", (torch.bfloat16,)),
                                       ("amx", (torch.bfloat16,)))
                for dtype in dtypes]


def _runs(family: str, dtype: torch.dtype) -> None:
    if family not in attention_families(str(dtype).removeprefix("torch.")):
        pytest.skip(f"this CPU does not run the {family} attention family")


@pytest.mark.parametrize(("dtype", "family"), FAMILY_CASES)
@pytest.mark.parametrize(("head_dim", "block_size", "heads"), [
    (64, 16, (9, 3)), (16, 8, (4, 2)), (32, 32, (4, 1)), (128, 16, (8, 8)), (96, 64, (6, 2)),
    (80, 16, (4, 2)),
])
def test_paged_attention_matches_reference(dtype: torch.dtype, family: str, head_dim: int,
                                           block_size: int, heads: tuple[int, int]) -> None:
    # decodes first (short and long contexts), then a chunk with no prefix, chunks
    # with a cached prefix (tiles of 8 or 16 queries and a ragged one), a 1-token tail
    _runs(family, dtype)
    seqs = [(1, 1), (1, 37), (1, 300), (20, 20), (9, 130), (33, 64), (1, 17)]
    seqs = sorted(seqs, key=lambda s: s[0] != 1)
    cache, qkv, meta, rotary = _case(dtype, head_dim, block_size, heads, seqs)
    h, kvh = heads
    ref_cache, ref_qkv = cache.clone(), qkv.clone()
    ref = TorchAttention(h, kvh, head_dim, rotary)(ref_qkv, ref_cache, 1, meta)
    out = CpuPagedAttention(h, kvh, head_dim, rotary, family)(qkv, cache, 1, meta)
    if dtype == torch.int8:
        # V rows are the very bytes of the reference quantizer; K rows went through the
        # rotary, whose rounding differs by an ulp (fused FMAs), so a value may sit one
        # step of 127 off
        torch.testing.assert_close(cache[:, :, 1], ref_cache[:, :, 1], rtol=0, atol=0)
        torch.testing.assert_close(dequantize_rows(cache), dequantize_rows(ref_cache),
                                   rtol=0, atol=0.04)
    else:  # K/V stored in the same slots (rotary rounding differs by an ulp)
        torch.testing.assert_close(cache, ref_cache, rtol=1e-5, atol=1e-5)
    tol = 1e-4 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out, ref.float(), rtol=tol, atol=tol)
    if family != "avx2":  # and to bfloat16 rounding (of q and P) the float32 family's
        f32 = CpuPagedAttention(h, kvh, head_dim, rotary)(ref_qkv, ref_cache.clone(), 1, meta)
        torch.testing.assert_close(out, f32, rtol=0, atol=2e-2)
        assert not torch.equal(out, f32)  # a family of its own, not the float32 one


def test_bfloat16_attention_needs_a_bfloat16_cache(k) -> None:  # type: ignore[no-untyped-def]
    cache, qkv, meta, _rotary = _case(torch.float32, 64, 16, (9, 3), [(1, 40)])
    q, out = qkv.view(1, -1, 64)[:, :9], torch.empty(1, 9, 64)
    for family in ("avx512bf16", "amx"):
        with pytest.raises(RuntimeError, match="bfloat16 KV cache"):
            k.paged_attention(q, cache, 0, meta.block_table, meta.seq_rows, meta.query_start,
                              meta.query_len, meta.context_len, 0.125, out,
                              kernels.family_id(family))
    with pytest.raises(RuntimeError, match="unknown attention family"):
        k.paged_attention(q, cache, 0, meta.block_table, meta.seq_rows, meta.query_start,
                          meta.query_len, meta.context_len, 0.125, out, 7)


def test_int8_cache_rows_are_the_reference_quantizers_bytes(k) -> None:  # type: ignore[no-untyped-def]
    # V rows (not rotated) with edge cases: all zeros (scale 0), exact halves after
    # scaling (round half to even: 2.5 -> 2, 3.5 -> 4, -2.5 -> -2), the extremes
    h, kvh, d, bs = 2, 1, 16, 8
    cache, qkv, meta, rotary = _case(torch.int8, d, bs, (h, kvh), [(4, 4)])
    v = qkv[:, (h + kvh) * d:]
    v[0] = 0
    v[1] = torch.tensor([127, 2.5, 3.5, -2.5, -127, 0.5, 1.5, -0.5] * 2)
    v[2, :8], v[2, 8:] = 1e-30, -3e4
    ref_cache = cache.clone()
    TorchAttention(h, kvh, d, rotary)(qkv.clone(), ref_cache, 0, meta)
    CpuPagedAttention(h, kvh, d, rotary)(qkv, cache, 0, meta)
    assert torch.equal(cache[:, 0, 1], ref_cache[:, 0, 1])
    blk, off = divmod(int(meta.slot_mapping[1]), bs)
    assert cache[blk, 0, 1, 0, off, :8].tolist() == [127, 2, 4, -2, -127, 0, 2, 0]
    blk0, off0 = divmod(int(meta.slot_mapping[0]), bs)
    assert not cache[blk0, 0, 1, 0, off0].any()  # values and scale all zero
    x = torch.randn(50, 64) * torch.logspace(-3, 3, 50)[:, None]
    back = dequantize_rows(quantize_rows(x))
    assert (back - x).abs().le(x.abs().amax(1, keepdim=True) / 254 * 1.0001).all()


def test_paged_attention_rejects_bad_metadata(k) -> None:  # type: ignore[no-untyped-def]
    cache, qkv, meta, _rotary = _case(torch.float32, 64, 16, (9, 3), [(1, 40)])
    q = qkv.view(1, -1, 64)[:, :9]
    out = torch.empty(1, 9, 64)
    bad = meta.block_table.clone()
    bad[int(meta.seq_rows[0]), 0] = 10_000
    with pytest.raises(RuntimeError, match="block id out of range"):
        k.paged_attention(q, cache, 0, bad, meta.seq_rows, meta.query_start, meta.query_len,
                          meta.context_len, 0.125, out, 0)
    with pytest.raises(RuntimeError, match="metadata"):
        k.paged_attention(q, cache, 0, meta.block_table, meta.seq_rows, meta.query_start,
                          meta.query_len, torch.tensor([0], dtype=torch.int32), 0.125, out, 0)


@pytest.mark.parametrize(("dtype", "family"), FAMILY_CASES)
@pytest.mark.parametrize(("head_dim", "block_size", "heads"), [
    (64, 16, (9, 3)), (32, 32, (4, 1)), (128, 16, (8, 8)), (16, 64, (6, 2)), (80, 8, (4, 2)),
])
def test_paged_attention_rows_do_not_depend_on_the_step(  # type: ignore[no-untyped-def]
        k, dtype: torch.dtype, family: str, head_dim: int, block_size: int,
        heads: tuple[int, int]) -> None:
    # A query token's output is the same bits whether its sequence's tokens come as one
    # prefill chunk, in chunks of any size, one at a time (decodes, verification) or
    # beside other sequences: what makes prefill KV equal decode KV (colocated answers
    # equal disaggregated ones) and chunked prefill equal unchunked.
    _runs(family, dtype)
    fam = kernels.family_id(family)
    h, kvh = heads
    n, ctx = 70, 100  # the sequence's last 70 tokens are computed, after a 30-token prefix
    g = torch.Generator().manual_seed(1)
    nb = -(-ctx // block_size)
    cache = torch.randn(nb + 4, 1, 2, kvh, block_size, head_dim, generator=g)
    cache = quantize_rows(cache) if dtype == torch.int8 else cache.to(dtype)
    table = torch.zeros(2, nb + 2, dtype=torch.int32)
    table[0, :nb] = torch.randperm(nb + 4, generator=g)[:nb].int()
    table[1, :3] = torch.tensor([nb + 3, nb + 2, nb + 1], dtype=torch.int32)
    q = torch.randn(n, h, head_dim, generator=g)
    other = torch.randn(1, h, head_dim, generator=g)  # a decode of another sequence

    def attend(splits: list[int], beside: bool = False) -> torch.Tensor:
        out, t0 = torch.empty_like(q), 0
        for m in splits:
            qq, c = q[t0:t0 + m], ctx - n + t0 + m
            if beside:  # the other sequence's decode first, as the runner orders a step
                qq = torch.cat([other, qq])
            o = torch.empty_like(qq)
            seqs = [(1, 1, 40)] if beside else []
            seqs.append((0, m, c))
            starts = [0, 1] if beside else [0]
            k.paged_attention(
                qq, cache, 0, table, torch.tensor([s[0] for s in seqs], dtype=torch.int32),
                torch.tensor(starts, dtype=torch.int32),
                torch.tensor([s[1] for s in seqs], dtype=torch.int32),
                torch.tensor([s[2] for s in seqs], dtype=torch.int32), head_dim ** -0.5, o, fam)
            out[t0:t0 + m] = o[1:] if beside else o
            t0 += m
        return out

    whole = attend([n])
    for splits in ([1] * n, [17, 30, 23], [5, 65], [8] * 8 + [6], [40, 1, 29], [16] * 4 + [6]):
        assert torch.equal(attend(splits), whole), splits
    assert torch.equal(attend([33, 37], beside=True), whole)


@pytest.mark.parametrize(("dtype", "family"), FAMILY_CASES)
@pytest.mark.parametrize("q_len", [1, 5])
def test_a_long_sequence_alone_is_split_by_kv_head_to_the_same_bits(  # type: ignore[no-untyped-def]
        k, dtype: torch.dtype, family: str, q_len: int) -> None:
    # One long sequence's tile (a decode, a verification) with fewer tiles than threads
    # is one task per kv head (attention.cpp, kSplitContext): the same bits as one task
    # of every head (on one thread, or beside other sequences that fill the threads).
    _runs(family, dtype)
    fam = kernels.family_id(family)
    h, kvh, head_dim, block_size, ctx = 9, 3, 64, 16, 1100
    g = torch.Generator().manual_seed(5)
    nb = -(-ctx // block_size)
    cache = torch.randn(nb + 2, 1, 2, kvh, block_size, head_dim, generator=g)
    cache = quantize_rows(cache) if dtype == torch.int8 else cache.to(dtype)
    table = torch.zeros(3, nb, dtype=torch.int32)
    table[0] = torch.randperm(nb + 2, generator=g)[:nb].int()
    table[1:, 0] = torch.tensor([nb, nb + 1], dtype=torch.int32)
    q = torch.randn(q_len, h, head_dim, generator=g)
    others = torch.randn(2, h, head_dim, generator=g)  # two short decodes

    def attend(threads: int, beside: bool) -> torch.Tensor:
        qq = torch.cat([others, q]) if beside else q
        seqs = [(1, 1, 9), (2, 1, 12)] if beside else []
        seqs.append((0, q_len, ctx))
        starts = [0, 1, 2] if beside else [0]
        o = torch.empty_like(qq)
        before = torch.get_num_threads()
        try:
            torch.set_num_threads(threads)
            k.paged_attention(
                qq, cache, 0, table, torch.tensor([s[0] for s in seqs], dtype=torch.int32),
                torch.tensor(starts, dtype=torch.int32),
                torch.tensor([s[1] for s in seqs], dtype=torch.int32),
                torch.tensor([s[2] for s in seqs], dtype=torch.int32), head_dim ** -0.5, o, fam)
        finally:
            torch.set_num_threads(before)
        return o[2:] if beside else o

    split = attend(2, beside=False)
    assert torch.equal(split, attend(1, beside=False))
    assert torch.equal(split, attend(2, beside=True))


@pytest.mark.parametrize(("dtype", "family"), FAMILY_CASES)
def test_a_step_s_bits_do_not_depend_on_the_threads(dtype: torch.dtype, family: str) -> None:
    # Threads take the tasks one at a time, longest first (attention.cpp): which thread
    # runs which tile of a causal prefill, and in what order, never shows in the bits.
    _runs(family, dtype)
    seqs = [(1, 40), (1, 700), (1, 5), (160, 300), (70, 70)]
    seqs = sorted(seqs, key=lambda s: s[0] != 1)
    cache, qkv, meta, rotary = _case(dtype, 64, 16, (9, 3), seqs, seed=11)
    attend = CpuPagedAttention(9, 3, 64, rotary, family)
    before = torch.get_num_threads()
    outs = []
    try:
        for threads in (1, 2, 2):
            kernels.set_num_threads(threads)
            outs.append(attend(qkv.clone(), cache.clone(), 1, meta))
    finally:
        kernels.set_num_threads(before)
    assert torch.equal(outs[0], outs[1]) and torch.equal(outs[0], outs[2])


@pytest.mark.parametrize("vocab", [1, 7, 16, 37, 49152])
def test_argmax_rows_answers_as_torch(k, vocab: int) -> None:  # type: ignore[no-untyped-def]
    # random rows, ties (the first index wins), all -inf, a NaN (its first index wins),
    # the maximum in the tail past the last whole vector
    g = torch.Generator().manual_seed(3)
    x = torch.randn(8, vocab, generator=g)
    x[1] = 0.5  # every value tied
    x[2] = float("-inf")
    x[3, vocab // 2] = float("nan")
    x[3, vocab - 1] = float("nan")
    x[4, -1] = 1e9  # the last element
    x[5, : vocab // 2 + 1] = 7.0  # a run of tied maxima
    assert torch.equal(k.argmax_rows(x), x.argmax(dim=-1))
    assert k.argmax_rows(torch.empty(0, vocab)).shape == (0,)
    with pytest.raises(RuntimeError, match="contiguous float32"):
        k.argmax_rows(x.double())


def test_family_ids_come_from_the_library_under_one_name_each() -> None:
    """The ids are the C++ enum's (csrc/families.h), exported by name; Python names
    each family once per kind of kernel, fastest last, and never writes an id."""
    ids = kernels.require().FAMILY_IDS
    assert set(ids) == set(kernels.DENSE_FAMILIES) | set(kernels.INT_FAMILIES)
    for names in (kernels.DENSE_FAMILIES, kernels.INT_FAMILIES):
        assert [kernels.family_id(n) for n in names] == sorted(set(ids.values()))


def test_an_installed_package_without_a_compiler_says_what_to_install(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Outside a checkout the kernels compile at first use into the cache; with no
    compiler there, the reason names the compiler and the command that builds them."""
    monkeypatch.setattr(kernels, "_CHECKOUT", False)
    monkeypatch.setenv("PDSERVE_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("CXX", "no-such-compiler")
    assert kernels.kernel_dir().parent == tmp_path / "kernels"
    why = kernels._build_at_first_use()
    assert why is not None and "'no-such-compiler' is not on PATH" in why
    assert "python -m pdserve.engine.kernels" in why
    assert not list(tmp_path.rglob("*.so"))
