"""Self-describing messages for the two-sided backends (torch, ray).

Every message is a fixed-size header (14 x int64) and, unless the header says 0 bytes,
one payload buffer (uint8) whose size the header gives, so a receiver can post a recv of
the right size without knowing what comes next:

    header  [MAGIC, kind, seq, total (-1: not final), n_blocks, lo, hi,
             head_lo, head_hi (-1, -1: all the receiver's), part, parts,
             rid_len, notify_len, payload_len]

    payload ┌────────────────┬─────────────────────────────────────┬─────────┬────────────┐
            │ dst ids        │ block data                          │ req id  │ notify     │
            │ int64 x n      │ n x (hi-lo) x layer bytes of the    │ utf-8   │ JSON utf-8 │
            │                │ heads moved, kv dtype               │         │            │
            └────────────────┴─────────────────────────────────────┴─────────┴────────────┘
            offset 0          8n (8-aligned: the data views as kv dtype in place)

DATA carries blocks (n >= 0: a notify-only final has none), ABORT carries only the
request id (the sender gave up on it), PING (sender alive, idle) and BYE (sender
closing) carry nothing.
"""

from __future__ import annotations

import enum
import json
from dataclasses import dataclass
from typing import Any

import torch

from .layout import KVLayout
from .regions import gather

MAGIC = 0x4B565846  # "KVXF"
HEADER_LEN = 14


class Kind(enum.IntEnum):
    DATA = 1
    ABORT = 2
    PING = 3
    BYE = 4


@dataclass(frozen=True)
class Message:
    """A decoded header plus the small parts of its payload."""

    kind: Kind
    request_id: str = ""
    seq: int = 0
    total: int | None = None  # set on a request's final message
    dst: tuple[int, ...] = ()
    layers: tuple[int, int] = (0, 0)
    notify: dict[str, Any] | None = None
    heads: tuple[int, int] | None = None  # the model's KV heads carried (None: all of D's)
    part: int = 0  # which of the receiver request's parts (``layout.Slice``)
    parts: int = 1


def data_bytes(layout: KVLayout, n_blocks: int, layers: tuple[int, int],
               heads: tuple[int, int] | None = None) -> int:
    width = layout.local_heads if heads is None else heads[1] - heads[0]
    return n_blocks * (layers[1] - layers[0]) * layout.layer_bytes_of(width)


def local_heads(layout: KVLayout, heads: tuple[int, int] | None) -> tuple[int, int] | None:
    """The model's KV heads ``heads`` as indices into a tensor with ``layout``."""
    if heads is None:
        return None
    lo = layout.head_range[0]
    return (heads[0] - lo, heads[1] - lo)


def encode(msg: Message, layout: KVLayout) -> tuple[list[int], bytes, bytes]:
    """Header values and the request-id / notify bytes for `msg`."""
    rid = msg.request_id.encode()
    note = b"" if msg.notify is None else json.dumps(msg.notify).encode()
    n = len(msg.dst)
    size = (
        0
        if msg.kind in (Kind.PING, Kind.BYE)
        else 8 * n + data_bytes(layout, n, msg.layers, msg.heads) + len(rid) + len(note)
    )
    total = -1 if msg.total is None else msg.total
    heads = (-1, -1) if msg.heads is None else msg.heads
    header = [MAGIC, int(msg.kind), msg.seq, total, n, *msg.layers, *heads, msg.part,
              msg.parts, len(rid), len(note), size]
    return header, rid, note


def pack(
    msg: Message, layout: KVLayout, kv: torch.Tensor, src: list[int], staging: torch.Tensor
) -> tuple[list[int], torch.Tensor]:
    """Header and payload (a prefix view of `staging`, uint8 on kv's device) for `msg`,
    gathering kv[src, lo:hi] (the message's heads) into the payload's data region."""
    header, rid, note = encode(msg, layout)
    n, size = len(msg.dst), header[-1]
    payload = staging[:size]
    payload[: 8 * n].view(torch.int64).copy_(torch.tensor(msg.dst, dtype=torch.int64))
    nbytes = data_bytes(layout, n, msg.layers, msg.heads)
    if n:
        out = payload[8 * n : 8 * n + nbytes].view(kv.dtype).view(
            data_shape(layout, n, msg.layers, msg.heads))
        gather(kv, src, msg.layers, out=out, heads=local_heads(layout, msg.heads))
    tail = torch.frombuffer(bytearray(rid + note), dtype=torch.uint8) if rid + note else None
    if tail is not None:
        payload[8 * n + nbytes :].copy_(tail)
    return header, payload


def decode_header(values: list[int]) -> tuple[Kind, int]:
    """Kind and payload size of a received header; ValueError on garbage."""
    if len(values) != HEADER_LEN or values[0] != MAGIC:
        raise ValueError(f"not a KV transfer header: {values[:2]}")
    return Kind(values[1]), values[-1]


def unpack(
    values: list[int], payload: torch.Tensor, layout: KVLayout
) -> tuple[Message, torch.Tensor]:
    """Message and its block data ([n, hi-lo, 2, H, bs, D] view of `payload`)."""
    kind, _ = decode_header(values)
    _, _, seq, total, n, lo, hi, h_lo, h_hi, part, parts, rid_len, note_len, size = values
    heads = None if h_lo < 0 else (h_lo, h_hi)
    nbytes = data_bytes(layout, n, (lo, hi), heads) if n else 0
    head = payload[: 8 * n].cpu().view(torch.int64).tolist() if n else []
    tail = bytes(payload[8 * n + nbytes : size].cpu().numpy().tobytes())
    rid = tail[:rid_len].decode()
    notify = json.loads(tail[rid_len : rid_len + note_len]) if note_len else None
    msg = Message(kind, rid, seq, None if total < 0 else total, tuple(head), (lo, hi), notify,
                  heads, part, parts)
    dtype = layout.torch_dtype
    data = (payload[8 * n : 8 * n + nbytes].view(dtype).view(
        data_shape(layout, n, (lo, hi), heads)) if n else payload[:0])
    return msg, data


def data_shape(layout: KVLayout, n: int, layers: tuple[int, int],
               heads: tuple[int, int] | None) -> tuple[int, ...]:
    """[n, hi-lo, 2, heads moved, bs, D]: a message's block data."""
    width = layout.local_heads if heads is None else heads[1] - heads[0]
    return (n, layers[1] - layers[0], 2, width, layout.block_size, layout.row_width)
