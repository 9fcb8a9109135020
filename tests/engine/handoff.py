"""A prompt's KV handed from a prefill engine to a decode engine in one process, the
way a transfer channel does it: the blocks copied from one ``kv_cache`` into the
other's reserved blocks."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from pdserve.engine.engine import LLMEngine
from pdserve.engine.sampling.sampling_params import SamplingParams


def hand_off(prefill: LLMEngine, request_id: str, decode: LLMEngine, dest: Sequence[int]) -> None:
    src = torch.as_tensor(prefill.block_ids(request_id), dtype=torch.long)
    assert len(src) == len(dest), (len(src), len(dest))
    decode.kv_cache[torch.as_tensor(list(dest), dtype=torch.long)] = \
        prefill.kv_cache[src].to(decode.kv_cache.dtype)


def disaggregate(prefill: LLMEngine, decode: LLMEngine, request_id: str,
                 prompt: list[int], params: SamplingParams, draft: bool = False) -> int:
    """Prefill ``prompt`` on ``prefill``, hand its KV to ``decode`` and start decoding
    there, as a prefill/decode pair does; the first token (sampled by the prefill side).
    ``draft``: the draft model's prompt KV too (both engines have the draft)."""
    prefill.add_request(request_id, prompt, params)
    outs = []
    while not outs:
        outs = prefill.step().outputs
    dest = decode.reserve(request_id, prompt, params)
    assert dest is not None
    hand_off(prefill, request_id, decode, dest)
    if draft:
        assert prefill.draft is not None and decode.draft is not None
        draft_dest = decode.reserve_draft(request_id)
        assert draft_dest
        prefill.prefill_draft([request_id])
        src = torch.as_tensor(prefill.block_ids(request_id), dtype=torch.long)
        decode.draft.kv_cache[torch.as_tensor(draft_dest, dtype=torch.long)] = \
            prefill.draft.kv_cache[src]
    prefill.release(request_id)
    first = outs[0].new_token_ids[0]
    decode.start_decode(request_id, first)
    return first


def decode_to_end(decode: LLMEngine) -> tuple[list[int], int]:
    """Step ``decode`` until nothing is left: the tokens it produced, and the steps."""
    tokens: list[int] = []
    steps = 0
    while decode.has_unfinished():
        steps += 1
        for o in decode.step().outputs:
            tokens.extend(o.new_token_ids)
    return tokens, steps
