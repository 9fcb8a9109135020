"""Process groups for ONE prefill↔decode pair of the `torch` backend, built without a
global default world so pools can grow: every pair gets its own 2-member groups from a
PrefixStore over the decode worker's TCPStore.

Rendezvous on D's store (keys under "pair/<n>/"):

    P: n = add("pairs", 1) - 1        take a pair number
    P: set("pair/<n>/hello", layout)  D's accept thread sees "pairs" grow
    D: set("pair/<n>/reply", "ok" | "error: <mismatch>")
    both: groups from PrefixStore("pair/<n>/ctrl/") and ("pair/<n>/bulk/"); P is rank 0

Two groups per pair: `ctrl` (gloo, CPU headers — it also notices a dead peer while
idle) and `bulk` (the payloads: the same gloo group for CPU KV, NCCL for CUDA KV).
"""

from __future__ import annotations

import datetime
from typing import Any

import torch
import torch.distributed as dist

TAG = 0
# An idle sender pings this often: D's receive thread wakes to notice D closing, and a
# silent peer_timeout_s means the sender is gone.
PING_INTERVAL_S = 0.5
# ProcessGroupGloo / ProcessGroupNCCL: c10d Backends (send/recv), not ProcessGroups.
Group = Any
SENDER_RANK, RECEIVER_RANK = 0, 1


def pair_prefix(n: int) -> str:
    return f"pair/{n}/"


def make_groups(
    store: dist.Store, n: int, rank: int, device: torch.device, timeout_s: float
) -> tuple[Group, Group]:
    """(ctrl, bulk) groups of pair n; blocks until the other side joins (or timeout)."""
    timeout = datetime.timedelta(seconds=timeout_s)
    ctrl_store = dist.PrefixStore(pair_prefix(n) + "ctrl/", store)
    ctrl = dist.ProcessGroupGloo(ctrl_store, rank, 2, timeout)
    if device.type != "cuda":
        return ctrl, ctrl
    opts = dist.ProcessGroupNCCL.Options()
    opts._timeout = timeout
    torch.cuda.set_device(device)
    bulk_store = dist.PrefixStore(pair_prefix(n) + "bulk/", store)
    bulk = dist.ProcessGroupNCCL(bulk_store, rank, 2, opts)
    return ctrl, bulk


def sync(device: torch.device) -> None:
    """Wait for queued device work (NCCL completes on a stream, not on the CPU)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
