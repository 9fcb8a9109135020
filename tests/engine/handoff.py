"""A prompt's KV handed from a prefill engine to a decode engine in one process, the
way a transfer channel does it: the blocks copied from one ``kv_cache`` into the
other's reserved blocks."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from pdserve.engine.engine import LLMEngine


def hand_off(prefill: LLMEngine, request_id: str, decode: LLMEngine, dest: Sequence[int]) -> None:
    src = torch.as_tensor(prefill.block_ids(request_id), dtype=torch.long)
    assert len(src) == len(dest), (len(src), len(dest))
    decode.kv_cache[torch.as_tensor(list(dest), dtype=torch.long)] = \
        prefill.kv_cache[src].to(decode.kv_cache.dtype)
