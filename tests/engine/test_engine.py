"""Engine behaviour on tiny models: parity with transformers, batch invariance,
chunking, prefix cache, preemption, the disaggregated role API, bad input, prompt
logprobs (the kernel families' checks: test_engine_kernels.py)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from pdserve.engine.engine import LLMEngine
from pdserve.engine.sampling.sampling_params import SamplingParams
from tests.engine.engines import GREEDY48, engine, prompts
from tests.engine.handoff import hand_off

PRESETS = ["llama-gqa", "llama-mha", "llama3-rope", "qwen2-bias", "mistral"]


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
