"""``pdserve serve --autoscale`` without Ray: the ``AutoscaleLoop`` over an in-process
router (the ``Pair`` harness) and the real ``Scaler``, whose ``Cluster`` makes
in-process workers instead of Ray actors. Each period is one ``step()`` call on a
fake clock: no timers, no sleeps."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry

from pdserve.cli.main import _cluster_config, build_parser
from pdserve.cli.main import main as cli_main
from pdserve.cluster.autoscale import AutoscaleLoop, build_autoscaler, p90
from pdserve.cluster.cluster import Cluster, StartupError
from pdserve.cluster.config import ClusterConfig
from pdserve.cluster.scaler import Scaler
from pdserve.engine.config import EngineConfig
from pdserve.planner.step_times import Profile
from pdserve.router.metrics import RouterMetrics
from pdserve.router.router import Router
from pdserve.router.types import ErrorKind, FinalChunk, GenerateRequest, StageTimings, Usage
from pdserve.worker.decode import DecodeWorker
from pdserve.worker.prefill import PrefillWorker
from tests.inprocess import GREEDY, Pair, collect, run
from tests.waiting import until_async

# 100 ms per prompt (a prefill worker serves ~9.5 req/s within a 1 s TTFT), decode
# steps far inside the TPOT SLO: the rate decides prefill, decode needs one worker.
PROFILE = Profile(model="tiny", device="cpu", dtype="float32", quantization="none", threads=1,
                  prefill_coef=(100.0, 0.0, 0.0), decode_coef=(10.0, 1.0, 0.0),
                  kv_bytes_per_token=1024, kv_tokens=100_000)
SLOS = {"ttft_slo_ms": 1000.0, "tpot_slo_ms": 2000.0}


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


class LocalCluster(Cluster):
    """A ``Cluster`` never started (no Ray): the pair's workers are its pools; an
    added worker is an in-process one (after ``gate`` opens, if given; ``fail``: a
    ``StartupError`` instead)."""

    def __init__(self, pair: Pair, model: Path, gate: threading.Event | None = None,
                 fail: bool = False) -> None:
        super().__init__(ClusterConfig(transfer="local"))
        self.pair, self.model, self.gate, self.fail = pair, model, gate, fail
        self.roles = {w.worker_id: w.role for w in pair.workers}
        self.added = 0

    def add_worker(self, role: str) -> PrefillWorker | DecodeWorker:  # type: ignore[override]
        if self.gate is not None:
            self.gate.wait(30)
        if self.fail:
            raise StartupError(f"no room for a {role} worker")
        wid = f"{role}-{sum(r == role for r in self.roles.values())}"
        self.roles[wid] = role  # counted while it starts, as Cluster does
        cfg = EngineConfig(role=role, num_blocks=128)  # type: ignore[arg-type]
        w: PrefillWorker | DecodeWorker
        if role == "prefill":
            w = PrefillWorker(wid, self.model, cfg, "local")
            self.pair.prefill.append(w)  # closed (and checked for leaks) with the pair
        else:
            w = DecodeWorker(wid, self.model, cfg, "local", kv_timeout_s=5)
            self.pair.decode.append(w)
        self.added += 1
        return w

    def remove_worker(self, worker_id: str) -> None:
        self.roles.pop(worker_id)  # the pair closes the worker itself

    def check_room(self, adds: dict[str, int]) -> None:
        """In process there is always room (``fail`` makes the add itself fail)."""


def make_loop(pair: Pair, cluster: LocalCluster, clock: Clock,
              **cfg: object) -> tuple[AutoscaleLoop, Scaler]:
    config = ClusterConfig(transfer="local", autoscale=True, **{**SLOS, **cfg})  # type: ignore[arg-type]
    scaler = Scaler(cluster, pair.router, drain_timeout_s=30)
    return AutoscaleLoop(pair.router, scaler, build_autoscaler(config, "unused", PROFILE),
                         clock=clock), scaler


def final(ttft_ms: float, tpot_ms: float, prompt: int, output: int,
          reason: str = "length") -> FinalChunk:
    return FinalChunk(reason, Usage(prompt, output), timings=StageTimings(
        ttft=ttft_ms / 1e3, inter_token=[tpot_ms / 1e3] * (output - 1),
        tokens_after_first=output - 1))


# ---------------------------------------------------------------- config, CLI
def test_autoscale_needs_both_slos_and_sane_bounds() -> None:
    with pytest.raises(ValueError, match="autoscale needs ttft_slo_ms and tpot_slo_ms"):
        ClusterConfig(autoscale=True)
    with pytest.raises(ValueError, match="autoscale needs tpot_slo_ms"):
        ClusterConfig(autoscale=True, ttft_slo_ms=500)
    with pytest.raises(ValueError, match=r"1 <= autoscale_min_decode \(3\) <= autoscale_max_decode \(2\)"):
        ClusterConfig(autoscale=True, autoscale_min_decode=3, autoscale_max_decode=2, **SLOS)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="autoscale_min_prefill"):
        ClusterConfig(autoscale=True, autoscale_min_prefill=0, **SLOS)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="colocated pools are not autoscaled"):
        ClusterConfig.from_dict({"autoscale": True, **SLOS, "prefill": {"workers": 0},
                                 "decode": {"workers": 0}, "colocated": {"workers": 1}})
    ClusterConfig(autoscale_min_decode=3, autoscale_max_decode=2)  # not checked when off


def test_serve_flags_map_onto_the_config(capsys: pytest.CaptureFixture[str]) -> None:
    args = build_parser().parse_args([
        "serve", "--autoscale", "--ttft-slo-ms", "800", "--tpot-slo-ms", "60",
        "--min-decode", "2", "--max-decode", "6", "--max-prefill", "3",
        "--autoscale-profile", "p.json", "--autoscale-interval-s", "2"])
    cfg = _cluster_config(args)
    assert (cfg.autoscale, cfg.autoscale_profile, cfg.autoscale_interval_s) == (True, "p.json", 2)
    assert (cfg.autoscale_min_prefill, cfg.autoscale_max_prefill) == (1, 3)
    assert (cfg.autoscale_min_decode, cfg.autoscale_max_decode) == (2, 6)
    assert not _cluster_config(build_parser().parse_args(["serve"])).autoscale
    # Without the SLOs: one line, status 2, before anything starts.
    assert cli_main(["serve", "--autoscale", "--ttft-slo-ms", "800"]) == 2
    assert "autoscale needs tpot_slo_ms" in capsys.readouterr().err


def test_p90_nearest_rank() -> None:
    assert p90([]) is None
    assert p90([7.0]) == 7.0
    assert p90([float(x) for x in range(10, 101, 10)]) == 90.0
    assert p90([float(x) for x in range(1, 101)]) == 90.0


# ---------------------------------------------------------------- snapshots
def test_snapshot_reads_router_and_scaler(pair_factory: Callable[..., Pair],
                                          tiny_model: Callable[[str], Path]) -> None:
    pair = pair_factory()
    registry = CollectorRegistry()
    inner = RouterMetrics(registry, "tiny")
    pair.router.metrics = inner
    clock = Clock()
    loop, scaler = make_loop(pair, LocalCluster(pair, tiny_model("llama-gqa")), clock,
                             autoscale_interval_s=60)

    async def body(router: Router) -> None:
        await until_async("loads probed", lambda: all(
            w.load is not None for w in router.workers.workers.values()))
        for i in range(10):  # TTFT 10..100 ms, TPOT 2..20 ms, prompts 100..190
            router.metrics.observe_finished(final(10.0 * (i + 1), 2.0 * (i + 1), 100 + 10 * i, 5))
        router.metrics.observe_finished(final(5000, 500, 1000, 1, reason="error"))
        router.metrics.observe_rejected(ErrorKind.OVERLOADED)
        clock.now += 4.0
        snap = loop.snapshot()
        assert snap.arrival_rate == pytest.approx(12 / 4)  # 10 + 1 finished, 1 rejected
        assert snap.ttft_p90_ms == pytest.approx(100)  # 11 TTFTs: the error's counts ...
        assert snap.tpot_p90_ms == pytest.approx(18)  # ... 10 TPOTs: it had one token
        assert snap.prompt_len == pytest.approx(145) and snap.output_len == 5  # served only
        assert snap.prefill.prefill_tokens_per_s == pytest.approx((1450 + 1000) / 4)
        for pool in (snap.prefill, snap.decode):
            assert (pool.workers, pool.waiting, pool.running) == (1, 0, 0)
            assert pool.kv_usage == pytest.approx(0.0)
        # Every call still reached the router's metrics.
        assert registry.get_sample_value("pdserve_requests_total", {
            "model": "tiny", "role": "router", "status": "length"}) == 10
        assert registry.get_sample_value("pdserve_requests_total", {
            "model": "tiny", "role": "router", "status": "overloaded"}) == 1

        # The window restarts at each snapshot. A target not reached yet counts (its
        # workers are starting); the scaler is not reconciling here.
        scaler.set_targets({"decode": 2})
        clock.now += 1.0
        snap = loop.snapshot()
        assert (snap.arrival_rate, snap.ttft_p90_ms, snap.prompt_len) == (0.0, None, None)
        assert (snap.prefill.workers, snap.decode.workers) == (1, 2)

        # Requests in flight count as arrivals (and as running): a request held by
        # its stream, not finished.
        gen = router.generate(GenerateRequest("held", GREEDY, prompt_token_ids=[5, 6, 7]))
        await gen.__anext__()  # its first token
        clock.now += 2.0
        snap = loop.snapshot()
        assert snap.arrival_rate == pytest.approx(0.5)
        assert snap.decode.running == 1
        async for _ in gen:  # let it finish
            pass

        loop.start()
        await loop.stop()  # the tap comes out again
        assert router.metrics is inner

    run(pair, body)


# ---------------------------------------------------------------- decisions
def test_load_scales_up_through_the_scaler(pair_factory: Callable[..., Pair],
                                           tiny_model: Callable[[str], Path]) -> None:
    model = tiny_model("llama-gqa")
    pair = pair_factory()
    cluster = LocalCluster(pair, model)
    clock = Clock()
    loop, scaler = make_loop(pair, cluster, clock, autoscale_max_prefill=3)
    prompts = [[5 + (i * 7 + j) % 300 for j in range(8 + i)] for i in range(24)]

    async def body(router: Router) -> None:
        scaler.start()
        try:
            await asyncio.gather(*(collect(router.generate(GenerateRequest(
                f"r{i}", GREEDY, prompt_token_ids=p))) for i, p in enumerate(prompts)))
            clock.now += 1.0  # 24 requests in one second: the plan needs 3 prefill workers
            decision = loop.step()
            assert decision == {"prefill": 2, "decode": 1}  # one worker per decision
            assert "rate needs 3" in loop.autoscaler.reasons["prefill"]
            assert scaler.targets == {"prefill": 2, "decode": 1, "colocated": 0}
            await until_async("the new prefill worker serving", lambda: scaler.status()["reached"]
                              and "prefill-1" in {w.worker_id for w in router.workers.live("prefill")})
            assert cluster.added == 1
            # Quiet now: the same targets, so nothing goes to the scaler.
            clock.now += 5.0
            assert loop.step() == {"prefill": 2, "decode": 1}
            assert cluster.added == 1 and scaler.targets["prefill"] == 2
        finally:
            await scaler.stop()

    run(pair, body)


def test_a_failed_add_is_tried_again_while_the_load_still_needs_it(
        pair_factory: Callable[..., Pair], tiny_model: Callable[[str], Path]) -> None:
    """The scaler does not retry a failed add by itself, and while the load lasts each
    decision equals the failed target: it goes to the scaler again (a "hold" would
    leave the pool short for as long as the load lasts), and once there is room the
    worker is added."""
    pair = pair_factory()
    cluster = LocalCluster(pair, tiny_model("llama-gqa"), fail=True)
    clock = Clock()
    loop, scaler = make_loop(pair, cluster, clock, autoscale_max_prefill=3)
    prompts = [[5 + (i * 7 + j) % 300 for j in range(8 + i)] for i in range(24)]

    async def body(router: Router) -> None:
        async def one_second_of_load(tag: str) -> None:  # the plan needs 3 prefill workers
            await asyncio.gather(*(collect(router.generate(GenerateRequest(
                f"{tag}{i}", GREEDY, prompt_token_ids=p))) for i, p in enumerate(prompts)))
            clock.now += 1.0

        scaler.start()
        try:
            await one_second_of_load("a")
            assert loop.step() == {"prefill": 2, "decode": 1}
            await until_async("the add failing", lambda: scaler.status()["error"] is not None
                              and not scaler.status()["busy"])
            assert cluster.added == 0 and scaler.current()["prefill"] == 1
            cluster.fail = False  # room now (say, a node joined)
            await one_second_of_load("b")
            assert loop.step() == {"prefill": 2, "decode": 1}  # the failed target, again
            await until_async("the new prefill worker serving", lambda: scaler.status()["reached"]
                              and "prefill-1" in {w.worker_id for w in router.workers.live("prefill")})
            assert cluster.added == 1 and scaler.status()["error"] is None
        finally:
            await scaler.stop()

    run(pair, body)


def test_idle_scales_down_after_the_cooldown_within_bounds(
        pair_factory: Callable[..., Pair], tiny_model: Callable[[str], Path]) -> None:
    pair = pair_factory(n_decode=2)
    clock = Clock()
    loop, scaler = make_loop(pair, LocalCluster(pair, tiny_model("llama-gqa")), clock,
                             autoscale_min_decode=1)
    cooldown = loop.autoscaler.cooldown

    async def body(router: Router) -> None:
        scaler.start()
        try:
            decisions = []
            for _ in range(cooldown):
                clock.now += 5.0
                decisions.append(loop.step())
            # Held through the cool-down, then one decode worker less.
            assert decisions[:-1] == [{"prefill": 1, "decode": 2}] * (cooldown - 1)
            assert decisions[-1] == {"prefill": 1, "decode": 1}
            assert scaler.targets["decode"] == 1
            await until_async("decode-1 drained", lambda: scaler.status()["reached"])
            assert set(router.workers.workers) == {"prefill-0", "decode-0"}  # the newest went
            # Idle for longer: never below the bounds.
            for _ in range(2 * cooldown):
                clock.now += 5.0
                assert loop.step() == {"prefill": 1, "decode": 1}
            assert scaler.targets == {"prefill": 1, "decode": 1, "colocated": 0}
        finally:
            await scaler.stop()

    run(pair, body)


def test_no_decision_while_the_scaler_is_busy(pair_factory: Callable[..., Pair],
                                              tiny_model: Callable[[str], Path]) -> None:
    pair = pair_factory()
    gate = threading.Event()
    clock = Clock()
    loop, scaler = make_loop(pair, LocalCluster(pair, tiny_model("llama-gqa"), gate, fail=True),
                             clock)

    async def body(router: Router) -> None:
        scaler.start()
        try:
            scaler.set_targets({"decode": 2})  # an operator's `pdserve scale`
            await until_async("the scaler adding a worker", lambda: scaler.status()["busy"])
            clock.now += 5.0
            assert loop.step() is None  # nothing decided ...
            assert loop.last_decision is None and not loop.autoscaler.reasons
            assert scaler.targets["decode"] == 2  # ... nor applied
            gate.set()  # the add fails: no room
            await until_async("the add failing", lambda: scaler.status()["error"] is not None)
            await until_async("the scaler idle", lambda: not scaler.status()["busy"])
            # Decided from the pool's real size (1), not the failed target (2): idle,
            # it holds at 1, which replaces the target.
            clock.now += 5.0
            assert loop.step() == {"prefill": 1, "decode": 1}
            assert loop.last_snapshot is not None and loop.last_snapshot.decode.workers == 1
            assert scaler.targets == {"prefill": 1, "decode": 1, "colocated": 0}
            assert scaler.status()["error"] is None
        finally:
            gate.set()
            await scaler.stop()

    run(pair, body)
