"""``CoreShare``: phase-aware compute on a shared node -- the workers whose pools
share a machine's cores lend them to each other while idle.

A prefill and a decode worker on one machine each own some cores (their pool's
``num_cpus``). Prefill is bursty, decode continuous: most of the time one of them has
nothing to compute, and its cores would sit idle. So before every engine step a
worker asks how many threads it may use (``acquire``), and when it has nothing to do
it says so (``release``):

* a worker with work gets its own cores, plus the cores of every member that has
  none (idle owners lend; busy ones share what is lent, a core at a time), up to its
  pool's maximum (``num_cpus + shared_cpus``); cores no live member owns (the other
  pool's worker died, or has not started) are lent too;
* a member whose process is stopped (SIGSTOP, a debugger) counts as gone until it
  runs again: its cores are lent, and nobody waits for the threads it held;
* an owner that has work again takes its cores back at the borrowers' next step
  boundary: ``acquire`` waits, polling, until the others' threads in use leave its
  own cores free (at most ``max_wait_s``; then it starts anyway), so no two
  workers' OpenMP threads spin on one core.

The members meet in one small shared-memory file (``path``; by default one per user
and machine in ``/dev/shm``): one slot per worker process holding its own and
largest thread counts, whether it has work, the threads it uses now, and its pid
with that process's start time (a pid can be reused). A slot whose process is gone
counts for nothing (its cores are lent), one that released as idle; a new worker
takes a free slot. Reading every slot and writing one's own happens under an exclusive
``flock`` on the file, so two workers waking together cannot both take the same
lent core. Each call costs a few microseconds.

Threads change only at step boundaries, and every kernel gives the same bits at
every thread count (docs/internals.md, "Batch invariance by construction"), so
lending changes no token. Tensor-parallel workers keep their threads (their ranks
are other processes).
"""

from __future__ import annotations

import contextlib
import fcntl
import mmap
import os
import socket
import struct
import time
from collections.abc import Iterator
from pathlib import Path

SLOTS = 64
_SLOT = struct.Struct("=iiiiqq")  # own, most, wants (0/1), in_use, pid, pid's start time
POLL_S = 0.0005  # how often a waiting owner looks again
MAX_WAIT_S = 0.5  # an owner never waits longer for its cores than this


def default_path() -> Path:
    base = Path("/dev/shm") if Path("/dev/shm").is_dir() else Path("/tmp")
    return base / f"pdserve-cores-{os.getuid()}"


def _process(pid: int) -> tuple[int, bool]:
    """When process ``pid`` started (clock ticks since boot; 0 if there is none: a
    slot's pid is its writer only while this matches, pids are reused), and whether
    it is stopped (SIGSTOP, a debugger: it computes nothing and answers nothing)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return 0, False
    fields = stat[stat.rindex(")") + 2:].split()
    return int(fields[19]), fields[0] in ("T", "t")


class CoreShare:
    """This process's slot in the node's core-sharing group (module docstring)."""

    def __init__(self, own: int, most: int, path: Path | None = None,
                 max_wait_s: float = MAX_WAIT_S) -> None:
        if not 1 <= own <= most:
            raise ValueError(f"core sharing needs 1 <= own ({own}) <= most ({most})")
        self.own, self.most, self.max_wait_s = own, most, max_wait_s
        self.path = path or default_path()
        self._started = _process(os.getpid())[0]
        self._fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            with self._locked():
                if os.fstat(self._fd).st_size < SLOTS * _SLOT.size:
                    os.ftruncate(self._fd, SLOTS * _SLOT.size)
                self._map = mmap.mmap(self._fd, SLOTS * _SLOT.size)
                self.slot = self._claim()
        except BaseException:
            os.close(self._fd)
            raise
        # who shares these cores: the file, on this machine
        self.group = f"{socket.gethostname()}:{self.path}"
        self.threads = own  # what the last acquire granted
        self.waited_s = 0.0  # total time acquire waited for the owners' cores
        self.borrowed_steps = 0  # steps run on more than its own cores

    @contextlib.contextmanager
    def _locked(self) -> Iterator[None]:
        fcntl.flock(self._fd, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(self._fd, fcntl.LOCK_UN)

    def _read(self, i: int) -> tuple[int, int, int, int, int, bool]:
        """Slot ``i``'s (own, most, wants, in_use, pid, stopped); pid 0 when its writer
        is gone (the slot is free), ``stopped`` while its writer is stopped (the slot is
        still its own, but it uses and owns no core until it runs again)."""
        own, most, wants, in_use, pid, started = _SLOT.unpack_from(self._map, i * _SLOT.size)
        if not (0 < pid < 1 << 22 and started > 0):
            return own, most, wants, in_use, 0, False
        began, stopped = _process(pid)
        return own, most, wants, in_use, pid if began == started else 0, stopped

    def _write(self, wants: int, in_use: int) -> None:
        _SLOT.pack_into(self._map, self.slot * _SLOT.size, self.own, self.most, wants, in_use,
                        os.getpid(), self._started)

    def _claim(self) -> int:
        for i in range(SLOTS):
            if not self._read(i)[4]:
                self.slot = i
                self._write(0, 0)
                return i
        raise RuntimeError(f"core sharing: all {SLOTS} slots of {self.path} are taken")

    def _others(self) -> list[tuple[int, int, int, int, int]]:
        """(slot, own, most, wants, in_use) of the live members besides this one (a
        stopped one's cores are lent: waiting for it would stall every step)."""
        out = []
        for i in range(SLOTS):
            if i == self.slot:
                continue
            own, most, wants, in_use, pid, stopped = self._read(i)
            if pid and own and not stopped:
                out.append((i, own, most, wants, in_use))
        return out

    def _grant(self, others: list[tuple[int, int, int, int, int]]) -> tuple[int, int, int]:
        """(threads this worker may use, the others' threads in use now, the group's
        cores). The group's cores are its members' own, or as many as a member may use
        at most if more (a member that died, or has not started yet, owns cores that
        nobody uses now). The idle members' cores and those are dealt one at a time to
        the busy members in slot order, each up to its most."""
        owned = self.own + sum(own for _, own, *_ in others)
        total = max(owned, self.most, *(most for _, _, most, *_ in others))
        lent = total - owned + sum(own for _, own, _, wants, _ in others if not wants)
        busy = sorted([(self.slot, self.own, self.most),
                       *((i, own, most) for i, own, most, wants, _ in others if wants)])
        extra = dict.fromkeys((i for i, *_ in busy), 0)
        while lent > 0 and any(own + extra[i] < most for i, own, most in busy):
            for i, own, most in busy:
                if lent > 0 and own + extra[i] < most:
                    extra[i] += 1
                    lent -= 1
        in_use = sum(use for *_, use in others)
        return self.own + extra[self.slot], in_use, total

    def acquire(self) -> int:
        """Before a step: the threads to use (waits, at most ``max_wait_s``, until the
        others leave this worker's own cores free)."""
        deadline = None
        start = time.monotonic()
        while True:
            with self._locked():
                threads, in_use, total = self._grant(self._others())
                # what is free now may be less than the grant: others still on lent cores
                threads = max(self.own, min(threads, total - in_use))
                if in_use + threads <= total or (deadline is not None
                                                 and time.monotonic() >= deadline):
                    self._write(1, threads)
                    break
                self._write(1, 0)  # ask: the borrowers see it at their next step
            if deadline is None:
                deadline = start + self.max_wait_s
            time.sleep(POLL_S)
        if deadline is not None:
            self.waited_s += time.monotonic() - start
        if threads > self.own:
            self.borrowed_steps += 1
        self.threads = threads
        return threads

    def release(self) -> None:
        """Nothing to compute: lend every core (until the next ``acquire``)."""
        with self._locked():
            self._write(0, 0)

    def close(self) -> None:
        with contextlib.suppress(OSError, ValueError):
            with self._locked():
                _SLOT.pack_into(self._map, self.slot * _SLOT.size, 0, 0, 0, 0, 0, 0)
            self._map.close()
        with contextlib.suppress(OSError):
            os.close(self._fd)
