"""Self-describing messages for the two-sided backends (torch, ray).

Every message is a fixed-size header (10 x int64) and, unless the header says 0 bytes,
one payload buffer (uint8) whose size the header gives, so a receiver can post a recv of
the right size without knowing what comes next:

    header  [MAGIC, kind, seq, total (-1: not final), n_blocks, lo, hi,
             rid_len, notify_len, payload_len]

    payload ┌────────────────┬─────────────────────────────────────┬─────────┬────────────┐
            │ dst ids        │ block data                          │ req id  │ notify     │
            │ int64 x n      │ n x (hi-lo) x layer_bytes, kv dtype │ utf-8   │ JSON utf-8 │
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
HEADER_LEN = 10


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


def data_bytes(layout: KVLayout, n_blocks: int, layers: tuple[int, int]) -> int:
    return n_blocks * (layers[1] - layers[0]) * layout.layer_bytes


def encode(msg: Message, layout: KVLayout) -> tuple[list[int], bytes, bytes]:
    """Header values and the request-id / notify bytes for `msg`."""
    rid = msg.request_id.encode()
    note = b"" if msg.notify is None else json.dumps(msg.notify).encode()
    n = len(msg.dst)
    size = (
        0
        if msg.kind in (Kind.PING, Kind.BYE)
        else 8 * n + data_bytes(layout, n, msg.layers) + len(rid) + len(note)
    )
    total = -1 if msg.total is None else msg.total
    header = [MAGIC, int(msg.kind), msg.seq, total, n, *msg.layers, len(rid), len(note), size]
    return header, rid, note


def pack(
    msg: Message, layout: KVLayout, kv: torch.Tensor, src: list[int], staging: torch.Tensor
) -> tuple[list[int], torch.Tensor]:
    """Header and payload (a prefix view of `staging`, uint8 on kv's device) for `msg`,
    gathering kv[src, lo:hi] into the payload's data region."""
    header, rid, note = encode(msg, layout)
    n, size = len(msg.dst), header[-1]
    payload = staging[:size]
    payload[: 8 * n].view(torch.int64).copy_(torch.tensor(msg.dst, dtype=torch.int64))
    nbytes = data_bytes(layout, n, msg.layers)
    if n:
        lo, hi = msg.layers
        shape = (n, hi - lo, *layout.block_shape()[1:])
        out = payload[8 * n : 8 * n + nbytes].view(kv.dtype).view(shape)
        gather(kv, src, msg.layers, out=out)
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
    """Message and its block data ([n, hi-lo, 2, bs, H, D] view of `payload`)."""
    kind, _ = decode_header(values)
    _, _, seq, total, n, lo, hi, rid_len, note_len, size = values
    nbytes = data_bytes(layout, n, (lo, hi)) if n else 0
    head = payload[: 8 * n].cpu().view(torch.int64).tolist() if n else []
    tail = bytes(payload[8 * n + nbytes : size].cpu().numpy().tobytes())
    rid = tail[:rid_len].decode()
    notify = json.loads(tail[rid_len : rid_len + note_len]) if note_len else None
    msg = Message(kind, rid, seq, None if total < 0 else total, tuple(head), (lo, hi), notify)
    dtype = layout.torch_dtype
    shape = (n, hi - lo, *layout.block_shape()[1:])
    data = payload[8 * n : 8 * n + nbytes].view(dtype).view(shape) if n else payload[:0]
    return msg, data
