"""The C++ GEMMs (csrc/gemm.cpp, and the integer ones: w8a8.cpp, quant_gemm.cpp), every
kernel family this CPU runs: agreement with the plain-torch reference, and batch
invariance by construction -- a row's result is bit-identical however many rows
share its call, wherever it lands in the tiles and however many threads run it."""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F

from pdserve.engine import kernels
from pdserve.engine.kernels import DENSE_FAMILIES, INT_FAMILIES, family_id
from pdserve.engine.model import quant
from pdserve.engine.model.attention import attention_families
from pdserve.engine.model.linear import (
    CpuDense,
    CpuQuantized,
    CpuW8A8,
    blocks_family,
    cpu_families,
    int_families,
    int_family,
    resolve_linear_backend,
)

pytestmark = pytest.mark.skipif(kernels.cpu_supported() is not None,
                                reason=str(kernels.cpu_supported()))

CASES = [(fam, dt) for dt in (torch.float32, torch.bfloat16) for fam in DENSE_FAMILIES]


def runnable(family: str, dtype: torch.dtype) -> None:
    if family not in cpu_families(dtype):
        pytest.skip(f"this CPU does not run the {family} family for {dtype} weights")


def reference(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None,
              family: str) -> torch.Tensor:
    """What the family computes, in float64: bf16 dot products see x rounded to bf16."""
    xs = x.bfloat16() if family in ("avx512bf16", "amx") else x
    return F.linear(xs.double(), w.double(), None if b is None else b.double()).float()


def test_families_follow_the_cpu_flags() -> None:
    flags = kernels.cpu_flags()
    assert "avx2" in cpu_families(torch.float32)
    has_bf16 = {"avx512f", "avx512bw", "avx512vl", "avx512_bf16"} <= flags
    # amx also needs Linux to grant the process the tile state (arch_prctl)
    has_amx = has_bf16 and {"amx_tile", "amx_bf16"} <= flags and kernels.require().amx_ready()
    assert ("avx512bf16" in cpu_families(torch.bfloat16)) == has_bf16
    assert ("amx" in cpu_families(torch.bfloat16)) == has_amx
    assert cpu_families(torch.float32) == ["avx2"]  # the others: bf16 weights only
    best = resolve_linear_backend("auto", "cpu", torch.bfloat16, (64,))
    assert best == ("cpu-amx" if has_amx else "cpu-avx512bf16" if has_bf16 else "cpu-avx2")
    assert resolve_linear_backend("cpu", "cpu", torch.float32, (64,)) == "cpu-avx2"


def test_a_family_the_cpu_cannot_run_is_refused_by_name() -> None:
    for family in ("avx512bf16", "amx"):
        with pytest.raises(ValueError, match=rf"cpu-{family}.*float32"):
            resolve_linear_backend(f"cpu-{family}", "cpu", torch.float32, (64,))
    with pytest.raises(ValueError, match="unknown linear backend 'cpu-avx10'"):
        resolve_linear_backend("cpu-avx10", "cpu", torch.float32, (64,))


@pytest.mark.parametrize(("family", "dtype"), CASES)
@pytest.mark.parametrize("m", [1, 2, 3, 4, 5, 6, 7, 13, 40, 131])
@pytest.mark.parametrize("bias", [False, True])
def test_gemm_matches_reference(family: str, dtype: torch.dtype, m: int, bias: bool) -> None:
    runnable(family, dtype)
    g = torch.Generator().manual_seed(m)
    n, k = 101, 112  # 101 outputs: a partial last block; 112 = 3 x 32 + 16 of K
    w = torch.randn(n, k, generator=g).to(dtype)
    x = torch.randn(m, k, generator=g)
    b = torch.randn(n, generator=g) if bias else None
    out = CpuDense(w, b, family)(x)
    ref = reference(x, w.float(), b, family)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize(("family", "dtype"), CASES)
@pytest.mark.parametrize(("n", "k"), [(576, 576), (200, 1536), (96, 64), (48, 32), (80, 80)])
def test_rows_are_bit_identical_however_batched(family: str, dtype: torch.dtype, n: int,
                                                k: int) -> None:
    runnable(family, dtype)
    g = torch.Generator().manual_seed(n + k)
    w = torch.randn(n, k, generator=g).to(dtype) * 0.05
    b = torch.randn(n, generator=g)
    x = torch.randn(300, k, generator=g)
    lin = CpuDense(w, b, family)
    full = lin(x)
    # alone, in small and large batches, at every offset within a tile (and a pair of
    # tiles: amx), across a cache chunk boundary (128 rows; amx's bf16 chunk at K 1536:
    # 160), and on one thread instead of two
    for lo, hi in [(0, 1), (5, 6), (0, 2), (3, 8), (1, 7), (7, 20), (0, 64), (100, 229),
                   (127, 129), (159, 161), (16, 50), (299, 300), (11, 300)]:
        assert torch.equal(lin(x[lo:hi].contiguous()), full[lo:hi]), (lo, hi)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert torch.equal(lin(x), full)
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("family", DENSE_FAMILIES)
def test_a_large_output_is_the_same_bits_as_small_ones(family: str) -> None:
    # 1100 x 3840 float32 outputs (17 MB): amx writes them with streaming stores (at
    # 16 MB and up), with the partial tile of 1100 = 68 x 16 + 12 rows too
    runnable(family, torch.bfloat16)
    g = torch.Generator().manual_seed(7)
    w = torch.randn(3840, 64, generator=g).bfloat16()
    b = torch.randn(3840, generator=g)
    x = torch.randn(1100, 64, generator=g)
    lin = CpuDense(w, b, family)
    full = lin(x)
    torch.testing.assert_close(full, reference(x, w.float(), b, family), rtol=1e-5, atol=1e-4)
    for lo, hi in [(0, 1), (300, 340), (1088, 1100)]:
        assert torch.equal(lin(x[lo:hi].contiguous()), full[lo:hi]), (lo, hi)


@pytest.mark.parametrize("family", ["avx512bf16", "amx"])
@pytest.mark.parametrize("m", [1, 5, 16, 131, 3000])
def test_fused_silu_mul_is_gemm_then_silu_mul_bit_for_bit(family: str, m: int) -> None:
    # a gate/up layer of these families writes silu(gate) * up itself: the same bits
    # as its gemm then the pointwise silu_mul (3000 rows x 1536: 18 MB, streamed by amx;
    # more than one 128-row chunk and the 6-row tiles' remainders)
    runnable(family, torch.bfloat16)
    k = kernels.require()
    g = torch.Generator().manual_seed(m)
    i, d = (1536, 576) if m == 3000 else (192, 112)  # 112 = 3 x 32 + 16 of K
    lin = CpuDense((torch.randn(2 * i, d, generator=g) * 0.05).bfloat16(),
                   torch.randn(2 * i, generator=g), family)
    assert lin.fuses_silu_mul
    x = torch.randn(m, d, generator=g)
    assert torch.equal(lin.silu_mul(x), k.silu_mul(lin(x)))


@pytest.mark.parametrize("family", ["avx512bf16", "amx"])
def test_bf16_families_take_bfloat16_x_and_give_bfloat16_silu_mul(family: str) -> None:
    # x handed over in bfloat16 (a producer's to_bf16) gives the bits of x in float32;
    # bf16_out rounds the fused silu_mul's float32 result as those families round x
    runnable(family, torch.bfloat16)
    g = torch.Generator().manual_seed(4)
    i, d = 192, 576
    lin = CpuDense((torch.randn(2 * i, d, generator=g) * 0.05).bfloat16(),
                   torch.randn(2 * i, generator=g), family)
    for m in (1, 5, 37, 300):
        x = torch.randn(m, d, generator=g)
        assert torch.equal(lin(x.bfloat16()), lin(x))
        out = lin.silu_mul(x, bf16_out=True)
        assert out.dtype == torch.bfloat16
        assert torch.equal(out, lin.silu_mul(x).bfloat16())
        assert torch.equal(lin.silu_mul(x.bfloat16(), bf16_out=True), out)
    avx2 = CpuDense(torch.randn(32, 64).bfloat16(), None, "avx2")
    with pytest.raises(RuntimeError, match="float32"):
        avx2(torch.randn(2, 64).bfloat16())  # float32 FMA: x must stay float32


def test_bf16_families_fuse_silu_mul_of_whole_groups_only() -> None:
    k = kernels.require()
    w = torch.randn(2 * 96, 64).bfloat16()
    for family in cpu_families(torch.bfloat16):
        assert CpuDense(w, None, family).fuses_silu_mul is False  # 96 gates: not whole groups
        assert CpuDense(torch.randn(256, 64).bfloat16(), None, family).fuses_silu_mul == \
            (family != "avx2")
        if family != "avx2":
            with pytest.raises(RuntimeError, match="multiple of 64"):
                k.gemm_silu_mul(torch.randn(2, 64), CpuDense(w, None, family).packed, 192,
                                family_id(family), None)
    avx2 = CpuDense(torch.randn(256, 64).bfloat16(), None, "avx2")
    with pytest.raises(RuntimeError, match="avx512bf16 and amx families' gemm only"):
        k.gemm_silu_mul(torch.randn(2, 64), avx2.packed, 256, family_id("avx2"), None)


def test_gemm_rejects_bad_input() -> None:
    k = kernels.require()
    w = torch.randn(32, 64)
    packed = k.pack_weight(w, family_id("avx2"))
    with pytest.raises(RuntimeError, match="packed weight"):
        k.gemm(torch.randn(2, 32), packed, 32, family_id("avx2"), None)
    with pytest.raises(RuntimeError, match="float32"):
        k.gemm(torch.randn(2, 64).double(), packed, 32, family_id("avx2"), None)
    with pytest.raises(RuntimeError, match="bias"):
        k.gemm(torch.randn(2, 64), packed, 32, family_id("avx2"), torch.randn(31))
    with pytest.raises(RuntimeError, match="bf16dp/amx: weight must be bfloat16"):
        k.pack_weight(w, family_id("avx512bf16"))
    with pytest.raises(RuntimeError, match="unknown kernel family"):
        k.pack_weight(w, 7)


# ---------------------------------------------------------------------- W8A8
INT_FAMILY_NAMES = list(INT_FAMILIES)


def int_runnable(family: str) -> None:
    if family not in int_families():
        pytest.skip(f"this CPU does not run the {family} integer family")


def test_integer_families_follow_the_cpu_flags() -> None:
    flags = kernels.cpu_flags()
    vnni = {"avx512f", "avx512bw", "avx512_vnni"} <= flags
    amx = vnni and {"amx_tile", "amx_int8"} <= flags and kernels.require().amx_ready()
    assert int_families() == ["avx2", *(["avx512vnni"] if vnni else []),
                              *(["amx"] if amx else [])]
    assert int_family("cpu") == int_families()[-1]
    assert int_family("cpu-avx2") == "avx2"
    assert int_family("cpu-avx512bf16") == ("avx512vnni" if vnni else "avx2")
    assert [blocks_family(f) for f in INT_FAMILIES] == ["avx2", "avx512vnni", "avx512vnni"]


# The flags a Zen 4 (AVX512-BF16 class) and a Zen 3 (AVX2 class) lack of an AMX Xeon's.
NO_AMX = "amx_tile amx_bf16 amx_int8"
AVX2_CLASS = NO_AMX + " avx512f avx512bw avx512vl avx512dq avx512_bf16 avx512_vnni avx_vnni"


@pytest.mark.parametrize("hidden", [NO_AMX, AVX2_CLASS])
def test_hidden_flags_choose_the_families_of_a_cpu_without_them(
        monkeypatch: pytest.MonkeyPatch, hidden: str) -> None:
    real = kernels.cpu_flags()  # less what the run's own setting hides (kept below)
    outer = os.environ.get(kernels.HIDE_FLAGS_ENV, "")
    monkeypatch.setenv(kernels.HIDE_FLAGS_ENV, f"{outer}, {hidden.replace(' ', ', ')}")
    assert kernels.cpu_flags() == real - set(hidden.split())
    bf16 = "avx512_bf16" in real and hidden == NO_AMX
    vnni = "avx512_vnni" in real and hidden == NO_AMX
    assert cpu_families(torch.bfloat16) == ["avx2", *(["avx512bf16"] if bf16 else [])]
    assert int_families() == ["avx2", *(["avx512vnni"] if vnni else [])]
    assert attention_families("bfloat16") == cpu_families(torch.bfloat16)
    assert resolve_linear_backend("auto", "cpu", torch.bfloat16, (64,)) == (
        "cpu-avx512bf16" if bf16 else "cpu-avx2")
    with pytest.raises(ValueError, match=r"cpu-amx.*cannot run here"):
        resolve_linear_backend("cpu-amx", "cpu", torch.bfloat16, (64,))


@pytest.mark.parametrize("family", INT_FAMILY_NAMES)
@pytest.mark.parametrize("m", [1, 2, 3, 5, 6, 7, 40, 131])
@pytest.mark.parametrize("bias", [False, True])
def test_w8a8_equals_its_reference_bit_for_bit(family: str, m: int, bias: bool) -> None:
    int_runnable(family)
    g = torch.Generator().manual_seed(m)
    n, k = 101, 96
    w8 = quant.quantize_w8(torch.randn(n, k, generator=g))
    x = torch.randn(m, k, generator=g) * 3
    x[0, 5] = 40.0  # an outlier sets its row's scale
    b = torch.randn(n, generator=g) if bias else None
    out = CpuW8A8(w8, b, family)(x)
    assert torch.equal(out, quant.w8a8_reference(x, w8, b))


def test_w8a8_is_close_to_the_float_matmul() -> None:
    g = torch.Generator().manual_seed(1)
    w = torch.randn(64, 256, generator=g) * 0.05
    x = torch.randn(9, 256, generator=g)
    ref = F.linear(x, w)
    out = CpuW8A8(quant.quantize_w8(w), None, "avx2")(x)
    # two 8-bit roundings: ~1% of the typical output
    torch.testing.assert_close(out, ref, rtol=0.05, atol=0.02 * float(ref.abs().max()))


@pytest.mark.parametrize("family", INT_FAMILY_NAMES)
def test_w8a8_rows_are_bit_identical_however_batched(family: str) -> None:
    int_runnable(family)
    g = torch.Generator().manual_seed(2)
    w8 = quant.quantize_w8(torch.randn(200, 576, generator=g))
    b = torch.randn(200, generator=g)
    x = torch.randn(300, 576, generator=g)
    lin = CpuW8A8(w8, b, family)
    full = lin(x)
    for lo, hi in [(0, 1), (5, 6), (3, 8), (7, 20), (100, 229), (127, 129), (11, 300)]:
        assert torch.equal(lin(x[lo:hi].contiguous()), full[lo:hi]), (lo, hi)


@pytest.mark.parametrize(("n", "k"), [(80, 192), (200, 576), (48, 96), (33, 48)])
def test_w8a8_families_agree_bit_for_bit(n: int, k: int) -> None:
    """Integer sums and one float epilogue: the same result on every CPU class (groups
    of 64, 32 and 16 inputs; 3, 2 and 1 blocks in the last group of outputs)."""
    g = torch.Generator().manual_seed(n + k)
    w8 = quant.quantize_w8(torch.randn(n, k, generator=g))
    x = torch.randn(37, k, generator=g)
    b = torch.randn(n, generator=g)
    outs = [CpuW8A8(w8, b, family)(x) for family in int_families()]
    for out in outs[1:]:
        assert torch.equal(out, outs[0])


@pytest.mark.parametrize(("m", "k"), [(1, 96), (5, 576), (16, 96), (131, 576), (1100, 576)])
def test_w8a8_fused_silu_mul_is_gemm_then_silu_mul_bit_for_bit(m: int, k: int) -> None:
    # amx's gate/up layer writes silu(gate) * up itself: the same bits as its gemm then
    # the pointwise silu_mul (groups of 32 and 64 inputs; a last tile of fewer rows;
    # more than one 128-row chunk)
    int_runnable("amx")
    kk = kernels.require()
    g = torch.Generator().manual_seed(m + k)
    i = 192
    lin = CpuW8A8(quant.quantize_w8(torch.randn(2 * i, k, generator=g)),
                  torch.randn(2 * i, generator=g), "amx")
    assert lin.fuses_silu_mul
    x = torch.randn(m, k, generator=g) * 3
    assert torch.equal(lin.silu_mul(x), kk.silu_mul(lin(x)))


def test_w8a8_fuses_silu_mul_on_amx_of_whole_groups_only() -> None:
    w8 = quant.quantize_w8(torch.randn(2 * 96, 64))
    for family in int_families():
        assert CpuW8A8(w8, None, family).fuses_silu_mul is False  # 96 gates: not whole groups
        lin = CpuW8A8(quant.quantize_w8(torch.randn(256, 64)), None, family)
        assert lin.fuses_silu_mul == (family == "amx")
        if family != "amx":
            with pytest.raises(RuntimeError, match="W8A8 amx family only"):
                lin.silu_mul(torch.randn(2, 64))
    if "amx" in int_families():
        with pytest.raises(RuntimeError, match="multiple of 64"):
            CpuW8A8(w8, None, "amx").silu_mul(torch.randn(2, 64))


def test_w8a8_groups_agree_with_the_reference() -> None:
    k = kernels.require()
    for width in (576, 1536, 96, 80, 48, 16):
        assert k.w8a8_group(width) == quant.w8a8_group(width)


def test_w8a8_rejects_bad_input() -> None:
    k = kernels.require()
    w8 = quant.quantize_w8(torch.randn(16, 64))
    packed = k.pack_w8(w8.q, 0)
    colsum = w8.q.sum(dim=1, dtype=torch.int32)[None]  # one group of 64
    with pytest.raises(RuntimeError, match="packed weight"):
        k.w8a8_gemm(torch.randn(2, 32), packed, w8.scale, colsum, 0, None)
    with pytest.raises(RuntimeError, match="unknown W8A8 family"):
        k.pack_w8(w8.q, 5)
    with pytest.raises(RuntimeError, match="int8"):
        k.pack_w8(w8.q.float(), 0)


# ------------------------------------------------------- int8 / int4 weights
KINDS = [("int8", 32), ("int4", 32), ("int4", 64), ("int4", 128)]


@pytest.mark.parametrize("family", INT_FAMILY_NAMES)
@pytest.mark.parametrize(("kind", "group"), KINDS)
@pytest.mark.parametrize(("n", "k"), [(101, 128), (64, 256), (16, 384)])
@pytest.mark.parametrize("bias", [False, True])
def test_quantized_equals_its_reference_bit_for_bit(family: str, kind: str, group: int, n: int,
                                                    k: int, bias: bool) -> None:
    int_runnable(family)
    g = torch.Generator().manual_seed(n + k + group)
    qw = quant.quantize(torch.randn(n, k, generator=g), kind, group)
    if kind == "int8":  # GGUF's Q8_0 may hold -128 (pdserve's quantizer stops at -127)
        qw.data.view(n, -1, 34)[0, 0, 2] = 128
    b = torch.randn(n, generator=g) if bias else None
    lin = CpuQuantized(qw, b, family)
    for m in (1, 2, 3, 5, 40, 131):
        x = torch.randn(m, k, generator=g) * 3
        x[0, 5] = 40.0  # an outlier sets its block's scale
        assert torch.equal(lin(x), quant.quantized_reference(x, qw, b)), m


@pytest.mark.parametrize("kind", ["int8", "int4"])
def test_quantized_is_close_to_the_dequantized_matmul(kind: str) -> None:
    g = torch.Generator().manual_seed(1)
    qw = quant.quantize(torch.randn(64, 256, generator=g) * 0.05, kind, 32)
    x = torch.randn(9, 256, generator=g)
    ref = F.linear(x, quant.dequantize(qw))
    out = CpuQuantized(qw, None, "avx2")(x)
    # x rounded to 8 bits per block of 32 (the weights are exact): well under 1% of
    # the typical output (a wrong nibble order is off by tens of percent)
    torch.testing.assert_close(out, ref, rtol=0.02, atol=0.01 * float(ref.abs().max()))


@pytest.mark.parametrize("family", INT_FAMILY_NAMES)
@pytest.mark.parametrize("kind", ["int8", "int4"])
def test_quantized_rows_are_bit_identical_however_batched(family: str, kind: str) -> None:
    int_runnable(family)
    g = torch.Generator().manual_seed(2)
    qw = quant.quantize(torch.randn(200, 576, generator=g), kind, 32)
    b = torch.randn(200, generator=g)
    x = torch.randn(300, 576, generator=g)
    lin = CpuQuantized(qw, b, family)
    full = lin(x)
    for lo, hi in [(0, 1), (5, 6), (3, 8), (7, 20), (100, 229), (127, 129), (11, 300)]:
        assert torch.equal(lin(x[lo:hi].contiguous()), full[lo:hi]), (lo, hi)


@pytest.mark.parametrize("kind", ["int8", "int4"])
def test_quantized_families_agree_bit_for_bit(kind: str) -> None:
    int_runnable("avx512vnni")
    g = torch.Generator().manual_seed(4)
    qw = quant.quantize(torch.randn(80, 192, generator=g), kind, 64 if kind == "int4" else 32)
    x = torch.randn(37, 192, generator=g)
    b = torch.randn(80, generator=g)
    assert torch.equal(CpuQuantized(qw, b, "avx2")(x), CpuQuantized(qw, b, "avx512vnni")(x))


def test_quantized_rejects_bad_input() -> None:
    k = kernels.require()
    qw = quant.quantize(torch.randn(16, 64), "int4", 32)
    packed = k.pack_quantized(qw.data, 4, 0)
    with pytest.raises(RuntimeError, match="x has 32 columns"):
        k.quant_gemm(torch.randn(2, 32), packed, 16, 4, 0, None)
    with pytest.raises(RuntimeError, match="not pack_quantized's"):
        k.quant_gemm(torch.randn(2, 64), packed, 17, 4, 0, None)
    with pytest.raises(RuntimeError, match="not pack_quantized's"):
        k.quant_gemm(torch.randn(2, 64), packed, 16, 8, 0, None)  # an int4 weight as int8
    with pytest.raises(RuntimeError, match="unknown integer family"):
        k.pack_quantized(qw.data, 4, 5)
    with pytest.raises(RuntimeError, match="bits must be 4 or 8"):
        k.pack_quantized(qw.data, 5, 0)
    with pytest.raises(RuntimeError, match="Q4_1 blocks"):
        k.pack_quantized(qw.data[:, :30].contiguous(), 4, 0)
    with pytest.raises(RuntimeError, match="bias"):
        k.quant_gemm(torch.randn(2, 64), packed, 16, 4, 0, torch.randn(15))
    with pytest.raises(RuntimeError, match="float32"):
        k.quant_gemm(torch.randn(2, 64).double(), packed, 16, 4, 0, None)
