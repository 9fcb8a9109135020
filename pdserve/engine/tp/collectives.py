"""``TPGroup``: the ranks of one engine and their collectives, on a c10d group of
their own (gloo on CPU, NCCL on CUDA) over the leader's TCPStore; ``ShmAllReduce``
for CPU ranks of one machine."""

from __future__ import annotations

import contextlib
import datetime
import logging
import os
import pickle
import time
import uuid
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

log = logging.getLogger(__name__)
TIMEOUT_S = 300.0  # a collective not completed in this long fails (a rank is gone)


class TPGroup:
    """The ranks of one engine and their collectives."""

    def __init__(self, rank: int, size: int, host: str, port: int, device: torch.device,
                 timeout_s: float = TIMEOUT_S, store: dist.TCPStore | None = None) -> None:
        self.rank, self.size, self.device = rank, size, device
        timeout = datetime.timedelta(seconds=timeout_s)
        self.store = store or dist.TCPStore(host, port, size, is_master=False, timeout=timeout)
        self._cpu: Any = dist.ProcessGroupGloo(dist.PrefixStore("cpu/", self.store), rank,
                                               size, timeout)
        if device.type == "cuda":
            opts = dist.ProcessGroupNCCL.Options()
            opts._timeout = timeout
            self._dev: Any = dist.ProcessGroupNCCL(dist.PrefixStore("dev/", self.store), rank,
                                                   size, opts)
        else:
            self._dev = self._cpu
        self.collective_s = 0.0  # time spent in collectives (the all-reduce share of a step)
        self._shm: ShmAllReduce | None = None
        # Why another rank is gone (None: not known to be); set by the process that can
        # tell (the leader watches its followers, a follower its leader).
        self.peer_gone: Callable[[], str | None] = lambda: None
        # The leader: how its last replicated call ended (a ValueError's text, or None);
        # sent with the next call so that each follower checks its own against it.
        self.last_error: str | None = None

    @classmethod
    def host_store(cls, size: int, host: str = "127.0.0.1") -> dist.TCPStore:
        """The leader's store on a free port (``store.port``), before followers exist."""
        return dist.TCPStore(host, 0, size, is_master=True, wait_for_workers=False,
                             timeout=datetime.timedelta(seconds=TIMEOUT_S))

    def use_shared_memory(self, max_elems: int) -> None:
        """CPU ranks of one machine: all-reduce through shared memory from now on
        (``ShmAllReduce``); every rank calls this, in the same order."""
        if self.device.type == "cpu" and self.size > 1:
            self._shm = ShmAllReduce(self.store, self.rank, self.size, max_elems)
            self._shm.peer_gone = lambda: self.peer_gone()

    def all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        """Sum ``t`` over the ranks, in place (the same bits on every rank)."""
        with self._timed():
            if self._shm is not None and self._shm.fits(t):
                self._shm.all_reduce(t)
            else:
                self._wait(self._dev.allreduce([t]))
        return t

    def gather(self, t: torch.Tensor) -> list[torch.Tensor] | None:
        """Rank 0: every rank's ``t`` (the same shape and dtype on all); others: None."""
        t = t.contiguous()
        wire = self._wire(t)
        with self._timed():
            if self.device.type == "cuda":  # NCCL has no gather: all-gather
                outs = [torch.empty_like(wire) for _ in range(self.size)]
                self._wait(self._dev.allgather([outs], [wire]))
            else:
                opts = dist.GatherOptions()
                opts.rootRank = 0
                outs = [torch.empty_like(wire) for _ in range(self.size)] if self.rank == 0 else []
                self._wait(self._cpu.gather([outs] if self.rank == 0 else [], [wire], opts))
        return [o.view(t.dtype) for o in outs] if self.rank == 0 else None

    def gather_last(self, t: torch.Tensor) -> torch.Tensor | None:
        """Rank 0: every rank's ``t`` concatenated along the last dim; others: None."""
        outs = self.gather(t)
        return None if outs is None else torch.cat(outs, dim=-1)

    def _wire(self, t: torch.Tensor) -> torch.Tensor:
        """gloo moves no 16-bit floats: their bytes instead (NCCL takes them as is)."""
        if self.device.type != "cuda" and t.dtype in (torch.bfloat16, torch.float16):
            return t.view(torch.uint8)
        return t

    def broadcast_ints(self, values: list[int] | None, n: int) -> list[int]:
        """Rank 0's ``n`` ints on every rank."""
        t = (torch.tensor(values, dtype=torch.int64) if self.rank == 0
             else torch.empty(n, dtype=torch.int64))
        self._broadcast(t)
        return [int(x) for x in t.tolist()]

    def broadcast_object(self, obj: Any = None) -> Any:
        """Rank 0's ``obj`` (pickled) on every rank."""
        data = pickle.dumps(obj) if self.rank == 0 else b""
        size = torch.tensor([len(data)], dtype=torch.int64)
        self._broadcast(size)
        buf = (torch.frombuffer(bytearray(data), dtype=torch.uint8) if self.rank == 0
               else torch.empty(int(size.item()), dtype=torch.uint8))
        self._broadcast(buf)
        return obj if self.rank == 0 else pickle.loads(buf.numpy().tobytes())

    def _broadcast(self, t: torch.Tensor) -> None:
        opts = dist.BroadcastOptions()
        opts.rootRank = 0
        self._wait(self._cpu.broadcast([t], opts))

    def _wait(self, work: Any) -> None:
        try:
            work.wait()
        except RuntimeError as exc:  # gloo: "Connection closed by peer ..."
            # A killed rank's socket resets a moment before its exit can be seen: wait
            # (briefly) to name it rather than pass on gloo's words.
            gone, deadline = self.peer_gone(), time.monotonic() + 2.0
            while gone is None and time.monotonic() < deadline:
                time.sleep(0.02)
                gone = self.peer_gone()
            raise RuntimeError(f"tensor-parallel collective failed: {gone or exc}") from exc

    @contextlib.contextmanager
    def _timed(self) -> Any:
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self.collective_s += time.perf_counter() - t0


class ShmAllReduce:
    """All-reduce for CPU ranks on one machine through a shared-memory file.

    A decode step all-reduces a few KiB twice per layer; over gloo's loopback TCP each
    costs ~1 ms (measured: 11 s of a 64-token run was collectives, 127 ms/token against
    39 ms at TP=1). Here each rank copies its tensor into its slot, publishes a sequence
    number, waits for every rank's number, and sums the slots in rank order -- the same
    bits on every rank. Two slot sets alternate: a rank can be at most one all-reduce
    ahead of the slowest (it needs everyone's number to finish the current one), so the
    set it writes next is never still being read. x86 keeps stores in order, so a
    number seen means its slot's data is there.
    """

    FLAG_STRIDE = 8  # int64s between two ranks' numbers: one cache line each

    def __init__(self, store: dist.Store, rank: int, size: int, max_elems: int,
                 timeout_s: float = TIMEOUT_S) -> None:
        self.rank, self.size, self.max_elems, self.timeout_s = rank, size, max_elems, timeout_s
        flag_bytes = size * self.FLAG_STRIDE * 8
        nbytes = flag_bytes + 2 * size * max_elems * 4
        if rank == 0:
            path = f"/dev/shm/pdserve-tp-{os.getpid()}-{uuid.uuid4().hex[:8]}"
            with open(path, "wb") as f:
                f.truncate(nbytes)
            store.set("shm/path", path)
        path = store.get("shm/path").decode()
        raw = torch.from_file(path, shared=True, size=nbytes, dtype=torch.uint8)
        store.set(f"shm/mapped/{rank}", "1")
        if rank == 0:  # every rank has it mapped: the name can go (no file left behind)
            store.wait([f"shm/mapped/{r}" for r in range(size)])
            os.unlink(path)
        self._flags = raw[:flag_bytes].view(torch.int64)
        self._slots = raw[flag_bytes:].view(torch.float32).view(2, size, max_elems)
        self._seq = 0
        # Why a rank that never answers is gone (None: all alive); polled while waiting.
        self.peer_gone: Callable[[], str | None] = lambda: None

    def fits(self, t: torch.Tensor) -> bool:
        return t.dtype == torch.float32 and t.is_contiguous() and t.numel() <= self.max_elems

    def all_reduce(self, t: torch.Tensor) -> None:
        n, self._seq = t.numel(), self._seq + 1
        slots = self._slots[self._seq & 1]
        slots[self.rank, :n].copy_(t.view(-1))
        self._flags[self.rank * self.FLAG_STRIDE] = self._seq
        spins, deadline = 0, None
        for r in range(self.size):
            while int(self._flags[r * self.FLAG_STRIDE]) < self._seq:
                spins += 1
                if spins > 2000:  # more ranks than free cores: let the others run
                    os.sched_yield()
                    if spins % 1000 == 0:
                        gone = self.peer_gone()
                        if gone is not None:
                            raise RuntimeError(f"tensor-parallel all-reduce: {gone}")
                    if deadline is None:
                        deadline = time.monotonic() + self.timeout_s
                    elif time.monotonic() > deadline:
                        raise RuntimeError(f"tensor-parallel rank {r} did not join an "
                                           f"all-reduce in {self.timeout_s:.0f}s")
        torch.sum(slots[:, :n], dim=0, out=t.view(-1))
