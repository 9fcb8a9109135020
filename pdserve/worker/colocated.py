"""``ColocatedWorker``: both phases in one engine (chunked prefill in the decode
batch), behind the same router, API and metrics as a prefill/decode pair.

The router admits a request here when the engine's free blocks cover its prompt
plus the prompts already queued (admission control: no room -> False, the router
waits or tries another worker); the request is queued at once and its tokens, the
first one included, go out on the worker's output stream like a decode worker's.
The first token's delta carries the prefill stage timings (this worker's clock).

A plain class with async methods: a sync constructor builds it in a test, the router
calls it in-process, ``cluster/actors.py`` wraps the class itself as a Ray actor.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from pathlib import Path

from pdserve.engine.config import EngineConfig, ceil_div
from pdserve.engine.sampling.sampling_params import SamplingParams
from pdserve.messages import JoinInfo
from pdserve.output_stream import OutputServer
from pdserve.tracing import Carrier, Tracing
from pdserve.worker.core_share import CoreShare
from pdserve.worker.loop import WorkerLoop, delta_of, prefill_stages


class ColocatedWorker(WorkerLoop):
    def __init__(self, worker_id: str, model_dir: str | Path, config: EngineConfig,
                 host: str = "127.0.0.1", cores: CoreShare | None = None,
                 tracing: Tracing | None = None) -> None:
        super().__init__("colocated", worker_id, model_dir, config, cores, tracing)
        self.outputs = OutputServer(host, f"outputs-{worker_id}", self._abort_orphans)
        self._received: dict[str, float] = {}  # request id -> admitted at (until its first token)
        self.start()

    # ------------------------------------------------------------ async API
    async def join_info(self) -> JoinInfo:
        return JoinInfo(self.incarnation, self.outputs.address, None, self.metrics_at,
                        self.limits())

    async def admit(self, request_id: str, prompt_token_ids: Sequence[int],
                    params: SamplingParams, router_id: str = "",
                    trace: Carrier | None = None) -> bool:
        """Queue the request if its prompt fits now (False: no room); its tokens go to
        ``router_id``'s output stream (``trace``: its attempt's trace context). Fails
        with ``ValueError`` for a request this worker can never serve."""
        return await self._on_loop(lambda: self._admit(request_id, prompt_token_ids, params,
                                                       router_id, trace))

    def close(self) -> None:
        self.stop()
        self.outputs.close()

    # ------------------------------------------------------------- loop side
    def _admit(self, rid: str, prompt: Sequence[int], params: SamplingParams,
               router_id: str, trace: Carrier | None = None) -> bool:
        if not self.engine.admit(rid, prompt, params):
            return False
        self.outputs.assign(rid, router_id)
        self._traced(rid, trace)
        self.blocks_granted += ceil_div(len(prompt), self.engine.block_size)
        self._received[rid] = time.monotonic()
        return True

    def _abort(self, rid: str) -> None:
        self.outputs.forget(rid)
        self._received.pop(rid, None)
        self.engine.abort(rid)

    def _run_step(self) -> None:
        outputs = self._step()
        now = time.monotonic()
        batch = [delta_of(out, prefill_stages(out, self._received.pop(out.request_id, None), now))
                 for out in outputs]
        self.outputs.publish(batch)
        self._trace_outputs(outputs)
