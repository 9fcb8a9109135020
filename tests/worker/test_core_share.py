"""Phase-aware core sharing (pdserve/worker/core_share.py): an idle worker's cores go to a busy
one, and come back at the borrower's next step boundary; no two workers' threads are
granted one core, a dead member's slot lends everything, the wait is bounded."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from pdserve.worker.core_share import CoreShare
from tests.waiting import until


@pytest.fixture
def group(tmp_path: Path):  # type: ignore[no-untyped-def]
    made: list[CoreShare] = []

    def member(own: int = 1, most: int = 2, max_wait_s: float = 5.0) -> CoreShare:
        made.append(CoreShare(own, most, tmp_path / "cores", max_wait_s=max_wait_s))
        return made[-1]

    yield member
    for m in made:
        m.close()


def test_an_idle_members_cores_go_to_the_busy_one(group) -> None:  # type: ignore[no-untyped-def]
    prefill, decode = group(), group()
    assert decode.acquire() == 2  # prefill has nothing to do: decode takes both
    decode.release()
    assert prefill.acquire() == 2  # and the other way round
    prefill.release()


def test_an_owner_gets_its_cores_back_at_the_borrowers_next_step(group) -> None:  # type: ignore[no-untyped-def]
    prefill, decode = group(), group()
    assert decode.acquire() == 2  # a long decode step on both cores
    got: list[int] = []
    waiter = threading.Thread(target=lambda: got.append(prefill.acquire()))
    waiter.start()
    # prefill waits: its core is in use; it has asked for it back
    until("prefill to ask for its core", lambda: prefill._read(prefill.slot)[2] == 1)
    assert not got
    assert decode.acquire() == 1  # decode's next step boundary: its own core only
    waiter.join(timeout=10)
    assert got == [1]
    assert prefill.waited_s > 0
    # both busy: each on its own; once prefill is idle again, decode takes both
    assert decode.acquire() == 1
    prefill.release()
    assert decode.acquire() == 2


def test_lent_cores_are_dealt_out_whole(group) -> None:  # type: ignore[no-untyped-def]
    a, b, c = group(1, 3), group(1, 3), group(1, 3)
    assert a.acquire() == 3  # b and c idle
    a.release()
    assert b.acquire() == 3
    got: list[int] = []
    waiter = threading.Thread(target=lambda: got.append(c.acquire()))
    waiter.start()
    until("c to ask for its core", lambda: c._read(c.slot)[2] == 1)
    # b's next step: a's idle core goes to one of the two busy members, never both
    mine = b.acquire()
    waiter.join(timeout=10)
    assert sorted([mine, got[0]]) == [1, 2]


def test_the_wait_is_bounded(group) -> None:  # type: ignore[no-untyped-def]
    hog, late = group(), group(max_wait_s=0.05)
    assert hog.acquire() == 2  # and never comes back to a step boundary
    assert late.acquire() == 1  # starts on its own core after max_wait_s


def test_a_dead_members_slot_lends_everything(tmp_path: Path) -> None:
    # a member that died without closing its slot (SIGKILL, a crash)
    code = (f"from pdserve.worker.core_share import CoreShare; "
            f"c = CoreShare(1, 2, __import__('pathlib').Path({str(tmp_path / 'cores')!r})); "
            f"c.acquire(); import os; os._exit(0)")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)
    alive = CoreShare(1, 2, tmp_path / "cores", max_wait_s=5.0)
    try:
        assert alive.acquire() == 2
    finally:
        alive.close()


def test_a_stopped_members_cores_are_lent_and_nobody_waits_for_them(tmp_path: Path) -> None:
    """A member stopped mid-step (SIGSTOP, a debugger) holds its threads' claim but will
    not give them back: the others take its cores at once instead of waiting
    ``max_wait_s`` at every step (a stopped prefill worker slowed the whole node so
    much that every retried transfer timed out); running again, it counts again."""
    code = (f"from pdserve.worker.core_share import CoreShare; import sys; "
            f"c = CoreShare(1, 2, __import__('pathlib').Path({str(tmp_path / 'cores')!r})); "
            f"print(c.acquire(), flush=True); sys.stdin.read()")
    child = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, text=True)
    other = None
    try:
        assert child.stdout is not None and child.stdout.readline().strip() == "2"
        os.kill(child.pid, signal.SIGSTOP)
        until("the member to stop", lambda: Path(f"/proc/{child.pid}/stat").read_text()
              .rsplit(")", 1)[1].split()[0] in ("T", "t"))
        other = CoreShare(1, 2, tmp_path / "cores", max_wait_s=30.0)
        assert other.acquire() == 2 and other.waited_s == 0.0
        other.release()
        os.kill(child.pid, signal.SIGCONT)  # running again: its own core is its own
        until("the member to run", lambda: Path(f"/proc/{child.pid}/stat").read_text()
              .rsplit(")", 1)[1].split()[0] not in ("T", "t"))
        other.max_wait_s = 0.05  # it claims 2 threads and never comes to a step boundary
        assert other.acquire() == 1 and other.waited_s > 0  # waited for it, as for any
    finally:
        os.kill(child.pid, signal.SIGCONT)
        child.kill()
        child.wait(30)
        if other is not None:
            other.close()


def test_bad_limits_are_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="own"):
        CoreShare(2, 1, tmp_path / "cores")


def test_a_slot_of_no_process_lends_everything(tmp_path: Path) -> None:
    """A slot whose pid names no process -- or whose bytes are not a slot at all (an
    older layout of the file) -- counts for nothing."""
    import struct

    path = tmp_path / "cores"
    path.write_bytes(struct.pack("=iiiiqq", 1, 2, 23707, 2, 8589934593, 0)
                     + struct.pack("=iiiiqq", 1, 2, 1, 2, 2**22 - 1, 0) + bytes(64 * 32))
    alone = CoreShare(1, 2, path, max_wait_s=5.0)
    try:
        assert alone.acquire() == 2
        assert alone.waited_s == 0.0
    finally:
        alone.close()


def test_a_worker_lends_its_cores_once_its_last_step_is_done(tiny_model, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    """Not after its loop's idle wait: until then the other worker would run on its own
    cores alone."""
    from pdserve.engine.config import EngineConfig
    from pdserve.engine.sampling.sampling_params import SamplingParams
    from pdserve.worker.colocated import ColocatedWorker

    cores = CoreShare(1, 2, tmp_path / "cores")
    w = ColocatedWorker("colocated-0", tiny_model("llama-gqa"), EngineConfig(
        role="colocated", num_blocks=64, num_threads=2), cores=cores)
    try:
        w.loop.idle_wait_s = 600.0  # an idle loop wakes only for a call
        assert w.loop.call(lambda: w._admit("r", list(range(3, 40)), SamplingParams(
            max_tokens=3, ignore_eos=True), "")).result(timeout=30)
        until("the request to finish", lambda: not w.engine.has_request("r"))
        until("its cores lent", lambda: cores._read(cores.slot)[2:4] == (0, 0))
    finally:
        w.close()
