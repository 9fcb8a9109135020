"""Engine behaviour on tiny models: parity with transformers, batch invariance,
chunking, prefix cache, preemption, the disaggregated role API, bad input."""

from __future__ import annotations

import dataclasses
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
from tests.engine.handoff import hand_off

GREEDY48 = SamplingParams(max_tokens=48, ignore_eos=True)
PRESETS = ["llama-gqa", "llama-mha", "llama3-rope", "qwen2-bias", "mistral"]
BACKENDS = ["torch", "cpu"]


def prompts(n: int, lengths: list[int], vocab: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (lengths[i % len(lengths)],), generator=g).tolist()
            for i in range(n)]


DEVICE = {"name": "cpu"}  # --device (scripts/gpu_check.sh runs these tests on CUDA)


@pytest.fixture(autouse=True)
def _on_device(device: str) -> None:
    DEVICE["name"] = device


@pytest.fixture(params=BACKENDS)
def backend(request: pytest.FixtureRequest, device: str) -> str:
    """Every engine behaviour is checked on the reference and on the C++ kernels
    (on a GPU: the reference backends, on CUDA)."""
    if request.param == "cpu" and (device != "cpu" or kernels.cpu_supported() is not None):
        pytest.skip("the cpu kernels run on x86-64 CPUs only")
    return str(request.param)


def engine(path: Path, backend: str = "auto", **kw: object) -> LLMEngine:
    cfg = {"num_blocks": 256, "attention_backend": backend, "linear_backend": backend,
           "device": DEVICE["name"], **kw}
    return LLMEngine(path, EngineConfig(**cfg))  # type: ignore[arg-type]


def hf_greedy(path: Path, prompt: list[int], n: int) -> list[int]:
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    hf.generation_config.eos_token_id = None  # never stop, never mask: like ignore_eos
    ids = torch.tensor([prompt])
    out = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, do_sample=False)
    return out[0, len(prompt):].tolist()


@pytest.mark.parametrize("preset", PRESETS)
def test_greedy_matches_transformers(tiny_model: Callable[[str], Path], preset: str, backend: str) -> None:
    path = tiny_model(preset)
    eng = engine(path, backend, max_num_batched_tokens=64)  # the 100-token prompt is chunked
    ps = prompts(4, [3, 16, 41, 100], eng.model_config.vocab_size)
    outs = eng.generate(ps, GREEDY48)
    for p, o in zip(ps, outs, strict=True):
        assert o.token_ids == hf_greedy(path, p, 48), f"prompt of {len(p)} tokens"
    eng.check_integrity()


def test_batch_invariance(tiny_model: Callable[[str], Path], backend: str) -> None:
    eng = engine(tiny_model("llama-gqa"), backend)
    ps = prompts(16, [5, 9, 17, 30, 64, 1, 100, 33], eng.model_config.vocab_size, seed=3)
    together = eng.generate(ps, GREEDY48)
    alone = eng.generate([ps[6]], GREEDY48)[0]
    assert together[6].token_ids == alone.token_ids
    assert eng.generate([ps[0]], GREEDY48)[0].token_ids == together[0].token_ids


def test_chunked_prefill_equals_unchunked(tiny_model: Callable[[str], Path], backend: str) -> None:
    path = tiny_model("llama-gqa")
    ps = prompts(3, [70, 150, 33], 500, seed=5)
    whole = engine(path, backend, max_num_batched_tokens=2048).generate(ps, GREEDY48)
    chunked_engine = engine(path, backend, max_num_batched_tokens=16)
    chunked = chunked_engine.generate(ps, GREEDY48)
    assert [o.token_ids for o in chunked] == [o.token_ids for o in whole]
    chunked_engine.check_integrity()


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


def test_prefix_cache_hit_equals_miss(tiny_model: Callable[[str], Path], backend: str) -> None:
    path = tiny_model("llama-gqa")
    shared = prompts(1, [40], 500, seed=7)[0]
    a, b = shared + [11, 12, 13], shared + [21, 22]
    eng = engine(path, backend)
    eng.generate([a], GREEDY48)
    hit = eng.generate([b], GREEDY48)[0]
    assert hit.cached_tokens == 32  # two full blocks of the shared 40 tokens
    miss = engine(path, backend, enable_prefix_caching=False).generate([b], GREEDY48)[0]
    assert miss.cached_tokens == 0
    assert hit.token_ids == miss.token_ids
    # A prompt identical to a cached one still computes its last block.
    again = eng.generate([a], GREEDY48)[0]
    assert again.cached_tokens == 32
    eng.check_integrity()


def test_a_cache_salt_shares_blocks_only_with_its_own(tiny_model: Callable[[str], Path]) -> None:
    eng = engine(tiny_model("llama-gqa"))
    shared = prompts(1, [40], 500, seed=8)[0]

    def cached(tail: int, salt: str | None) -> int:
        params = dataclasses.replace(GREEDY48, max_tokens=2, cache_salt=salt)
        return eng.generate([shared + [tail]], params)[0].cached_tokens

    assert cached(1, "tenant-a") == 0
    assert cached(2, None) == 0 and cached(3, "tenant-b") == 0  # others: no hit
    assert cached(4, "tenant-a") == 32 and cached(5, None) == 32 and cached(6, "tenant-b") == 32
    eng.check_integrity()


def test_preempted_equals_uninterrupted(tiny_model: Callable[[str], Path], backend: str) -> None:
    path = tiny_model("llama-gqa")
    ps = prompts(6, [20, 28, 35], 500, seed=9)
    roomy = engine(path, backend).generate(ps, GREEDY48)
    tight = engine(path, backend, num_blocks=14)  # 6 x ~5 blocks do not fit: preemption
    squeezed = tight.generate(ps, GREEDY48)
    assert tight.scheduler.num_preemptions > 0
    assert [o.token_ids for o in squeezed] == [o.token_ids for o in roomy]
    tight.check_integrity()
    assert tight.pool.num_used == 0


def test_generate_refuses_a_prefill_role_engine(tiny_model: Callable[[str], Path]) -> None:
    """A prefill-role request never completes (it waits for hand-off), so ``generate``
    on one refuses at once, taking nothing; it used to loop for ever."""
    prefill = engine(tiny_model("llama-gqa"), role="prefill")
    with pytest.raises(ValueError, match="prefill-role"):
        prefill.generate([[5, 6, 7]], GREEDY48)
    assert not prefill.requests and prefill.pool.num_used == 0


def test_prefill_to_decode_handoff_equals_colocated(tiny_model: Callable[[str], Path], backend: str) -> None:
    path = tiny_model("llama-gqa")
    prompt = prompts(1, [37], 500, seed=11)[0]
    expected = engine(path, backend).generate([prompt], GREEDY48)[0].token_ids

    prefill = engine(path, backend, role="prefill")
    decode = engine(path, backend, role="decode", num_blocks=64)
    prefill.add_request("r", prompt, GREEDY48)
    outs = []
    while not outs:
        outs = prefill.step().outputs
    (first,) = outs
    assert first.prefilled and not first.finished and len(first.new_token_ids) == 1
    dest = decode.reserve("r", prompt, GREEDY48)
    assert dest is not None and len(dest) == 3
    hand_off(prefill, "r", decode, dest)
    prefill.release("r")
    prefill.check_integrity()
    assert prefill.pool.num_used == 0

    tokens = list(first.new_token_ids)
    decode.start_decode("r", first.new_token_ids[0])
    while decode.has_unfinished():
        for o in decode.step().outputs:
            tokens.extend(o.new_token_ids)
    assert tokens == expected
    decode.check_integrity()
    assert decode.pool.num_used == 0


def test_seed_gives_same_text_regardless_of_neighbours(tiny_model: Callable[[str], Path], backend: str) -> None:
    eng = engine(tiny_model("llama-gqa"), backend)
    ps = prompts(5, [8, 20, 3], 500, seed=13)
    seeded = SamplingParams(max_tokens=24, temperature=1.0, top_p=0.9, seed=1234,
                            ignore_eos=True)
    alone = eng.generate([ps[0]], seeded)[0]
    others = [SamplingParams(max_tokens=30, temperature=0.8, ignore_eos=True)] * 4
    crowd = eng.generate(ps[1:] + [ps[0]], [*others, seeded])[-1]
    assert crowd.token_ids == alone.token_ids
    different = eng.generate([ps[0]], SamplingParams(max_tokens=24, temperature=1.0,
                                                     top_p=0.9, seed=99, ignore_eos=True))[0]
    assert different.token_ids != alone.token_ids


def test_stop_string_and_logprobs(tiny_model: Callable[[str], Path], backend: str) -> None:
    eng = engine(tiny_model("llama-gqa"), backend)
    tok = eng.tokenizer
    assert tok is not None
    prompt = tok.encode("The quick brown fox")
    full = eng.generate([prompt], SamplingParams(max_tokens=40, ignore_eos=True, logprobs=3))[0]
    assert len(full.logprobs) == 40 and all(len(lp.top) == 3 for lp in full.logprobs)
    assert all(lp.token_id == t for lp, t in zip(full.logprobs, full.token_ids, strict=True))
    assert full.text == tok.decode(full.token_ids)
    stop = full.text[len(full.text) // 2 :][:3]
    assert stop.strip(), "generated text too short for a stop string"
    cut = eng.generate([prompt], SamplingParams(max_tokens=40, ignore_eos=True, stop=(stop,)))[0]
    assert cut.finish_reason == "stop"
    assert cut.text == full.text[: full.text.index(stop)]


# ------------------------------------------------------------------ bad input
def test_bad_input_is_rejected_and_engine_keeps_serving(
        tiny_model: Callable[[str], Path]) -> None:
    eng = engine(tiny_model("llama-gqa"), max_model_len=256)
    with pytest.raises(ValueError, match="empty"):
        eng.add_request("a", [], GREEDY48)
    with pytest.raises(ValueError, match="context"):
        eng.add_request("b", [5] * 300, GREEDY48)
    with pytest.raises(ValueError, match="max_tokens"):
        eng.add_request("c", [5] * 200, SamplingParams(max_tokens=100))
    with pytest.raises(ValueError, match="token ids"):
        eng.add_request("d", [5, 10**9], GREEDY48)
    with pytest.raises(ValueError, match="temperature"):
        SamplingParams(temperature=-1)
    with pytest.raises(ValueError, match="top_p"):
        SamplingParams(top_p=0)
    eng.add_request("ok", [5, 6, 7], GREEDY48)
    with pytest.raises(ValueError, match="already in use"):
        eng.add_request("ok", [5, 6, 7], GREEDY48)
    assert not eng.requests.keys() - {"ok"}
    done = []
    while eng.has_unfinished():
        done += [o for o in eng.step().outputs if o.finished]
    assert [o.request_id for o in done] == ["ok"] and len(eng.requests) == 0
    eng.check_integrity()


def test_abort_frees_blocks(tiny_model: Callable[[str], Path]) -> None:
    eng = engine(tiny_model("llama-gqa"))
    eng.add_request("x", list(range(3, 60)), GREEDY48)
    eng.step()
    out = eng.abort("x")
    assert out is not None and out.finished and out.finish_reason == "abort"
    assert eng.abort("x") is None  # idempotent
    assert eng.pool.num_used == 0 and not eng.has_unfinished()
    eng.check_integrity()


def test_admit_queues_only_what_fits_beside_the_queue(tiny_model: Callable[[str], Path]) -> None:
    eng = engine(tiny_model("llama-gqa"), num_blocks=10)  # 16-token blocks
    assert eng.admit("a", list(range(3, 83)), GREEDY48)  # 5 blocks of 10
    assert not eng.admit("b", list(range(3, 99)), GREEDY48)  # 6 more: 11 > 10
    assert not eng.has_request("b")  # refused: nothing queued
    assert eng.admit("c", list(range(3, 67)), GREEDY48)  # 4 more: 9
    with pytest.raises(ValueError):
        eng.admit("d", [], GREEDY48)  # never servable: an error, not "no room"
    assert not eng.has_request("d") and eng.has_request("a")
    eng.step()
    assert len(eng.computed_blocks("a")) in range(1, 6)
    assert eng.computed_blocks("a") == eng.block_ids("a")[:len(eng.computed_blocks("a"))]
    assert eng.computed_blocks("unknown") == []


def test_unknown_model_path_and_architecture(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="not found"):
        LLMEngine(tmp_path / "nope")
    (tmp_path / "config.json").write_text('{"architectures": ["GPT2LMHeadModel"]}')
    with pytest.raises(ValueError, match="GPT2LMHeadModel"):
        LLMEngine(tmp_path)


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


# ------------------------------------------------------------ prompt logprobs
def test_prompt_logprobs_match_transformers(tiny_model: Callable[[str], Path],
                                            backend: str) -> None:
    from transformers import AutoModelForCausalLM

    path = tiny_model("llama-gqa")
    prompt = prompts(1, [70], 500, seed=31)[0]
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    with torch.no_grad():
        ref = torch.log_softmax(hf(torch.tensor([prompt])).logits[0].float(), dim=-1)
    want = [float(ref[i, prompt[i + 1]]) for i in range(len(prompt) - 1)]
    # chunked (16 tokens a step) and scored only (max_tokens=0)
    eng = engine(path, backend, max_num_batched_tokens=16)
    out = eng.generate([prompt], SamplingParams(max_tokens=0, prompt_logprobs=2))[0]
    assert out.token_ids == [] and out.finish_reason == "length"
    assert out.prompt_logprobs is not None and out.prompt_logprobs[0] is None
    got = out.prompt_logprobs[1:]
    assert [lp.token_id for lp in got if lp] == prompt[1:]
    assert all(lp is not None and len(lp.top) == 2 for lp in got)
    torch.testing.assert_close(torch.tensor([lp.logprob for lp in got if lp]),
                               torch.tensor(want), rtol=1e-4, atol=1e-4)
    # with generation, and with a prefix already cached: the same numbers, once each
    eng.generate([prompt], GREEDY48)
    again = eng.generate([prompt], SamplingParams(max_tokens=3, prompt_logprobs=0,
                                                  ignore_eos=True))[0]
    assert again.cached_tokens == 0 and len(again.token_ids) == 3
    assert again.prompt_logprobs is not None
    assert [lp.logprob for lp in again.prompt_logprobs[1:] if lp] == \
        [lp.logprob for lp in got if lp]
    eng.check_integrity()


def test_prompt_logprobs_survive_preemption(tiny_model: Callable[[str], Path],
                                            backend: str) -> None:
    path = tiny_model("llama-gqa")
    ps = prompts(6, [20, 28, 35], 500, seed=9)
    params = SamplingParams(max_tokens=48, ignore_eos=True, prompt_logprobs=0)
    roomy = engine(path, backend).generate(ps, params)
    tight = engine(path, backend, num_blocks=14)
    squeezed = tight.generate(ps, params)
    assert tight.scheduler.num_preemptions > 0
    for a, b in zip(roomy, squeezed, strict=True):
        assert a.prompt_logprobs is not None and b.prompt_logprobs is not None
        assert len(b.prompt_logprobs) == len(a.prompt_logprobs)
        assert [x.logprob if x else None for x in b.prompt_logprobs] == \
            [x.logprob if x else None for x in a.prompt_logprobs]
