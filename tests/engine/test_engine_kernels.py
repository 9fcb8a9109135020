"""The engine on each C++ kernel family this CPU runs: thread counts changing between
steps, every GEMM and attention family batch invariant, the fused silu-mul and the
bfloat16 hand-over, the fused decoder against the layer loop, how the attention
backend resolves, prefill KV equal to decode KV, mixed backends and bfloat16 accuracy."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from pdserve.engine import kernels
from pdserve.engine.config import EngineConfig
from pdserve.engine.engine import LLMEngine
from pdserve.engine.kernels import DENSE_FAMILIES
from pdserve.engine.model.attention import attention_families
from pdserve.engine.model.linear import Linear, cpu_families
from pdserve.engine.sampling.sampling_params import SamplingParams
from tests.engine.engines import GREEDY48, engine, prompts


@pytest.mark.parametrize("family", DENSE_FAMILIES)
def test_threads_changing_between_steps_change_no_token(tiny_model: Callable[[str], Path],
                                                       family: str) -> None:
    """Core sharing (worker/core_share.py) gives a worker 1 or 2 threads step by step: the
    same tokens and logprobs as at a fixed count, long contexts (attention split over
    threads) and chunked prompts included."""
    if family not in cpu_families(torch.bfloat16):
        pytest.skip(f"this CPU does not run the {family} GEMM family")
    path = tiny_model("llama-gqa")
    kw = {"dtype": "bfloat16", "linear_backend": f"cpu-{family}", "attention_backend": "cpu",
          "max_num_batched_tokens": 512, "num_threads": 2}
    params = SamplingParams(max_tokens=24, ignore_eos=True, logprobs=2, temperature=0.8, seed=5)

    def run(switch: bool) -> list[tuple[list[int], list[object]]]:
        eng = engine(path, **kw)
        ps = prompts(4, [1200, 40, 300, 7], eng.model_config.vocab_size, seed=9)
        for i, prompt in enumerate(ps):
            eng.add_request(f"r{i}", prompt, params)
        done: dict[str, tuple[list[int], list[object]]] = {}
        got: dict[str, list[int]] = {}
        lps: dict[str, list[object]] = {}
        for step in range(200):
            if switch:
                eng.set_num_threads(1 + step % 2)
            for out in eng.step().outputs:
                got.setdefault(out.request_id, []).extend(out.new_token_ids)
                lps.setdefault(out.request_id, []).extend(out.logprobs or [])
                if out.finished:
                    done[out.request_id] = (got[out.request_id], lps[out.request_id])
            if not eng.has_unfinished():
                break
        torch.set_num_threads(2)
        return [done[f"r{i}"] for i in range(4)]

    assert run(switch=True) == run(switch=False)


@pytest.mark.parametrize(("kind", "family"), [
    *(("linear", f) for f in DENSE_FAMILIES), *(("attention", f) for f in kernels.DENSE_FAMILIES)])
def test_every_kernel_family_is_batch_invariant(tiny_model: Callable[[str], Path], kind: str,
                                               family: str) -> None:
    """bfloat16 weights and cache forced onto each GEMM family, and each attention
    family, this CPU runs (the default picks only the fastest): a prompt's tokens
    alone, among 15 others, and chunked into 16-token steps are the same."""
    runs = cpu_families(torch.bfloat16) if kind == "linear" else attention_families("bfloat16")
    if family not in runs:
        pytest.skip(f"this CPU does not run the {family} {kind} family")
    path = tiny_model("llama-gqa")
    kw = {"dtype": "bfloat16", "linear_backend": "cpu", "attention_backend": "cpu",
          f"{kind}_backend": f"cpu-{family}"}
    eng = engine(path, **kw)
    ps = prompts(16, [5, 9, 17, 30, 64, 1, 100, 33], eng.model_config.vocab_size, seed=3)
    together = eng.generate(ps, GREEDY48)
    for i in (0, 6):
        assert eng.generate([ps[i]], GREEDY48)[0].token_ids == together[i].token_ids
    chunked = engine(path, max_num_batched_tokens=16, **kw).generate(ps[4:8], GREEDY48)
    assert [o.token_ids for o in chunked] == [o.token_ids for o in together[4:8]]


@pytest.mark.parametrize("family", ["avx512bf16", "amx"])
def test_fused_silu_mul_changes_no_token(tiny_model: Callable[[str], Path], family: str) -> None:
    """These families' gate/up layers write silu(gate) * up from the GEMM (192 gates:
    whole groups): an engine running them equals one made to run gemm then silu_mul."""
    if family not in cpu_families(torch.bfloat16):
        pytest.skip(f"this CPU does not run the {family} family")
    path = tiny_model("llama-gqa")
    fused, plain = (engine(path, "cpu", dtype="bfloat16", linear_backend=f"cpu-{family}")
                    for _ in range(2))
    fused.model.decoder = plain.model.decoder = None  # the loop, whose kernels these wrap
    layers = [layer.gate_up for layer in plain.model.layers]  # type: ignore[union-attr]
    assert all(gate_up.fused_silu_mul is not None for gate_up in layers)
    for gate_up in layers:
        gate_up.fused_silu_mul = None
    calls: list[int] = []
    for layer in fused.model.layers:
        kernel = layer.gate_up.fused_silu_mul  # type: ignore[union-attr]
        assert kernel is not None
        layer.gate_up.fused_silu_mul = (  # type: ignore[union-attr]
            lambda x, bf16_out, kernel=kernel: calls.append(len(x)) or kernel(x, bf16_out))
    ps = prompts(6, [5, 30, 64], fused.model_config.vocab_size, seed=8)
    assert [o.token_ids for o in fused.generate(ps, GREEDY48)] == \
        [o.token_ids for o in plain.generate(ps, GREEDY48)]
    assert calls  # the model went through the fused kernel


@pytest.mark.parametrize("family", ["avx512bf16", "amx"])
def test_bf16_handover_changes_no_logprob(tiny_model: Callable[[str], Path], family: str) -> None:
    """The norms and the fused gate/up hand these families' layers their inputs in
    bfloat16, rounded as the layers round them: tokens and logprobs equal an engine's
    that hands over float32 rows."""
    if family not in cpu_families(torch.bfloat16):
        pytest.skip(f"this CPU does not run the {family} family")
    path = tiny_model("llama-gqa")
    bf16, f32 = (engine(path, "cpu", dtype="bfloat16", linear_backend=f"cpu-{family}")
                 for _ in range(2))
    bf16.model.decoder = f32.model.decoder = None  # the loop, whose kernels these wrap
    for m in f32.model.modules():
        if isinstance(m, Linear):
            m.takes_bf16 = False
    seen: set[torch.dtype] = set()
    for layer in bf16.model.layers:
        for lin in (layer.qkv, layer.down):  # type: ignore[union-attr]
            assert lin.takes_bf16
            lin.kernel = (lambda x, kernel=lin.kernel: seen.add(x.dtype) or kernel(x))
    ps = prompts(6, [5, 30, 64], bf16.model_config.vocab_size, seed=9)
    params = SamplingParams(max_tokens=24, ignore_eos=True, logprobs=2)
    got, want = bf16.generate(ps, params), f32.generate(ps, params)
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    assert [o.logprobs for o in got] == [o.logprobs for o in want]
    assert seen == {torch.bfloat16}


class _Counted:
    """A fused decoder that counts its calls."""

    def __init__(self, inner: object) -> None:
        self.inner, self.calls = inner, 0

    def forward(self, *args: object) -> torch.Tensor:
        self.calls += 1
        return self.inner.forward(*args)  # type: ignore[attr-defined,no-any-return]


@pytest.mark.parametrize("quantization", ["none", "int8", "int4", "w8a8"])
def test_fused_decoder_equals_the_layer_loop(tiny_model: Callable[[str], Path],
                                             quantization: str) -> None:
    """The C++ decoder (every layer in one call, csrc/decoder.cpp) gives the tokens
    and logprobs of the Python loop over the layers, on every linear family this CPU
    runs, in steps that mix prefill chunks and decodes (biases included)."""
    if kernels.cpu_supported() is not None:
        pytest.skip("the cpu kernels run on x86-64 CPUs only")
    # qwen2-bias: the biases travel too; llama3-rope: sizes that int4 / int8 groups divide
    path = tiny_model("llama3-rope" if quantization in ("int8", "int4") else "qwen2-bias")
    dtypes = ["bfloat16", "float32"] if quantization == "none" else ["bfloat16"]
    params = SamplingParams(max_tokens=16, ignore_eos=True, logprobs=2)
    for dtype in dtypes:
        for family in cpu_families(getattr(torch, dtype)):
            kw = {"dtype": dtype, "linear_backend": f"cpu-{family}",
                  "quantization": quantization, "max_num_batched_tokens": 40}
            fused, loop = engine(path, "cpu", **kw), engine(path, "cpu", **kw)
            assert fused.model.decoder is not None, (dtype, family)
            counted = fused.model.decoder = _Counted(fused.model.decoder)
            loop.model.decoder = None
            ps = prompts(5, [3, 29, 64], fused.model_config.vocab_size, seed=12)
            got, want = fused.generate(ps, params), loop.generate(ps, params)
            assert [o.token_ids for o in got] == [o.token_ids for o in want], (dtype, family)
            assert [o.logprobs for o in got] == [o.logprobs for o in want], (dtype, family)
            assert counted.calls > 0


def test_attention_backend_resolves_to_a_family_for_the_cache(
        tiny_model: Callable[[str], Path]) -> None:
    """``cpu`` picks the fastest attention family for the KV cache's dtype; a forced
    family that cannot serve it is refused, naming why."""
    with pytest.raises(ValueError, match="attention_backend must be one of auto, torch, cpu, "):
        EngineConfig(attention_backend="cpu-avx512")
    if kernels.cpu_supported() is not None:
        pytest.skip("the cpu kernels run on x86-64 CPUs only")
    path = tiny_model("llama-gqa")
    assert engine(path, "cpu", dtype="bfloat16").attention_backend == \
        f"cpu-{attention_families('bfloat16')[-1]}"
    for kw in ({"dtype": "float32"}, {"dtype": "bfloat16", "kv_cache_dtype": "int8"}):
        assert engine(path, "cpu", **kw).attention_backend == "cpu-avx2"
        for family in ("avx512bf16", "amx"):
            with pytest.raises(ValueError, match=f"the {family} family needs a bfloat16 KV"):
                engine(path, "cpu", attention_backend=f"cpu-{family}", **kw)


@pytest.mark.parametrize(("dtype", "kv_cache_dtype"), [
    ("float32", "auto"), ("bfloat16", "auto"), ("bfloat16", "int8")])
@pytest.mark.parametrize("chunk", [2048, 16])
def test_prefill_kv_is_the_decode_steps_kv(tiny_model: Callable[[str], Path], dtype: str,
                                           kv_cache_dtype: str, chunk: int) -> None:
    """What a conversation's next turn relies on (a prefix cache hit on KV that decode
    steps wrote, a prefill worker recomputing an earlier answer): a prefill of prompt +
    answer writes, bit for bit, the KV the answer's decode steps wrote -- in one chunk
    or in many, at every dtype."""
    if kernels.cpu_supported() is not None:
        pytest.skip("the cpu kernels run on x86-64 CPUs only")
    path = tiny_model("llama-gqa")
    kw = {"dtype": dtype, "kv_cache_dtype": kv_cache_dtype}
    prompt = prompts(1, [37], 500, seed=13)[0]
    dec = engine(path, "cpu", **kw)
    dec.add_request("a", prompt, SamplingParams(max_tokens=64, ignore_eos=True))
    answer: list[int] = []
    while len(answer) < 30:  # a prefill step, then decode steps, one token each
        answer += [t for o in dec.step().outputs for t in o.new_token_ids]
    # the decode steps wrote the KV of every token but the last sampled one
    n = len(prompt) + len(answer) - 1
    pre = engine(path, "cpu", max_num_batched_tokens=chunk, **kw)
    pre.add_request("b", prompt + answer[:-1], SamplingParams(max_tokens=2, ignore_eos=True))
    while not pre.step().outputs:
        pass

    def rows(eng: LLMEngine, rid: str) -> torch.Tensor:
        bs = eng.config.block_size
        ids = eng.block_ids(rid)
        return torch.stack([eng.kv_cache[ids[p // bs], :, :, :, p % bs] for p in range(n)])

    assert torch.equal(rows(pre, "b"), rows(dec, "a"))


@pytest.mark.parametrize(("attention", "linear"), [("cpu", "torch"), ("torch", "cpu")])
def test_mixed_backends_agree_with_reference(tiny_model: Callable[[str], Path], attention: str,
                                             linear: str) -> None:
    if kernels.cpu_supported() is not None:
        pytest.skip(str(kernels.cpu_supported()))
    path = tiny_model("qwen2-bias")  # biases go through the kernels too
    ps = prompts(4, [5, 30, 64], 500, seed=21)
    ref = engine(path, "torch")
    mixed = engine(path, attention_backend=attention, linear_backend=linear)
    assert mixed.attention_backend == ("torch" if attention == "torch" else "cpu-avx2")  # float32
    assert mixed.linear_backend == ("torch" if linear == "torch" else "cpu-avx2")  # float32
    assert [o.token_ids for o in mixed.generate(ps, GREEDY48)] == \
        [o.token_ids for o in ref.generate(ps, GREEDY48)]


def test_bfloat16_kernels_track_float32(tiny_model: Callable[[str], Path]) -> None:
    """bf16 weights + KV with float32 activations (the kernels) stay as close to the
    float32 model's logits as bf16 weights allow, and closer than the all-bf16
    reference."""
    if kernels.cpu_supported() is not None:
        pytest.skip(str(kernels.cpu_supported()))
    path = tiny_model("llama-gqa")
    p = prompts(1, [40], 500, seed=23)[0]
    params = SamplingParams(max_tokens=1, logprobs=5)

    def top(eng: LLMEngine) -> list[tuple[int, float]]:
        return eng.generate([p], params)[0].logprobs[0].top

    exact = dict(top(engine(path, "torch")))
    fast = top(engine(path, "cpu", dtype="bfloat16"))
    ref = top(engine(path, "torch", dtype="bfloat16"))
    assert fast[0][0] == next(iter(exact))
    err_fast = max(abs(lp - exact[t]) for t, lp in fast if t in exact)
    err_ref = max(abs(lp - exact[t]) for t, lp in ref if t in exact)
    assert err_fast < 0.1 and err_fast <= err_ref * 1.5
