"""The attempt's state machine (``router/attempt.py``): its transitions, the
first-token hand-over in both orders (P's answer before and after the decode
worker's first delta), and the error an event its state does not allow raises;
the typed inbox; then P's answer after the decode worker's first tokens through a
real router and workers (the other order: test_inprocess.py's
test_first_token_streams_before_the_kv_hand_over)."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from pdserve.engine.config import EngineConfig
from pdserve.engine.engine import LLMEngine
from pdserve.engine.sampling.sampling_params import SamplingParams
from pdserve.failures import AttemptFailed, FailReason
from pdserve.messages import FirstToken, PrefillTask, RequestDelta, TokenLogprob
from pdserve.router.attempt import (
    Attempt,
    DeadlinePassed,
    IllegalTransition,
    Leg,
    Phase,
    PrefillAnswered,
    WorkerFailed,
)
from pdserve.router.fanout import Fanout, Inbox
from pdserve.router.router import Router
from pdserve.router.types import (
    ErrorKind,
    FinalChunk,
    GenerateRequest,
    RouterError,
    StreamChunk,
)
from tests.inprocess import Pair, run
from tests.waiting import until_async

AID = "r#0@router"


def lp(token_id: int) -> TokenLogprob:
    return TokenLogprob(token_id, -0.5, [(token_id, -0.5)])


def first(token_id: int | None, final: bool = False) -> FirstToken:
    return FirstToken(AID, token_id, None if token_id is None else lp(token_id), final,
                      num_cached_tokens=0, prefill_queue_s=0.0, prefill_s=0.0)


def delta(*tokens: int, finish: str | None = None) -> RequestDelta:
    return RequestDelta(AID, list(tokens), [lp(t) for t in tokens], finish_reason=finish)


def remote() -> Attempt:
    return Attempt("r", AID, "decode-0", remote=True)


def test_p_first_then_ds_copy_is_handed_over() -> None:
    """P's first token streams at once; the decode worker's first delta begins with its
    copy of that token (it came with the KV): the hand-over drops it, logprob too."""
    att = remote()
    assert (att.phase, att.leg) == (Phase.WAITING, Leg.PREFILLING)
    streamed = att.prefill_answered(first(7))
    assert streamed is not None and streamed.token_ids == [7]
    assert streamed.logprobs == [lp(7)]
    assert (att.phase, att.leg) == (Phase.FIRST_FROM_P, Leg.HANDING_OFF)
    out = att.delta(delta(7, 8))
    assert out.token_ids == [8] and out.logprobs == [lp(8)]
    assert att.phase is Phase.DECODING
    assert att.delta(delta(7)).token_ids == [7]  # only the first delta: a later 7 is a token
    att.handoff_answered()
    assert att.leg is Leg.HANDED_OFF
    final = att.delta(delta(9, finish="length"))
    assert final.token_ids == [9]
    att.finish(final)
    assert att.finished


def test_ds_first_delta_then_p_streams_nothing() -> None:
    """The decode worker's first delta (with its copy of P's token) came before P's
    answer: it is the stream, whole, and P's answer adds nothing to it."""
    att = remote()
    out = att.delta(delta(7, 8))
    assert out.token_ids == [7, 8] and out.logprobs == [lp(7), lp(8)]
    assert (att.phase, att.leg) == (Phase.DECODING, Leg.PREFILLING)
    assert att.prefill_answered(first(7)) is None
    assert (att.phase, att.leg) == (Phase.DECODING, Leg.HANDING_OFF)
    assert att.delta(delta(9)).token_ids == [9]


def test_a_final_first_token_waits_for_ds_final_delta() -> None:
    """P's first token ends the request by the engine's rules: it is not streamed from
    P; the decode worker's final delta brings it, whole."""
    att = remote()
    assert att.prefill_answered(first(7, final=True)) is None
    assert att.phase is Phase.WAITING
    out = att.delta(delta(7, finish="stop"))
    assert out.token_ids == [7]
    att.finish(out)
    assert att.finished


def test_a_prompt_p_only_scored_ends_the_attempt() -> None:
    """max_tokens=0: P answers without a token; the attempt ends with "length" and
    nothing was handed off."""
    att = remote()
    end = att.prefill_answered(first(None))
    assert end == RequestDelta(AID, [], finish_reason="length")
    assert (att.phase, att.leg) == (Phase.FINISHED, Leg.HANDED_OFF)


def test_a_colocated_attempt_streams_every_token() -> None:
    att = Attempt("r", AID, "colocated-0", remote=False)
    assert att.leg is Leg.NONE
    assert att.delta(delta()).token_ids == []  # no tokens: still waiting
    assert att.phase is Phase.WAITING
    assert att.delta(delta(7, 8)).token_ids == [7, 8]
    assert att.phase is Phase.DECODING


def test_an_error_delta_a_failure_and_the_deadline_end_the_attempt() -> None:
    err = RequestDelta(AID, [], finish_reason="error", failure=FailReason.TIMEOUT, error="slow")
    with pytest.raises(AttemptFailed) as failed:
        remote().delta(err)
    assert failed.value.reason is FailReason.TIMEOUT and "decode-0: slow" in failed.value.message
    with pytest.raises(AttemptFailed) as failed:
        remote().delta(err._replace(failure=None))
    assert failed.value.reason is FailReason.TRANSPORT
    with pytest.raises(AttemptFailed) as failed:
        remote().fail(WorkerFailed(FailReason.WORKER_DIED, "worker decode-0: gone"))
    assert failed.value.reason is FailReason.WORKER_DIED
    with pytest.raises(RouterError) as ended:
        remote().fail(DeadlinePassed())
    assert ended.value.kind is ErrorKind.DEADLINE and "request r passed" in str(ended.value)


def scored() -> Attempt:
    att = remote()
    att.prefill_answered(first(None))
    return att


def streamed_first() -> Attempt:
    att = remote()
    att.prefill_answered(first(7))
    return att


@pytest.mark.parametrize(("make", "event", "says"), [
    (streamed_first, lambda a: a.prefill_answered(first(7)), "P's first token in phase "
     "first_from_p, leg handing_off"),
    (remote, lambda a: a.handoff_answered(), "hand-off answer in phase waiting, leg prefilling"),
    (lambda: Attempt("r", AID, "colocated-0", remote=False),
     lambda a: a.prefill_answered(first(7)), "P's first token in phase waiting, leg none"),
    (scored, lambda a: a.delta(delta(7)), "a token delta in phase finished"),
    (scored, lambda a: a.fail(DeadlinePassed()), "a failure in phase finished"),
    (remote, lambda a: a.finish(delta(7)), "the end of the stream in phase waiting"),
    (streamed_first, lambda a: a.delta(delta(8, 9)), "first token 8 is not P's 7"),
])
def test_an_event_the_state_does_not_allow_raises(make: Callable[[], Attempt],
                                                  event: Callable[[Attempt], Any],
                                                  says: str) -> None:
    att = make()
    with pytest.raises(IllegalTransition, match=says):
        event(att)


def test_the_inbox_takes_a_workers_failure_only_for_attempts_on_it() -> None:
    async def main() -> None:
        fanout = Fanout()
        on_it, other = fanout.open("a#0@r", ("decode-0",)), fanout.open("b#0@r", ("decode-1",))
        fanout.deliver([RequestDelta("a#0@r", [5]), RequestDelta("gone#0@r", [6])])
        fanout.fail_worker("decode-0", FailReason.WORKER_DIED, "worker decode-0: died")
        assert await on_it.get() == RequestDelta("a#0@r", [5])
        assert await on_it.get() == WorkerFailed(FailReason.WORKER_DIED, "worker decode-0: died")
        other.push(DeadlinePassed())
        assert await other.get() == DeadlinePassed()

    asyncio.run(main())


@pytest.mark.parametrize("params", [
    SamplingParams(max_tokens=12, ignore_eos=True),
    SamplingParams(max_tokens=12, ignore_eos=True, logprobs=2),
    SamplingParams(max_tokens=12, ignore_eos=True, prompt_logprobs=1),
], ids=["tokens", "logprobs", "prompt_logprobs"])
def test_ps_answer_after_ds_first_tokens_streams_each_token_once(
        pair_factory: Callable[..., Pair], tiny_model: Callable[[str], Path],
        monkeypatch: pytest.MonkeyPatch, params: SamplingParams) -> None:
    """Through a real router, prefill and decode worker, the attempt's inbox made to
    hold the decode worker's first tokens (its copy of P's first token among them),
    then P's answer, then the rest: P's answer is held until those tokens reached the
    router, and the decode worker's engine waits after publishing them until P's
    answer is in the inbox. The client gets the engine's tokens and logprobs, none
    twice, and the prompt's logprobs (which only P's answer has) with the first chunk."""
    pair = pair_factory()
    p, d = pair.prefill[0], pair.decode[0]
    prompt = list(range(5, 45))
    want = LLMEngine(tiny_model("llama-gqa"), EngineConfig(num_blocks=64)).generate(
        [prompt], params)[0]
    seen: list[Any] = []  # every event pushed into an attempt's inbox
    answered = threading.Event()  # P's answer is in the inbox
    push, publish, prefill = Inbox.push, d.outputs.publish, p.prefill

    def recording(inbox: Inbox, event: Any) -> None:
        seen.append(event)
        if isinstance(event, PrefillAnswered):
            answered.set()
        push(inbox, event)

    def held(batch: list[RequestDelta]) -> None:  # on the decode worker's engine thread
        publish(batch)
        if any(delta.token_ids for delta in batch):
            answered.wait(30)

    async def late_prefill(task: PrefillTask) -> FirstToken:
        answer = await prefill(task)
        await until_async("the decode worker's first tokens at the router", lambda: any(
            isinstance(e, RequestDelta) and e.token_ids for e in seen))
        return answer

    monkeypatch.setattr(Inbox, "push", recording)
    d.outputs.publish = held  # type: ignore[method-assign]
    p.prefill = late_prefill  # type: ignore[method-assign]

    async def body(router: Router) -> None:
        chunks = [c async for c in router.generate(
            GenerateRequest("r", params, prompt_token_ids=prompt))]
        streamed = [c for c in chunks if isinstance(c, StreamChunk)]
        final = chunks[-1]
        assert isinstance(final, FinalChunk) and final.finish_reason == "length"
        assert [t for c in streamed for t in c.token_ids] == want.token_ids
        got = [lp.logprob for c in streamed for lp in c.logprobs]
        assert got == pytest.approx([lp.logprob for lp in want.logprobs], abs=1e-4)
        if params.prompt_logprobs is not None:
            assert want.prompt_logprobs is not None
            assert streamed[0].prompt_logprobs is not None
            assert [lp and lp.logprob for lp in streamed[0].prompt_logprobs] == pytest.approx(
                [lp and lp.logprob for lp in want.prompt_logprobs], abs=1e-4)
        order = [type(e).__name__ for e in seen
                 if isinstance(e, PrefillAnswered) or (isinstance(e, RequestDelta) and e.token_ids)]
        assert order[:3] == ["RequestDelta", "PrefillAnswered", "RequestDelta"]

    run(pair, body)
