"""Transfer bandwidth of each backend, against torch memcpy measured in the same run.

    python -m benchmarks.kv_transfer [--backends nixl torch ray local] [--blocks 1 16 256]
                                        [--slice]

For every backend the receiver runs in a spawned process (like a decode worker: it polls
about every 0.5 ms and reports completions over a pipe), the sender in this one; `local`
runs both here. Each request moves n blocks with scattered (seeded random) ids on both
sides, so nothing merges into one big region, and is timed from send() until the
receiver reports it complete. Reported: median GB/s over the repeats, and that as a
fraction of a plain torch copy of the same number of bytes (`x memcpy`).

Default layout: SmolLM2-135M (30 layers, 3 kv heads, head_dim 64, block 16, float32) —
737,280 bytes per block.

``--slice`` adds, per backend, a tensor-parallel hand-off: a sender holding KV heads
[1, 3) writes them into a receiver holding all 3 (``layout.Slice``; rows ``name/slice``,
bytes = the heads moved) -- what each rank of a TP=2 prefill worker does for a TP=1
decode worker.
"""

from __future__ import annotations

import argparse
import dataclasses
import multiprocessing as mp
import random
import statistics
import time
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any

import torch

from pdserve.kv_transfer.base import KVReceiver
from pdserve.kv_transfer.factory import make_receiver, make_sender
from pdserve.kv_transfer.layout import KVLayout, Slice

SMOLLM2_135M = KVLayout("HuggingFaceTB/SmolLM2-135M", "float32", 30, 3, 64, 16)
RAY_NODE_IP = "127.0.0.2"  # loopback, but not one Ray rewrites to the machine's address
WAIT_S = 60.0


@dataclass(frozen=True)
class Row:
    backend: str
    blocks: int
    nbytes: int
    seconds: float  # median time per request
    gbps: float
    vs_memcpy: float


def memcpy_gbps(nbytes: int, repeats: int = 7) -> float:
    """Bandwidth of one contiguous torch copy of nbytes into fresh memory (the reference:
    a transfer also lands in memory the receiver has not touched recently)."""
    src = torch.ones(nbytes, dtype=torch.uint8)
    dst = torch.empty_like(src)
    dst.copy_(src)  # fault the pages in
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        dst.copy_(src)
        times.append(time.perf_counter() - start)
    return nbytes / statistics.median(times) / 1e9


def _receiver_main(
    conn: Connection, backend: str, layout: dict[str, Any], num_blocks: int, ray: str | None
) -> None:
    """Child: a receiver that expects what it is told and reports completions."""
    torch.set_num_threads(1)  # see run()
    if ray:
        import ray as ray_module

        ray_module.init(address=ray, _node_ip_address=RAY_NODE_IP, log_to_driver=False)
    lay = KVLayout.from_dict(layout)
    recv = make_receiver(backend, torch.zeros(lay.kv_shape(num_blocks), dtype=lay.torch_dtype), lay)
    conn.send(recv.endpoint())
    while True:
        if conn.poll(0.0005):
            cmd = conn.recv()
            if cmd[0] == "exit":
                recv.close()
                return
            recv.expect(cmd[1], cmd[2], WAIT_S)
        for event in recv.poll():
            conn.send((event.request_id, event.ok, event.error))


class _Remote:
    """The receiver side as seen from the sender's process."""

    def __init__(self, backend: str, layout: KVLayout, num_blocks: int, ray: str | None):
        self.local: KVReceiver | None = None
        if backend == "local":
            kv = torch.zeros(layout.kv_shape(num_blocks), dtype=layout.torch_dtype)
            self.local = make_receiver("local", kv, layout)
            self.endpoint = self.local.endpoint()
            return
        ctx = mp.get_context("spawn")
        self.conn, child = ctx.Pipe()
        args = (child, backend, layout.to_dict(), num_blocks, ray)
        self.proc = ctx.Process(target=_receiver_main, args=args, daemon=True)
        self.proc.start()
        if not self.conn.poll(WAIT_S):
            raise TimeoutError("bench receiver did not start")
        self.endpoint = self.conn.recv()

    def expect(self, rid: str, ids: list[int]) -> None:
        if self.local:
            self.local.expect(rid, ids, WAIT_S)
        else:
            self.conn.send(("expect", rid, ids))

    def done(self) -> list[tuple[str, bool, str]]:
        if self.local:
            return [(e.request_id, e.ok, e.error) for e in self.local.poll()]
        out = []
        while self.conn.poll(0):
            out.append(self.conn.recv())
        return out

    def close(self) -> None:
        if self.local:
            self.local.close()
            return
        self.conn.send(("exit",))
        self.proc.join(10)
        if self.proc.is_alive():
            self.proc.kill()


def bench_backend(
    backend: str, layout: KVLayout, block_counts: list[int], repeats: int, ray: str | None,
    heads: tuple[int, int] | None = None,
) -> list[tuple[int, float]]:
    """(blocks, median seconds per request) for each block count; with ``heads``, the
    sender holds only those KV heads and writes them into the receiver's."""
    num_blocks = max(block_counts) + 8
    mine = layout if heads is None else dataclasses.replace(layout, heads=heads)
    kv = torch.randn(mine.kv_shape(num_blocks)).to(layout.torch_dtype)
    remote = _Remote(backend, layout, num_blocks, ray)
    sender = make_sender(backend, kv, mine)
    rng = random.Random(0)
    out = []
    try:
        peer = sender.connect(remote.endpoint if heads is None else {
            **remote.endpoint, "slice": Slice(heads).to_dict()})
        for n in block_counts:
            times = []
            for i in range(repeats + 1):  # the first one warms up
                src, dst = rng.sample(range(num_blocks), n), rng.sample(range(num_blocks), n)
                rid = f"{n}-{i}"
                remote.expect(rid, dst)
                time.sleep(0.01)  # let the receiver register it
                start = time.perf_counter()
                sender.send(peer, rid, src, dst, notify={})
                _wait(sender, remote, rid)
                times.append(time.perf_counter() - start)
            out.append((n, statistics.median(times[1:])))
    finally:
        sender.close()
        remote.close()
    return out


def _wait(sender: Any, remote: _Remote, rid: str) -> None:
    deadline = time.monotonic() + WAIT_S
    while time.monotonic() < deadline:
        for event in sender.poll():
            if not event.ok:
                raise RuntimeError(f"send {rid} failed: {event.error}")
        for got, ok, error in remote.done():
            if got == rid:
                if not ok:
                    raise RuntimeError(f"receive {rid} failed: {error}")
                return
        time.sleep(0.0002)
    raise TimeoutError(f"request {rid} did not complete in {WAIT_S}s")


def run(
    backends: list[str],
    layout: KVLayout = SMOLLM2_135M,
    block_counts: list[int] | None = None,
    repeats: int = 5,
    sliced: bool = False,
) -> list[Row]:
    """Measure and print the table; returns its rows."""
    counts = block_counts or [1, 16, 256]
    # One intra-op thread: waking torch's pool costs ~4-8 ms per small copy on a busy
    # 2-core machine (measured), which would swamp the 1-block case for every backend.
    torch.set_num_threads(1)
    reference = {n: memcpy_gbps(n * layout.block_bytes) for n in counts}
    rows = []
    for backend in backends:
        ray = _start_ray() if backend == "ray" else None  # its daemons only while needed
        try:
            cuts = [None, (1, layout.num_kv_heads)] if sliced else [None]
            for heads in cuts:
                width = layout.num_kv_heads if heads is None else heads[1] - heads[0]
                name = backend if heads is None else f"{backend}/slice"
                for n, seconds in bench_backend(backend, layout, counts, repeats, ray, heads):
                    nbytes = n * layout.num_layers * layout.layer_bytes_of(width)
                    gbps = nbytes / seconds / 1e9
                    rows.append(Row(name, n, nbytes, seconds, gbps, gbps / reference[n]))
        finally:
            if ray:
                import ray as ray_module

                ray_module.shutdown()
    print(
        f"layout {layout.model_id}: {layout.block_bytes:,} bytes per block; torch memcpy "
        + ", ".join(f"{n} blocks {g:.1f} GB/s" for n, g in reference.items())
    )
    print(f"{'backend':12} {'blocks':>6} {'MB':>8} {'ms':>9} {'GB/s':>7} {'x memcpy':>9}")
    for r in rows:
        print(
            f"{r.backend:12} {r.blocks:6d} {r.nbytes / 1e6:8.1f} {r.seconds * 1e3:9.2f} "
            f"{r.gbps:7.2f} {r.vs_memcpy:9.3f}"
        )
    return rows


def _start_ray() -> str:
    import ray

    ray.init(
        address="local",  # a cluster of its own, never one `ray start` left on the machine
        num_cpus=2,
        _node_ip_address=RAY_NODE_IP,
        include_dashboard=False,
        log_to_driver=False,
        object_store_memory=1 << 30,
    )
    return str(ray.get_runtime_context().gcs_address)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backends", nargs="+", default=["nixl", "torch", "ray", "local"])
    parser.add_argument("--blocks", nargs="+", type=int, default=[1, 16, 256])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--slice", action="store_true",
                        help="also a TP hand-off: 2 of the 3 KV heads into a full receiver")
    args = parser.parse_args()
    run(args.backends, block_counts=args.blocks, repeats=args.repeats, sliced=args.slice)


if __name__ == "__main__":
    main()
