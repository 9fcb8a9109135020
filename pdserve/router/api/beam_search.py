"""Beam search over the router (vLLM's ``use_beam_search``), as vLLM serves it: each
step asks the model, through the ordinary request path, for the next token of every
live beam with its top ``2 x width`` logprobs (a request of one token each: the prefix
cache holds the beam's earlier blocks, so a step computes about one block per beam),
and keeps the ``width`` best extensions by cumulative logprob. A beam that chose EOS
is finished; at the end (``max_tokens`` steps, or no live beam left) the ``width``
best of the finished and live beams, scored ``cum_logprob / len ** length_penalty``
(the length counts the prompt, less a final EOS: vLLM's rule), are the answer.

It draws nothing, so it is deterministic; failures, deadlines and cancellation are
the ordinary requests' (``RouterStream``): a step's error ends the search with it.
"""

from __future__ import annotations

import asyncio
import dataclasses
from dataclasses import dataclass, field

from pdserve.engine.sampling.sampling_params import MAX_LOGPROBS
from pdserve.messages import TokenLogprob
from pdserve.router.api.common import RouterLike
from pdserve.router.api.router_stream import Item, RouterStream
from pdserve.router.types import ErrorKind, FinalChunk, GenerateRequest, RouterError

MAX_BEAM_WIDTH = MAX_LOGPROBS // 2  # each step asks for 2 x width candidates


@dataclass
class Beam:
    tokens: list[int] = field(default_factory=list)  # output so far
    cum_logprob: float = 0.0
    logprobs: list[TokenLogprob] = field(default_factory=list)  # one per token
    finished: bool = False  # ended with EOS


def score(beam: Beam, prompt_len: int, length_penalty: float) -> float:
    """vLLM's ``get_beam_search_score``: the length counts the prompt, less a final EOS."""
    length = prompt_len + len(beam.tokens) - (1 if beam.finished else 0)
    return beam.cum_logprob / (max(length, 1) ** length_penalty)


async def beam_search(router: RouterLike, req: GenerateRequest, prompt: list[int], width: int,
                      length_penalty: float, eos_token_ids: frozenset[int],
                      tasks: set[asyncio.Task[None]]) -> list[Beam]:
    """The ``width`` best beams after ``prompt``, best first; ``req`` gives
    ``max_tokens``, ``ignore_eos``, ``logprobs`` (top-N kept per token), the deadline,
    priority and cache salt. RouterError as the steps' requests raise it."""
    if not 1 <= width <= MAX_BEAM_WIDTH:
        raise RouterError(ErrorKind.INVALID, f"beam search takes n in [1, {MAX_BEAM_WIDTH}], "
                          f"got {width}", param="n")
    p = req.params
    step_params = dataclasses.replace(
        p, max_tokens=1, min_tokens=0, logprobs=min(2 * width, MAX_LOGPROBS), ignore_eos=True,
        temperature=0.0, seed=None, stop=(), stop_token_ids=(), prompt_logprobs=None)
    keep = p.logprobs or 0
    live, done = [Beam()], []
    for step in range(p.max_tokens):
        tops = await asyncio.gather(*(
            _next_tokens(router, dataclasses.replace(
                req, request_id=f"{req.request_id}-s{step}b{i}", params=step_params,
                prompt=None, messages=None, prompt_token_ids=prompt + beam.tokens,
                truncate_prompt_tokens=None, bad_words=()), tasks)
            for i, beam in enumerate(live)))
        candidates = []
        for beam, top in zip(live, tops, strict=True):
            for token, logprob in top.top:
                grown = Beam([*beam.tokens, token], beam.cum_logprob + logprob,
                             [*beam.logprobs, TokenLogprob(token, logprob, top.top[:keep])])
                if token in eos_token_ids and not p.ignore_eos:
                    grown.finished = True
                    done.append(grown)
                else:
                    candidates.append(grown)
        live = sorted(candidates, key=lambda b: score(b, len(prompt), length_penalty),
                      reverse=True)[:width]
        if not live:
            break
    return sorted(done + live, key=lambda b: score(b, len(prompt), length_penalty),
                  reverse=True)[:width]


async def _next_tokens(router: RouterLike, req: GenerateRequest,
                       tasks: set[asyncio.Task[None]]) -> TokenLogprob:
    """The one token of ``req`` (max_tokens 1) with its top logprobs."""
    items: asyncio.Queue[Item] = asyncio.Queue()
    call = RouterStream(router, req, tasks, items.put_nowait)
    try:
        got: list[TokenLogprob] = []
        while not isinstance(item := await items.get(), FinalChunk):
            if isinstance(item, RouterError):
                raise item
            got += item.logprobs
        if not got:
            raise RouterError(ErrorKind.INTERNAL, "a beam search step produced no token")
        return got[0]
    finally:
        call.close()
