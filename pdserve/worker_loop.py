"""``WorkerLoop``: what the prefill and decode workers share -- the engine in its
role on the loop thread, its KV layout, the per-step metrics (batch shape, step
time, FLOPs and bytes for MFU/MBU), the stats snapshot and the integrity check.
Each worker adds its transfer channel and its request hand-off."""

from __future__ import annotations

from concurrent.futures import Future
from pathlib import Path

from pdserve.engine.config import EngineConfig
from pdserve.engine.cost import cost_model
from pdserve.engine.engine import LLMEngine, RequestOutput
from pdserve.engine.loop import EngineLoop
from pdserve.kv_transfer import KVLayout
from pdserve.messages import WorkerStats


class WorkerLoop(EngineLoop):
    def __init__(self, role: str, worker_id: str, model_dir: str | Path,
                 config: EngineConfig) -> None:
        if config.role != role:
            raise ValueError(f"a {role} worker needs role={role!r}, got {config.role!r}")
        super().__init__(name=f"{role}-{worker_id}")
        self.worker_id = worker_id
        self.engine = LLMEngine(model_dir, config)
        self.layout = KVLayout(**self.engine.kv_layout_spec())  # type: ignore[arg-type]
        self._stats = WorkerStats(worker_id, role, 0, 0, 0, self.engine.num_blocks)
        self._cost = cost_model(self.engine.model_config, config.dtype)

    # ----------------------------------------------------- called from any thread
    def stats(self) -> Future[WorkerStats]:
        return self.call(self._snapshot)

    def check_integrity(self) -> Future[None]:
        return self.call(self.engine.check_integrity)

    # ---------------------------------------------------------------- loop side
    def busy(self) -> bool:
        return self.engine.has_unfinished()

    def _step(self) -> list[RequestOutput]:
        """One engine step, recorded in the worker's step metrics when it ran."""
        last = self.engine.last_step
        outputs = self.engine.step()
        info = self.engine.last_step
        if info is not None and info is not last:  # a batch ran (it may have been empty)
            self._stats.observe_step(info, *self._cost.step(info, len(outputs)))
        return outputs

    def _snapshot(self) -> WorkerStats:
        e, s = self.engine.stats(), self._stats
        s.num_running, s.num_waiting = e.num_running, e.num_waiting
        s.num_waiting_for_kv, s.num_free_blocks = e.num_waiting_for_kv, e.num_free_blocks
        s.queued_prefill_tokens = e.queued_prefill_tokens
        s.prefix_queries, s.prefix_hits = e.prefix_queries, e.prefix_hits
        s.num_preemptions = e.num_preemptions
        return WorkerStats(**vars(s))
