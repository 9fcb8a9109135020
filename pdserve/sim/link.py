"""KV transfer time: a link model per prefill worker.

One send of ``n`` blocks of ``b`` bytes takes ``latency + n·b / bandwidth +
n·per_block`` and a prefill worker's sends leave one after another (its channel is one
queue: ``Pipe``), so sends made while it computes -- the blocks each chunk completed,
which the prefill worker pushes at once (``worker/prefill.py``) -- overlap its
compute, and the last one (the rest, with the first token) ends the hand-over.

Presets: GPU interconnects from their datasheets at the share a transfer engine
usually reaches, and this machine's channels as measured by
``python -m benchmarks.kv_transfer`` (docs/kv_transfer.md: 1 block and 256 blocks of
the default model, AMX class). A tensor-parallel worker moves each rank's heads over
that rank's own link (one NIC per GPU), so its bandwidth is ``per_rank`` x ranks.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Link:
    name: str
    bandwidth: float  # bytes/s of one rank's link
    latency_s: float  # per send
    per_block_s: float = 0.0  # per block of a send (descriptors, registration)

    def __post_init__(self) -> None:
        if not self.bandwidth > 0:
            raise ValueError(f"link bandwidth must be > 0 bytes/s, got {self.bandwidth}")
        if self.latency_s < 0 or self.per_block_s < 0:
            raise ValueError("link latency and per-block time must be >= 0")

    def send_s(self, num_blocks: int, block_bytes: int, ranks: int = 1) -> float:
        """One send of ``num_blocks`` blocks over ``ranks`` links in parallel."""
        if num_blocks <= 0:
            return self.latency_s
        return (self.latency_s + num_blocks * block_bytes / (self.bandwidth * ranks)
                + num_blocks * self.per_block_s)


LINKS: dict[str, Link] = {
    # GPU interconnects (per GPU, one direction, ~80% of the line rate)
    "nvlink": Link("nvlink", 360e9, 10e-6, 0.2e-6),  # H100 NVLink 4: 450 GB/s
    "infiniband": Link("infiniband", 40e9, 20e-6, 0.5e-6),  # NDR 400 Gb/s per GPU
    "roce": Link("roce", 20e9, 30e-6, 0.5e-6),  # 200 Gb/s per GPU
    "tcp": Link("tcp", 5e9, 100e-6, 2e-6),  # 100 GbE shared by a node's GPUs, ~50 Gb/s each
    # this machine, 2 shared cores (docs/kv_transfer.md, measured)
    "nixl-cpu": Link("nixl-cpu", 2.3e9, 2.3e-3),
    "torch-cpu": Link("torch-cpu", 0.75e9, 1.8e-3),
    "ray-cpu": Link("ray-cpu", 0.6e9, 11e-3),
    "local-cpu": Link("local-cpu", 3.2e9, 0.5e-3),
}


def get_link(name: str) -> Link:
    try:
        return LINKS[name]
    except KeyError:
        raise ValueError(f"unknown link {name!r}; choose one of {', '.join(LINKS)}") from None


class Pipe:
    """One prefill worker's outgoing channel: sends queue behind each other."""

    def __init__(self, link: Link, block_bytes: int, ranks: int = 1) -> None:
        self.link, self.block_bytes, self.ranks = link, block_bytes, ranks
        self.free_at = 0.0
        self.bytes_sent = 0

    def send(self, now: float, num_blocks: int) -> float:
        """Queue a send of ``num_blocks`` at ``now``: when it lands."""
        start = max(now, self.free_at)
        self.free_at = start + self.link.send_s(num_blocks, self.block_bytes, self.ranks)
        self.bytes_sent += num_blocks * self.block_bytes
        return self.free_at
