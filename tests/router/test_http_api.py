"""The OpenAI HTTP API (``router/http/app.py``) on uvicorn (port 0) over a real
in-process router with prefill/decode workers (local transfer): what it serves."""

from __future__ import annotations

import asyncio
import json
import re
from collections.abc import Callable
from typing import Any

from prometheus_client import CollectorRegistry

from pdserve.router.http.app import build_app, start_http_server
from pdserve.router.openai.response_objects import TokenText
from tests.inprocess import Pair
from tests.router.http_helpers import GREEDY, Client, serve, sse, wait_freed
from tests.waiting import until_async


def test_completions_and_chat(pair_factory: Callable[..., Pair]) -> None:
    pair = pair_factory()

    async def body(c: Client) -> None:
        req = {**GREEDY, "prompt": [5, 6, 7, 8], "max_tokens": 10, "logprobs": 2}
        r = await c.post("/v1/completions", json=req, headers={"X-Request-Id": "req-1"})
        assert r.status_code == 200 and r.headers["x-request-id"] == "req-1"
        whole = r.json()
        assert whole["id"] == "cmpl-req-1" and whole["object"] == "text_completion"
        choice = whole["choices"][0]
        assert choice["finish_reason"] == "length"
        assert whole["usage"] == {"prompt_tokens": 4, "completion_tokens": 10, "total_tokens": 14,
                                  "prompt_tokens_details": {"cached_tokens": 0}}
        lp = choice["logprobs"]
        assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["text_offset"]) >= 9
        for token, logprob, top in zip(lp["tokens"], lp["token_logprobs"], lp["top_logprobs"],
                                       strict=True):
            assert top[token] == logprob and len(top) <= 3 and logprob <= 0

        events = await sse(c, "/v1/completions", {**req, "stream": True,
                                                  "stream_options": {"include_usage": True}})
        assert events[-1] == "[DONE]" and events[-2]["choices"] == []
        assert events[-2]["usage"] == whole["usage"]
        assert "".join(e["choices"][0]["text"] for e in events[:-2]) == choice["text"]
        assert events[-3]["choices"][0]["finish_reason"] == "length"
        assert all(e["usage"] is None for e in events[:-2])
        # vLLM's continuous_usage_stats: every chunk its choice's usage so far
        for path, body in (("/v1/completions", req), ("/v1/chat/completions", {
                **GREEDY, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 10,
                "n": 2})):
            events = await sse(c, path, {**body, "stream": True, "stream_options": {
                "include_usage": True, "continuous_usage_stats": True}})
            so_far = [0, 0]
            for e in events[:-2]:
                u, index = e["usage"], e["choices"][0]["index"]
                assert u["completion_tokens"] >= so_far[index] and u["prompt_tokens"] > 0, e
                assert u["total_tokens"] == u["prompt_tokens"] + u["completion_tokens"]
                so_far[index] = u["completion_tokens"]
            assert so_far[: body.get("n", 1)] == [10] * body.get("n", 1)
            assert events[-2]["usage"]["completion_tokens"] == 10 * body.get("n", 1)

        chat = {**GREEDY, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 6,
                "logprobs": True, "top_logprobs": 2}
        whole = (await c.post("/v1/chat/completions", json=chat)).json()
        assert whole["object"] == "chat.completion"
        message = whole["choices"][0]["message"]
        assert message["role"] == "assistant"
        for entry in whole["choices"][0]["logprobs"]["content"]:
            assert len(entry["top_logprobs"]) == 2 and isinstance(entry["bytes"], list)
        # prompt_tokens: the chat template applied by the router
        tok = pair.router.tokenizer
        assert whole["usage"]["prompt_tokens"] == len(
            tok.apply_chat_template(chat["messages"]))  # type: ignore[arg-type]
        events = await sse(c, "/v1/chat/completions", {**chat, "stream": True})
        assert events[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
        assert events[-1] == "[DONE]" and "usage" not in events[-2]
        text = "".join(e["choices"][0]["delta"].get("content", "") for e in events[:-1])
        assert text == message["content"]

        models = (await c.get("/v1/models")).json()
        assert models["data"][0]["id"] == "tiny" and models["data"][0]["max_model_len"] == 2048
        assert (await c.get("/health")).status_code == 200
        metrics = (await c.get("/metrics")).text
        assert 'pdserve_requests_total{model="tiny",role="router",status="length"} 7.0' in metrics

    serve(pair, body)


def test_every_output_token_has_logprobs(pair_factory: Callable[..., Pair]) -> None:
    async def body(c: Client) -> None:
        r = await c.post("/v1/completions", json={**GREEDY, "prompt": "a", "max_tokens": 4,
                                                  "logprobs": 1})
        assert len(r.json()["choices"][0]["logprobs"]["tokens"]) == 4

    serve(pair_factory(), body)


def test_disconnect_aborts_on_both_workers(pair_factory: Callable[..., Pair]) -> None:
    pair = pair_factory()
    long = {**GREEDY, "prompt": [5] * 40, "max_tokens": 1500}

    async def body(c: Client) -> None:
        async with c.stream("POST", "/v1/completions", json={**long, "stream": True}) as r:
            got = 0
            async for line in r.aiter_lines():
                got += line.startswith("data: ")
                if got == 3:
                    break  # leaving the block closes the connection mid-stream
        await wait_freed(pair)
        # not streamed: the client gives up while the request runs
        task = asyncio.create_task(c.post("/v1/chat/completions", json={
            **GREEDY, "max_tokens": 1500, "messages": [{"role": "user", "content": "x"}]}))
        await until_async("the request to run on the decode worker",
                          lambda: any(w.engine.pool.num_used for w in pair.decode))
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        await wait_freed(pair)
        r = await c.post("/v1/completions", json={**GREEDY, "prompt": "ok", "max_tokens": 3})
        assert r.json()["usage"]["completion_tokens"] == 3

    serve(pair, body)


def test_a_request_cancelled_while_reserving_frees_its_blocks(
        pair_factory: Callable[..., Pair]) -> None:
    """A batch whose second prompt is refused (empty) fails at once, cancelling the first
    choice while its reservation is on its way to the decode worker: the router aborts
    it there too, so its blocks are free long before the KV timeout (60 s) would free
    them (before the fix: only then)."""
    pair = pair_factory(kv_timeout_s=60)

    async def body(c: Client) -> None:
        for _ in range(3):
            r = await c.post("/v1/completions", json={**GREEDY, "prompt": ["a b c", ""]})
            assert r.status_code == 400, r.text
            await wait_freed(pair)

    serve(pair, body)


def test_stop_ends_open_streams_cleanly(pair_factory: Callable[..., Pair]) -> None:
    pair = pair_factory()

    async def main() -> None:
        await pair.router.start()
        server, port = await start_http_server(
            build_app(pair.router, "tiny", CollectorRegistry()), "127.0.0.1", 0, grace_s=5)
        try:
            async with Client(base_url=f"http://127.0.0.1:{port}", timeout=60) as c, c.stream(
                    "POST", "/v1/completions", json={**GREEDY, "prompt": [5] * 20,
                                                     "max_tokens": 1500, "stream": True}) as r:
                lines = r.aiter_lines()
                while not (await anext(lines)).startswith("data: "):
                    pass
                stopping = asyncio.create_task(server.stop())
                rest = [line async for line in lines if line.startswith("data: ")]
                await stopping
            assert rest[-1] == "data: [DONE]"
            assert json.loads(rest[-2][6:])["error"]["code"] == "not_ready"
            await wait_freed(pair)
        finally:
            await pair.router.stop()

    asyncio.run(main())


def test_n_choices_share_one_prefill(pair_factory: Callable[..., Pair]) -> None:
    """Choices 1.. start after choice 0's first token: the prompt's full blocks are
    computed once and the other choices find them in a prefix cache -- the prefill
    worker's, or the decode worker's when choice 0's KV has landed there first (it then
    computes the short rest itself: which one depends on timing)."""
    pair = pair_factory(n_prefill=2)
    prompt = list(range(10, 74))  # 64 tokens: 4 full blocks

    async def body(c: Client) -> None:
        r = await c.post("/v1/completions", json={**GREEDY, "prompt": prompt, "max_tokens": 5,
                                                  "n": 3})
        assert r.status_code == 200, r.text
        texts = [ch["text"] for ch in r.json()["choices"]]
        assert len(texts) == 3 and len(set(texts)) == 1  # greedy: the same three times
        hits = sum(w.engine.pool.prefix_hits for w in [*pair.prefill, *pair.decode])
        assert hits >= 2 * 3, hits  # choices 1 and 2 reused at least 3 of the 4 blocks
        await wait_freed(pair)

    serve(pair, body)


def test_a_predicted_output_is_drafted_and_changes_nothing(
        pair_factory: Callable[..., Pair]) -> None:
    """OpenAI's ``prediction`` (text, or text parts): accepted, the answer the one without
    it, usage with the drafted tokens accepted and rejected; a malformed one is a 400."""
    pair = pair_factory()
    chat = {**GREEDY, "messages": [{"role": "user", "content": "copy"}], "max_tokens": 24}

    async def body(c: Client) -> None:
        plain = (await c.post("/v1/chat/completions", json=chat)).json()
        text = plain["choices"][0]["message"]["content"]
        assert "completion_tokens_details" not in plain["usage"]
        half = len(text) // 2
        for content in (text, [{"type": "text", "text": text[:half]},
                               {"type": "text", "text": text[half:]}]):
            r = await c.post("/v1/chat/completions", json={
                **chat, "prediction": {"type": "content", "content": content}})
            assert r.status_code == 200, r.text
            got = r.json()
            assert got["choices"][0]["message"]["content"] == text
            # (the tiny model's tokens need not be the ones its text encodes to: how
            # many are accepted is tests/integration/test_inprocess.py's business)
            details = got["usage"]["completion_tokens_details"]
            assert set(details) == {"accepted_prediction_tokens", "rejected_prediction_tokens"}
            assert got["usage"]["completion_tokens"] == plain["usage"]["completion_tokens"]
        events = await sse(c, "/v1/chat/completions", {
            **chat, "stream": True, "stream_options": {"include_usage": True},
            "prediction": {"type": "content", "content": "something else entirely"}})
        assert "".join(e["choices"][0]["delta"].get("content", "")
                       for e in events[:-2]) == text
        assert set(events[-2]["usage"]["completion_tokens_details"]) == set(details)
        for bad in ({"type": "text", "content": text}, {"type": "content"},
                    {"type": "content", "content": []}, "text"):
            r = await c.post("/v1/chat/completions", json={**chat, "prediction": bad})
            assert r.status_code == 400, (bad, r.text)
            assert r.json()["error"]["param"].startswith("prediction"), r.json()
        await wait_freed(pair)

    serve(pair, body)


def test_vllms_token_controls(pair_factory: Callable[..., Pair]) -> None:
    """allowed_token_ids, bad_words, skip_special_tokens, truncate_prompt_tokens,
    return_tokens_as_token_ids, prompt_logprobs, return_token_ids and cache_salt reach the
    engine and the response."""
    pair = pair_factory()
    tok = pair.router.tokenizer
    base = {**GREEDY, "prompt": "hello there", "max_tokens": 12}

    async def ids_of(c: Client, req: dict[str, Any]) -> tuple[list[int], dict[str, Any]]:
        r = await c.post("/v1/completions", json={**req, "logprobs": 1,
                                                  "return_tokens_as_token_ids": True})
        assert r.status_code == 200, r.text
        choice = r.json()["choices"][0]
        for top in choice["logprobs"]["top_logprobs"]:
            assert all(re.fullmatch(r"token_id:\d+", t) for t in top), top
        return [int(t.split(":")[1]) for t in choice["logprobs"]["tokens"]], r.json()

    async def body(c: Client) -> None:
        plain = (await c.post("/v1/completions", json=base)).json()
        ids, as_ids = await ids_of(c, base)
        assert len(ids) == 12 and tok.decode(ids) == plain["choices"][0]["text"]
        assert as_ids["choices"][0]["text"] == plain["choices"][0]["text"]
        # chat: the token strings as ids, the bytes the token's own
        r = await c.post("/v1/chat/completions", json={
            **GREEDY, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3,
            "logprobs": True, "return_tokens_as_token_ids": True})
        for entry in r.json()["choices"][0]["logprobs"]["content"]:
            token_id = int(entry["token"].split(":")[1])
            assert bytes(entry["bytes"]) == TokenText(tok)(token_id)[1]

        allowed = [ids[0], 40, 41, 77]
        got, _ = await ids_of(c, {**base, "allowed_token_ids": allowed})
        assert set(got) <= set(allowed) and got[0] == ids[0]
        r = await c.post("/v1/responses", json={**GREEDY, "input": "hi", "max_output_tokens": 4,
                                                "allowed_token_ids": [40]})
        assert r.json()["output"][0]["content"][0]["text"] == tok.decode([40] * 4), r.text

        # a word the output writes: its token sequences never appear again
        span = next(ids[i:i + 2] for i in range(len(ids) - 1)
                    if tuple(ids[i:i + 2]) in pair.router._bad_words([tok.decode(ids[i:i + 2])]))
        word = tok.decode(span)
        got, _ = await ids_of(c, {**base, "bad_words": [word]})
        banned = pair.router._bad_words([word])
        assert got != ids and not any(tuple(got[i:i + len(b)]) == b
                                      for b in banned for i in range(len(got)))
        r = await c.post("/v1/chat/completions", json={
            **GREEDY, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 12,
            "bad_words": [word], "n": 2})
        assert r.status_code == 200, r.text

        im_end = tok.encode("<|im_end|>", add_special_tokens=False)[0]
        forced = {**base, "max_tokens": 2, "logit_bias": {str(im_end): 100}}
        texts = [(await c.post("/v1/completions", json={**forced, **extra})).json()
                 ["choices"][0]["text"] for extra in ({}, {"skip_special_tokens": False})]
        assert texts == ["", "<|im_end|>" * 2]

        # the prompt's last tokens; -1: what leaves room for max_tokens
        prompt = [5, 6, 7, 8, 9, 10, 11, 12]
        cut = (await c.post("/v1/completions", json={**base, "prompt": prompt,
                                                     "truncate_prompt_tokens": 3})).json()
        tail = (await c.post("/v1/completions", json={**base, "prompt": prompt[-3:]})).json()
        assert cut["usage"]["prompt_tokens"] == 3 and cut["choices"] == tail["choices"]
        r = await c.post("/v1/completions", json={**base, "prompt": prompt[-3:], "echo": True,
                                                  "truncate_prompt_tokens": 2, "max_tokens": 1})
        assert r.json()["choices"][0]["text"].startswith(tok.decode(prompt[-2:]))
        long = "x " * 2100
        r = await c.post("/v1/chat/completions", json={
            **GREEDY, "messages": [{"role": "user", "content": long}], "max_tokens": 4,
            "truncate_prompt_tokens": -1})
        assert r.status_code == 200 and r.json()["usage"]["prompt_tokens"] == 2048 - 4, r.text
        r = await c.post("/v1/chat/completions", json={
            **GREEDY, "messages": [{"role": "user", "content": long}],
            "truncate_prompt_tokens": 100})
        assert r.status_code == 200, r.text  # the default limit: the rest of the context
        assert r.json()["usage"]["prompt_tokens"] == 100
        assert r.json()["usage"]["completion_tokens"] == 2048 - 100
        # vLLM's prompt_logprobs: the echoed prompt's logprobs, in vLLM's shape
        prompt = [5, 6, 7, 8, 9, 10]
        r = await c.post("/v1/completions", json={**base, "prompt": prompt, "max_tokens": 0,
                                                  "echo": True, "logprobs": 1,
                                                  "prompt_logprobs": 3,
                                                  "return_tokens_as_token_ids": True})
        choice = r.json()["choices"][0]
        vllm, legacy = choice["prompt_logprobs"], choice["logprobs"]
        assert vllm[0] is None and len(vllm) == len(prompt) and legacy["token_logprobs"][0] is None
        assert legacy["tokens"] == [f"token_id:{t}" for t in prompt]
        for t, position, logprob, top in zip(prompt[1:], vllm[1:], legacy["token_logprobs"][1:],
                                             legacy["top_logprobs"][1:], strict=True):
            assert position[str(t)]["logprob"] == logprob
            assert position[str(t)]["decoded_token"] == tok.decode([t])
            assert 3 <= len(position) <= 4 and len(top) <= 2  # each its own top-N
            best = max(position.values(), key=lambda e: e["logprob"])
            assert best["rank"] == 1 and max(top.values()) == best["logprob"]
        chat = {**GREEDY, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
        r = (await c.post("/v1/chat/completions", json={**chat, "prompt_logprobs": 0})).json()
        assert len(r["prompt_logprobs"]) == r["usage"]["prompt_tokens"]
        assert all(len(p) == 1 for p in r["prompt_logprobs"][1:])
        assert "prompt_logprobs" not in (await c.post("/v1/chat/completions", json=chat)).json()

        # return_token_ids: the prompt's and each choice's ids beside the text
        for prompts in (["hello there"], ["hello", "bye now"], [[5, 6, 7], [8, 9]]):
            body = {**base, "prompt": prompts if len(prompts) > 1 else prompts[0], "n": 2,
                    "return_token_ids": True}
            whole = (await c.post("/v1/completions", json=body)).json()
            for i, choice in enumerate(whole["choices"]):
                p = prompts[i // 2]
                assert choice["prompt_token_ids"] == (p if isinstance(p, list) else tok.encode(p))
                assert len(choice["token_ids"]) == 12 and tok.decode(choice["token_ids"]) == \
                    choice["text"]
            events = await sse(c, "/v1/completions", {**body, "stream": True})
            for i, choice in enumerate(whole["choices"]):
                mine = [e["choices"][0] for e in events[:-1] if e["choices"][0]["index"] == i]
                assert [t for ch in mine for t in ch["token_ids"]] == choice["token_ids"]
                assert mine[0]["prompt_token_ids"] == choice["prompt_token_ids"]
                assert all("prompt_token_ids" not in ch for ch in mine[1:])
        chat = {**GREEDY, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 5,
                "return_token_ids": True}
        whole = (await c.post("/v1/chat/completions", json=chat)).json()
        assert whole["prompt_token_ids"] == tok.apply_chat_template(chat["messages"])
        ids = whole["choices"][0]["token_ids"]
        assert len(ids) == 5 and tok.decode(ids) == whole["choices"][0]["message"]["content"]
        events = await sse(c, "/v1/chat/completions", {**chat, "stream": True})
        assert events[0]["prompt_token_ids"] == whole["prompt_token_ids"]
        assert [t for e in events[:-1] for t in e["choices"][0]["token_ids"]] == ids
        plain = (await c.post("/v1/chat/completions", json={**chat, "return_token_ids": False}))
        assert "prompt_token_ids" not in plain.json()
        assert "token_ids" not in plain.json()["choices"][0]

        # cache_salt: a prompt's cached blocks serve only requests with its salt
        salted = {**base, "prompt": list(range(100, 140)), "max_tokens": 2}
        cached = [(await c.post("/v1/completions", json={**salted, "cache_salt": salt}))
                  .json()["usage"]["prompt_tokens_details"]["cached_tokens"]
                  for salt in ("a", "b", "a")]
        assert cached == [0, 0, 32]
        await wait_freed(pair)

    serve(pair, body, max_body_bytes=65536)
