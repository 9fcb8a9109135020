"""Tensor parallelism (engine/tp.py): ranks as spawned processes on gloo + shared
memory, greedy output equal to one rank's, shards that split what can be split, and a
rank that dies failing the engine with an error instead of a hang. ``--device cuda``
(scripts/gpu_check.sh) runs the TP=2 == TP=1 parity on two GPUs over NCCL."""

from __future__ import annotations

import dataclasses
import multiprocessing
import threading
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from pdserve.engine.config import EngineConfig, ModelConfig
from pdserve.engine.model.model import LlamaModel
from pdserve.engine.model.rope import RotaryEmbedding
from pdserve.engine.model.weights import load_weights, shard_cut
from pdserve.engine.sampling.sampling_params import SamplingParams
from pdserve.engine.tp.lockstep import close_link
from pdserve.engine.tp.shard import Shard, check_shardable
from pdserve.worker.tensor_parallel import create_engine
from tests.waiting import until

GREEDY = SamplingParams(max_tokens=12, ignore_eos=True)
PROMPTS = [[5 + (i * 7 + j) % 200 for j in range(3 + 23 * i)] for i in range(4)]


def generate(model: Path, tp: int, dtype: str = "float32", prompts: list[list[int]] = PROMPTS,
             device: str = "cpu", kv_cache_dtype: str = "auto") -> list[list[int]]:
    """Greedy outputs of a ``tp``-rank engine on ``device`` (CUDA: rank r on GPU r)."""
    engine = create_engine(model, EngineConfig(num_blocks=128, dtype=dtype, num_threads=1,
                                                  tensor_parallel_size=tp, device=device,
                                                  kv_cache_dtype=kv_cache_dtype))
    try:
        return [o.token_ids for o in engine.generate(prompts, GREEDY)]
    finally:
        engine.close()


def config(heads: int, kv: int, inter: int = 96, vocab: int = 1001) -> ModelConfig:
    base = ModelConfig.from_dict({
        "architectures": ["LlamaForCausalLM"], "vocab_size": vocab, "hidden_size": 64,
        "intermediate_size": inter, "num_hidden_layers": 1, "num_attention_heads": heads,
        "num_key_value_heads": kv}, name="m")
    return dataclasses.replace(base)


def test_shards_are_balanced_and_follow_the_kv_groups() -> None:
    cfg = config(9, 3)  # the default model's heads: 2 ranks get 1 and 2 KV groups
    s0, s1 = (Shard.of(cfg, r, 2) for r in range(2))
    assert (s0.kv_heads, s0.q_heads, s1.kv_heads, s1.q_heads) == ((0, 1), (0, 3), (1, 3), (3, 9))
    assert (s0.inter, s1.inter) == ((0, 48), (48, 96))
    assert (s0.vocab, s1.vocab) == ((0, 501), (501, 1001))  # padded to 501 each
    assert s1.local_config(cfg).vocab_size == 501
    # Fewer KV heads than ranks: each KV head is replicated on the ranks reading it.
    shards = [Shard.of(config(4, 2), r, 4) for r in range(4)]
    assert [s.kv_heads for s in shards] == [(0, 1), (0, 1), (1, 2), (1, 2)]
    assert [s.q_heads for s in shards] == [(0, 1), (1, 2), (2, 3), (3, 4)]
    assert Shard.widest_kv(cfg, 2).num_kv_heads == 2


@pytest.mark.parametrize("preset", ["llama-gqa", "qwen2-bias"])
def test_a_rank_loads_its_slices_of_the_checkpoint(tiny_model: Callable[[str], Path],
                                                   preset: str) -> None:
    """``shard_cut``: rank 1 of 2 reads its rows / columns of every tensor (and its
    vocabulary rows, zero-padded) -- equal to slicing the whole model it never loads."""
    model_dir = tiny_model(preset)
    cfg = ModelConfig.from_dir(model_dir)
    rotary = RotaryEmbedding(cfg.rope, cfg.head_dim, 64, torch.float32)
    full = LlamaModel(cfg, rotary)
    load_weights(full, model_dir)
    shard = Shard.of(cfg, 1, 2)
    part = LlamaModel(shard.local_config(cfg), rotary)
    load_weights(part, model_dir, shard_cut(shard, cfg.head_dim))
    d, (q0, q1), (k0, k1), (i0, i1) = cfg.head_dim, shard.q_heads, shard.kv_heads, shard.inter
    qs, ks, vs = full.layers[0].qkv.weight.split(
        [cfg.num_heads * d, cfg.num_kv_heads * d, cfg.num_kv_heads * d])
    layer = part.layers[0]
    assert torch.equal(layer.qkv.weight, torch.cat(
        [qs[q0 * d : q1 * d], ks[k0 * d : k1 * d], vs[k0 * d : k1 * d]]))
    assert torch.equal(layer.o.weight, full.layers[0].o.weight[:, q0 * d : q1 * d])
    assert torch.equal(layer.down.weight, full.layers[0].down.weight[:, i0:i1])
    inter = cfg.intermediate_size
    gu = full.layers[0].gate_up.weight
    assert torch.equal(layer.gate_up.weight, torch.cat([gu[i0:i1], gu[inter + i0 : inter + i1]]))
    v0, v1 = shard.vocab
    assert torch.equal(part.embed.weight[: v1 - v0], full.embed.weight[v0:v1])
    assert not part.embed.weight[v1 - v0 :].any()  # padding rows past the vocabulary
    if layer.qkv.bias is not None:
        assert torch.equal(layer.qkv.bias[: (q1 - q0) * d], full.layers[0].qkv.bias[q0 * d : q1 * d])


def test_what_cannot_be_split_is_refused_naming_it() -> None:
    with pytest.raises(ValueError, match=r"fewer KV heads \(2\) than ranks"):
        check_shardable(config(4, 2), 3)
    with pytest.raises(ValueError, match="more than the MLP width"):
        check_shardable(config(4, 4, inter=2), 4)
    with pytest.raises(ValueError, match="tensor_parallel_size must be >= 1"):
        EngineConfig(tensor_parallel_size=0)


@pytest.mark.parametrize("preset", ["llama-gqa", "llama-mha"])
@pytest.mark.parametrize("dtype", ["float32", "auto"])
def test_two_ranks_equal_one(tiny_model: Callable[[str], Path], preset: str, dtype: str,
                             device: str) -> None:
    if device == "cuda" and torch.cuda.device_count() < 2:
        pytest.skip(f"TP=2 on CUDA needs 2 GPUs, this machine has {torch.cuda.device_count()}")
    model = tiny_model(preset)
    assert generate(model, 2, dtype, device=device) == generate(model, 1, dtype, device=device)


def test_two_ranks_on_int8_kv_caches_equal_one(tiny_model: Callable[[str], Path]) -> None:
    """Each rank quantizes its own KV heads' rows (a scale per token and head), so the
    split changes nothing."""
    model = tiny_model("llama-gqa")
    assert generate(model, 2, kv_cache_dtype="int8") == generate(model, 1, kv_cache_dtype="int8")


def test_four_ranks_with_replicated_kv_heads(tiny_model: Callable[[str], Path]) -> None:
    model = tiny_model("llama-gqa")  # 2 KV heads over 4 ranks
    assert generate(model, 4) == generate(model, 1)


def test_default_model_fp32_two_ranks_equal_one(default_model_dir: Path) -> None:
    """SmolLM2-135M: 9 query / 3 KV heads split 3+6 / 1+2 (uneven but exact)."""
    prompts = PROMPTS[:2]
    assert generate(default_model_dir, 2, prompts=prompts) == \
        generate(default_model_dir, 1, prompts=prompts)


def test_ranks_stop_alike_on_every_end_token(tiny_model: Callable[[str], Path]) -> None:
    """The tiny model's ends: config.json's 2, and 0 and <|im_end|> from its generation
    config and tokenizer. A request that samples 0 stops on every rank (a follower
    that knew only config.json's ends ran on alone, and the next step's collectives
    no longer matched), and the ranks stay in step."""
    model = tiny_model("llama-gqa")
    eng = create_engine(model, EngineConfig(
        num_blocks=64, attention_backend="torch", linear_backend="torch", num_threads=1,
        tensor_parallel_size=2))
    try:
        ends = SamplingParams(max_tokens=20, min_tokens=3, logit_bias={0: 100.0})
        out = eng.generate([[5, 6, 7], [8, 9, 10, 11]], [ends, SamplingParams(max_tokens=12)])
        assert out[0].token_ids[-1] == 0 and len(out[0].token_ids) == 4
        assert out[0].finish_reason == "stop" and len(out[1].token_ids) == 12
        eng.generate([[5, 6, 7]], SamplingParams(max_tokens=3))  # ranks still in step
    finally:
        eng.close()


def test_a_dead_rank_fails_the_engine(tiny_model: Callable[[str], Path]) -> None:
    engine = create_engine(tiny_model("llama-gqa"), EngineConfig(
        num_blocks=64, num_threads=1, tensor_parallel_size=2))
    try:
        engine.generate([PROMPTS[0]], GREEDY)  # works while both ranks live
        engine._followers[0].kill()
        engine._followers[0].join(30)
        with pytest.raises(RuntimeError, match="rank 1"):
            engine.generate([PROMPTS[1]], GREEDY)
    finally:
        engine.close()


def test_every_engine_method_is_replicated_or_says_why_not() -> None:
    """A public engine method that changes state and is not ``@replicated`` would leave
    the followers behind the leader: each is one or the other, never both."""
    from pdserve.engine.engine import LLMEngine
    from pdserve.engine.tp.lockstep import REPLICATED

    public = {n for cls in LLMEngine.__mro__[:-1]  # its mixins' too, not object's
              for n, v in vars(cls).items() if callable(v) and not n.startswith("_")}
    assert {"reserve", "empty_blocks", "step"} <= public
    assert public >= REPLICATED
    assert not REPLICATED & LLMEngine.NOT_REPLICATED.keys()
    unclassified = public - REPLICATED - LLMEngine.NOT_REPLICATED.keys()
    assert not unclassified, f"mark these @replicated or list them in NOT_REPLICATED: " \
        f"{sorted(unclassified)}"
    assert {"add_request", "step", "abort", "reserve", "release"} <= REPLICATED


def test_a_follower_replays_only_replicated_methods() -> None:
    """What the leader broadcasts is checked against the replicated names: anything
    else is a leader out of step, not a method to look up by name. Each message says
    how the leader's previous call ended: bad input refused on every rank is replayed
    as refused; a rank whose call ended otherwise than the leader's stops, loudly."""
    from pdserve.engine.tp.lockstep import STOP, follow

    Call = tuple[str, tuple[object, ...], dict[str, object], str | None]

    class Channel:  # what TPGroup.broadcast_object hands a follower, from a list
        rank = 1

        def __init__(self, calls: list[Call]) -> None:
            self.calls = calls

        def broadcast_object(self) -> Call:
            return self.calls.pop(0)

    class Follower:
        def __init__(self, calls: list[Call]) -> None:
            self.tp = Channel(calls)
            self.done: list[str] = []

        def release(self, request_id: str) -> None:
            if request_id == "bad":
                raise ValueError("no request 'bad'")
            self.done.append(request_id)

        def close(self) -> None:
            raise AssertionError("never replayed")

    f = Follower([("release", ("r1",), {}, None), ("release", ("bad",), {}, None),
                  ("release", ("r2",), {}, "no request 'bad'"), (STOP, (), {}, None)])
    follow(f)
    assert f.done == ["r1", "r2"]
    with pytest.raises(RuntimeError, match="'close', which is not a replicated engine method"):
        follow(Follower([("close", (), {}, None)]))
    with pytest.raises(RuntimeError, match=r"rank 1 is out of step with the leader: its last "
                       r"call raised ValueError\(\"no request 'bad'\"\), the leader's succeeded"):
        follow(Follower([("release", ("bad",), {}, None), (STOP, (), {}, None)]))
    with pytest.raises(RuntimeError, match="its last call succeeded, the leader's raised"):
        follow(Follower([("release", ("r1",), {}, None), (STOP, (), {}, "boom")]))


def test_bad_input_is_refused_on_every_rank_and_serving_goes_on(
        tiny_model: Callable[[str], Path]) -> None:
    """A replicated call that the leader refuses (``ValueError``: a request id in use)
    is refused by the follower too, which checks that against the leader's outcome;
    the ranks stay in step and later requests are exact."""
    model = tiny_model("llama-gqa")
    want = generate(model, 1, prompts=PROMPTS[:2])
    engine = create_engine(model, EngineConfig(num_blocks=64, num_threads=1,
                                               tensor_parallel_size=2))
    try:
        engine.add_request("dup", PROMPTS[0], GREEDY)
        with pytest.raises(ValueError, match="already in use"):
            engine.add_request("dup", PROMPTS[1], GREEDY)
        engine.abort("dup")
        assert [o.token_ids for o in engine.generate(PROMPTS[:2], GREEDY)] == want
        assert all(p.is_alive() for p in engine._followers)
    finally:
        engine.close()


def test_closing_a_link_that_a_thread_reads_ends_it_for_the_follower() -> None:
    """The leader's end of a follower's pipe is read by its KV channel's thread when
    the engine closes: ``close_link`` must still end the pipe for the follower (whose
    channel thread waits for that end-of-file before its process exits: a plain
    ``close`` left it waiting 10 s per TP worker) and for that reader."""
    mine, theirs = multiprocessing.Pipe()
    reader_saw: list[BaseException] = []

    def read() -> None:
        try:
            mine.recv()
        except (EOFError, OSError) as exc:
            reader_saw.append(exc)

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    until("the reader runs", reader.is_alive)
    close_link(mine)
    try:
        assert theirs.poll(5)  # readable: at end-of-file
        with pytest.raises(EOFError):
            theirs.recv()
        reader.join(5)
        assert reader_saw and not reader.is_alive()
    finally:
        theirs.close()
