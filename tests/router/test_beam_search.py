"""Beam search (``router/api/beam_search.py``) against a model whose next-token
distribution is a table: where the width covers every continuation it is exhaustive,
so its answer must be the best sequences found by listing them all; through the HTTP
API on the tiny model, width 1 is greedy decoding and what it cannot honour is a 400."""

from __future__ import annotations

import asyncio
import itertools
import math
from collections.abc import AsyncIterator, Callable
from typing import Any

import pytest

from pdserve.engine.sampling.sampling_params import SamplingParams
from pdserve.messages import TokenLogprob
from pdserve.router.api.beam_search import beam_search
from pdserve.router.types import FinalChunk, GenerateRequest, StreamChunk, Usage
from tests.inprocess import Pair
from tests.router.http_helpers import GREEDY, Client, serve, wait_freed

EOS = 0
VOCAB = 3


def table(last: int) -> list[float]:
    """The next token's logprobs after ``last``: a fixed, uneven distribution."""
    weights = [(1 + (last * 7 + t * 3) % 5) for t in range(VOCAB)]
    total = sum(weights)
    return [math.log(w / total) for w in weights]


class TableRouter:
    """Answers a request of one token with the table's top-N, best first."""

    tokenizer: Any = None

    def __init__(self) -> None:
        self.calls = 0

    async def generate(self, req: GenerateRequest) -> AsyncIterator[StreamChunk | FinalChunk]:
        self.calls += 1
        ids = req.prompt_token_ids or []
        lps = table(ids[-1])
        top = sorted(enumerate(lps), key=lambda x: -x[1])[: req.params.logprobs]
        yield StreamChunk([top[0][0]], "", [TokenLogprob(top[0][0], top[0][1], top)])
        yield FinalChunk("length", Usage(len(ids), 1))


def exhaustive(prompt: list[int], max_tokens: int, width: int, penalty: float,
               ignore_eos: bool) -> list[tuple[list[int], float]]:
    """Every output of up to ``max_tokens`` tokens (ending at EOS unless ignore_eos),
    best ``width`` by the beam score."""
    outs = []
    for n in range(1, max_tokens + 1):
        for seq in itertools.product(range(VOCAB), repeat=n):
            eos_at = [i for i, t in enumerate(seq) if t == EOS]
            finished = bool(eos_at) and not ignore_eos
            if finished and eos_at[0] != n - 1:
                continue  # went on after EOS
            if not finished and n < max_tokens:
                continue  # a live beam runs to max_tokens
            lp, last = 0.0, prompt[-1]
            for t in seq:
                lp += table(last)[t]
                last = t
            # vLLM's score: the length counts the prompt, not a final EOS
            outs.append((list(seq), lp, lp / (len(prompt) + n - finished) ** penalty))
    best = sorted(outs, key=lambda o: o[2], reverse=True)[:width]
    return [(tokens, lp) for tokens, lp, _ in best]


@pytest.mark.parametrize(("ignore_eos", "penalty"), [(True, 1.0), (False, 1.0), (False, 0.0),
                                                     (False, 2.5)])
def test_a_width_that_covers_everything_finds_the_best_sequences(ignore_eos: bool,
                                                                 penalty: float) -> None:
    prompt, max_tokens = [1, 2], 3
    width = VOCAB ** 2  # every sequence of the first two steps stays a beam
    router = TableRouter()
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=ignore_eos, logprobs=1)
    req = GenerateRequest("r", params, prompt_token_ids=prompt)
    beams = asyncio.run(beam_search(router, req, prompt, width, penalty,  # type: ignore[arg-type]
                                    frozenset({EOS}), set()))
    got = [(b.tokens, b.cum_logprob) for b in beams]
    want = exhaustive(prompt, max_tokens, width, penalty, ignore_eos)
    assert [t for t, _ in got] == [t for t, _ in want]
    assert [lp for _, lp in got] == pytest.approx([lp for _, lp in want])
    for b in beams:  # each token's logprob, and the finished ones end at EOS
        assert [lp.token_id for lp in b.logprobs] == b.tokens
        assert sum(lp.logprob for lp in b.logprobs) == pytest.approx(b.cum_logprob)
        assert b.finished == (not ignore_eos and b.tokens[-1] == EOS)
    assert router.calls <= 1 + width * (max_tokens - 1)  # one request per beam per step


def test_beam_search_over_http(pair_factory: Callable[..., Pair]) -> None:
    pair = pair_factory()
    base = {**GREEDY, "prompt": "hello there", "max_tokens": 8, "use_beam_search": True}

    async def body(c: Client) -> None:
        greedy = (await c.post("/v1/completions", json={**base, "use_beam_search": False}))
        one = await c.post("/v1/completions", json=base)
        assert one.status_code == 200, one.text
        assert one.json()["choices"][0]["text"] == greedy.json()["choices"][0]["text"]
        r = await c.post("/v1/completions", json={**base, "n": 3, "logprobs": 0,
                                                  "length_penalty": 0.5})
        assert r.status_code == 200, r.text
        choices = r.json()["choices"]
        assert len(choices) == 3 and len({c["text"] for c in choices}) == 3
        plen = r.json()["usage"]["prompt_tokens"]
        scores = [sum(c["logprobs"]["token_logprobs"]) / (plen + len(c["logprobs"]["tokens"]))
                  ** 0.5 for c in choices]
        assert scores == sorted(scores, reverse=True)
        assert r.json()["usage"]["completion_tokens"] == sum(
            len(c["logprobs"]["tokens"]) for c in choices)
        chat = await c.post("/v1/chat/completions", json={
            **GREEDY, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "n": 2,
            "use_beam_search": True})
        assert chat.status_code == 200 and len(chat.json()["choices"]) == 2, chat.text
        for extra, words in (({"stream": True}, "stream"), ({"n": 11}, "n (its width)"),
                             ({"stop": ["x"]}, "stop"), ({"echo": True}, "echo"),
                             ({"logit_bias": {"5": 1}}, "logit_bias"),
                             ({"guided_regex": "a+"}, "guided_regex")):
            r = await c.post("/v1/completions", json={**base, **extra})
            err = r.json()["error"]
            assert r.status_code == 400 and err["param"] == "use_beam_search", (extra, r.text)
            assert words in err["message"], err
        r = await c.post("/v1/completions", json={**base, "length_penalty": "1"})
        assert r.status_code == 400 and r.json()["error"]["param"] == "length_penalty"
        r = await c.post("/v1/responses", json={**GREEDY, "input": "x", "use_beam_search": True})
        assert r.status_code == 400 and r.json()["error"]["param"] == "use_beam_search"
        await wait_freed(pair)

    serve(pair, body)
