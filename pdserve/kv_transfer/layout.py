"""What two workers' KV layouts (``pdserve.kv_layout.KVLayout``) let one send to the
other: ``plan_slice`` matches the KV heads a sender and a receiver hold (tensor
parallel ranks hold a range each) into a ``Slice``, and ``check_send`` checks a send's
block ids and layer range against both layouts.

Tensor parallelism: a rank's tensor holds only its KV heads, ``heads = (lo, hi)`` of
the model's ``num_kv_heads``. Two layouts are compatible when every model-wide field
agrees (the heads may differ); what one sender writes into one receiver is a
``Slice``: a range of heads both hold, and which part of the receiver's request it is
(a receiver rank fed by several sender ranks expects several parts).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from pdserve.kv_layout import KVLayout, KVLayoutMismatch

__all__ = ["KVLayout", "KVLayoutMismatch", "Slice", "check_block_ids", "check_send",
           "plan_slice"]


@dataclass(frozen=True)
class Slice:
    """What one sender writes into one receiver: KV heads [lo, hi) of the model (both
    hold them), as part ``part`` of ``parts`` the receiver's request is made of."""

    heads: tuple[int, int]
    part: int = 0
    parts: int = 1

    def to_dict(self) -> dict[str, Any]:
        return {"heads": list(self.heads), "part": self.part, "parts": self.parts}


def plan_slice(local: KVLayout, peer: KVLayout, spec: dict[str, Any] | None = None) -> Slice:
    """The slice a sender with layout ``local`` writes into a receiver with ``peer``:
    ``spec`` (``Slice.to_dict``, from a tensor-parallel plan) or, without one, all of
    the receiver's heads as its only part. ``KVLayoutMismatch`` naming both sides when
    the layouts differ or the sender does not hold those heads."""
    local.check_compatible(peer)
    if spec is None:
        cut = Slice(peer.head_range)
    else:
        cut = Slice((int(spec["heads"][0]), int(spec["heads"][1])), int(spec["part"]),
                    int(spec["parts"]))
    lo, hi = cut.heads
    for name, layout in (("sender", local), ("receiver", peer)):
        have = layout.head_range
        if not have[0] <= lo < hi <= have[1]:
            raise KVLayoutMismatch(
                f"KV heads [{lo}, {hi}) cannot go from a sender holding heads "
                f"{list(local.head_range)} to a receiver holding {list(peer.head_range)} "
                f"(of {local.num_kv_heads}): the {name} lacks some")
    if not 0 <= cut.part < cut.parts:
        raise ValueError(f"slice part {cut.part} is not within [0, {cut.parts})")
    return cut


def check_block_ids(ids: list[int], num_blocks: int, what: str) -> None:
    """Block ids must be in range and distinct (a duplicate would write a block twice)."""
    for b in ids:
        if not 0 <= b < num_blocks:
            raise ValueError(f"{what} block id {b} out of range [0, {num_blocks})")
    if len(set(ids)) != len(ids):
        raise ValueError(f"{what} block ids contain duplicates")


def check_send(
    layout: KVLayout,
    src_block_ids: Sequence[int],
    dst_block_ids: Sequence[int],
    src_num_blocks: int,
    dst_num_blocks: int,
    layers: tuple[int, int] | None,
) -> tuple[list[int], list[int], tuple[int, int]]:
    """Validate one send() call's arguments; return (src ids, dst ids, [lo, hi))."""
    src = [int(b) for b in src_block_ids]
    dst = [int(b) for b in dst_block_ids]
    if len(src) != len(dst):
        raise ValueError(f"{len(src)} source blocks but {len(dst)} destination blocks")
    check_block_ids(src, src_num_blocks, "source")
    check_block_ids(dst, dst_num_blocks, "destination")
    return src, dst, layout.layer_range(layers)
