"""NIXL agent setup and the notification format shared by both nixl roles.

Each worker makes ONE agent and registers its whole KV tensor once. The agent runs
without NIXL's progress thread (it busy-spins: on a 2-core machine it halves throughput)
and without the listener thread: progress happens inside our poll() calls
(check_xfer_state on P, get_new_notifs on D). Consequence: a WRITE that carries a
notification completes on P only after D's next poll, and with UCX_TLS=tcp D must poll
for the bytes themselves to move — D's engine polls every step anyway.

Notification attached to each WRITE (JSON, small):

    {"r": request id, "s": message index, "n": total messages (final only) | null,
     "p": notify payload (final only) | null, "q": [part, parts]}

(the part of the receiver's request this sender writes: ``layout.Slice``).

NIXL delivers a transfer's notification only after its data is in place, so D counts a
message as landed when its notification arrives.
"""

from __future__ import annotations

import base64
import importlib
import json
import uuid
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

# The `nixl` meta package picks the wheel matching the CUDA it finds; without it, use
# whichever wheel is installed (nixl-cu12 is what pdserve depends on).
NIXL_MODULES = ("nixl._api", "nixl_cu12._api", "nixl_cu13._api")


def nixl_api() -> Any:
    """The NIXL Python API module; ImportError says what to install."""
    for module in NIXL_MODULES:
        try:
            return importlib.import_module(module)
        except ImportError:
            continue
    raise ImportError("the nixl KV transfer backend needs NIXL: pip install nixl-cu12==1.5.1")


def new_agent(role: str) -> tuple[Any, str]:
    """(agent, unique name) with the UCX backend and no background threads."""
    api = nixl_api()
    name = f"pdserve-kv-{role}-{uuid.uuid4().hex[:12]}"
    config = api.nixl_agent_config(
        enable_prog_thread=False, enable_listen_thread=False, backends=["UCX"]
    )
    agent = api.nixl_agent(name, config)
    if "UCX" not in agent.backends:
        raise RuntimeError("NIXL has no UCX backend here (check UCX_TLS and the nixl wheel)")
    return agent, name


def mem_type(kv: torch.Tensor) -> str:
    return "VRAM" if kv.is_cuda else "DRAM"


def device_id(kv: torch.Tensor) -> int:
    return kv.get_device() if kv.is_cuda else 0


def descs(base: int, dev: int, regions: list[tuple[int, int]]) -> np.ndarray:
    """Nx3 (address, length, device id) rows for NIXL from (offset, length) regions."""
    pairs = np.asarray(regions, dtype=np.uint64).reshape(-1, 2)
    rows = np.empty((len(pairs), 3), dtype=np.uint64)
    rows[:, 0] = pairs[:, 0] + np.uint64(base)
    rows[:, 1] = pairs[:, 1]
    rows[:, 2] = dev
    return rows


def encode_metadata(md: bytes) -> str:
    return base64.b64encode(md).decode()


def decode_metadata(text: str) -> bytes:
    return base64.b64decode(text)


def encode_notif(rid: str, seq: int, total: int | None, notify: dict[str, Any] | None,
                 part: int = 0, parts: int = 1, blocks: Sequence[int] = ()) -> bytes:
    return json.dumps({"r": rid, "s": seq, "n": total, "p": notify, "q": [part, parts],
                       "b": list(blocks)}).encode()


def decode_notif(raw: bytes) -> tuple[str, int, int | None, dict[str, Any] | None, int, int,
                                      list[int] | None]:
    """(request id, message index, total, notify, part, parts, the blocks it wrote:
    None from a sender that does not say)."""
    msg = json.loads(raw)
    part, parts = msg.get("q", (0, 1))
    blocks = msg.get("b")
    return (str(msg["r"]), int(msg["s"]), msg["n"], msg["p"], int(part), int(parts),
            None if blocks is None else [int(b) for b in blocks])
