"""Moving KV cache blocks from a prefill worker into a decode worker's reserved blocks.

See `base` for the contract, `layout` for the KV tensor layout and the handshake check,
`factory` for choosing a backend (`nixl`, `torch`, `ray`, `local`; their modules are in
`backends/`), docs/kv_transfer.md for operating them.
"""

from .base import FailReason, KVReceiver, KVSender, RecvEvent, SendEvent
from .factory import BACKENDS, DEFAULT_BACKEND, make_receiver, make_sender
from .layout import KVLayout, KVLayoutMismatch

__all__ = [
    "BACKENDS",
    "DEFAULT_BACKEND",
    "FailReason",
    "KVLayout",
    "KVLayoutMismatch",
    "KVReceiver",
    "KVSender",
    "RecvEvent",
    "SendEvent",
    "make_receiver",
    "make_sender",
]
