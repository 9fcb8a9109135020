"""``StepFit``: a worker's own step times, measured -- what the router's
disaggregation decision (``router/placement.py``) predicts costs from.

Every engine step is a sample, kept per thread count (core sharing changes a
worker's threads step by step), recent steps weighing most:

* a step that only decoded (every sequence one token) updates the decode time at its
  batch size (a moving average per power-of-two bucket of rows);
* a step with prompt tokens (prefill chunks) updates what a prompt token costs: its
  seconds less a decode step of the same rows (at least one: the step's fixed part),
  spread over its prompt tokens, against the context those tokens attend, as
  ``token_s + pair_s x context`` -- weighted least squares, each step weighted by its
  tokens, older ones decayed by ``DECAY`` a step.

Live steps under load are often alike (a prefill worker's are all full 512-token
chunks), which pins their time but not how it depends on size; so a worker also
measures a few steps of varied shapes when it starts (``calibrate``), and those stay
in its fits at full weight for good.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import numpy as np

from pdserve.engine.engine import LLMEngine
from pdserve.engine.results import StepInfo
from pdserve.engine.sampling.sampling_params import SamplingParams
from pdserve.messages import StepCost

DECAY = 0.98  # per prompt sample: ~50 remembered
ALPHA = 0.1  # a decode step's weight in its batch size's moving average
RIDGE = 1e-3
SCALE = np.array([1.0, 512.0, 1.0])  # prompt features ~1 in a typical step
# calibration: decode-sized steps (1, 4, 16 one-token prompts), then one prompt of each
# size; each shape measured ``CALIBRATION_REPEATS`` times, the fastest kept (the others
# a neighbour's start-up may have slowed)
CALIBRATION_ONES = (1, 4, 16)
CALIBRATION_PROMPTS = (16, 128, 512)
CALIBRATION_REPEATS = 3


class _Fit:
    def __init__(self) -> None:
        self.decode: dict[int, tuple[float, float]] = {}  # bucket -> (rows, seconds)
        self.decode_pinned: dict[int, tuple[float, float]] = {}  # calibration's
        self.a = np.zeros((3, 3))
        self.b = np.zeros(3)
        self.a_pinned = np.eye(3) * RIDGE
        self.b_pinned = np.zeros(3)
        self.decode_steps = self.prefill_steps = 0.0
        self.pinned_decode = self.pinned_prefill = 0.0

    def add_decode(self, rows: int, seconds: float, pin: bool) -> None:
        k = round(math.log2(rows))
        if pin:
            self.decode_pinned[k] = (rows, seconds)
            self.pinned_decode += 1
            return
        r0, s0 = self.decode.get(k) or self.decode_pinned.get(k) or (rows, seconds)
        self.decode[k] = (r0 + ALPHA * (rows - r0), s0 + ALPHA * (seconds - s0))
        self.decode_steps = self.decode_steps * DECAY + 1

    def row_s(self) -> float:
        """What one more decoding row adds to a step (the decode table's slope)."""
        pts = sorted({**self.decode_pinned, **self.decode}.values())
        if len(pts) < 2 or pts[-1][0] <= pts[0][0]:
            return 0.0
        return max(0.0, (pts[-1][1] - pts[0][1]) / (pts[-1][0] - pts[0][0]))

    def add_prompt(self, tokens: int, pairs: float, seconds: float, pin: bool) -> None:
        x = np.array([1.0, tokens, pairs / 1e6]) / SCALE
        if pin:
            self.a_pinned += np.outer(x, x)
            self.b_pinned += x * seconds
            self.pinned_prefill += 1
            return
        self.a = self.a * DECAY + np.outer(x, x)
        self.b = self.b * DECAY + x * seconds
        self.prefill_steps = self.prefill_steps * DECAY + 1

    def cost(self) -> StepCost:
        table = {**self.decode_pinned, **self.decode}
        base = token = pair = 0.0
        if self.prefill_steps + self.pinned_prefill:
            base, token, pair = np.linalg.solve(self.a + self.a_pinned,
                                                self.b + self.b_pinned) / SCALE
        return StepCost(tuple(sorted(table.values())), max(0.0, float(base)),
                        max(0.0, float(token)), max(0.0, float(pair)) / 1e6,
                        round(self.decode_steps + self.pinned_decode, 2),
                        round(self.prefill_steps + self.pinned_prefill, 2))


class StepFit:
    def __init__(self) -> None:
        self._fits: dict[int, _Fit] = {}

    def observe(self, threads: int, decode_rows: int, prompt_tokens: int,
                attended_pairs: float, seconds: float, calibration: bool = False) -> None:
        """One step: ``attended_pairs`` = Σ over its new tokens of the tokens each
        attends (``engine.cost.attended_tokens``)."""
        fit = self._fits.setdefault(threads, _Fit())
        if not prompt_tokens:
            if decode_rows:
                fit.add_decode(decode_rows, seconds, calibration)
            return
        # the decoding rows' part of a mixed step: their rows and their attention
        decode_pairs = attended_pairs * decode_rows / (decode_rows + prompt_tokens)
        fit.add_prompt(prompt_tokens, attended_pairs - decode_pairs,
                       max(0.0, seconds - decode_rows * fit.row_s()), calibration)

    def costs(self) -> dict[int, StepCost]:
        """Thread count -> its fit (what the worker publishes)."""
        return {t: f.cost() for t, f in sorted(self._fits.items())}


def calibrate(engine: LLMEngine, step: Callable[[], StepInfo | None],
              record: Callable[[StepInfo], None], role: str) -> None:
    """A few steps of varied, known shapes on a fresh engine, each run
    ``CALIBRATION_REPEATS`` times and the fastest ``record``-ed (``step`` runs one):
    ``CALIBRATION_ONES`` one-token prompts at once (decode-sized steps), then one
    prompt of each of ``CALIBRATION_PROMPTS`` tokens. Every request is aborted at once
    and the prefix cache forgotten after. Stops at the first step that could not run as
    asked (``step`` answered None). Shapes are cut to what a small engine holds."""
    vocab = engine.model_config.vocab_size
    rng = np.random.default_rng(0)
    params = SamplingParams(max_tokens=2, ignore_eos=True)
    # what fits: a context, and half the cache (a small test engine's)
    longest = min(engine.max_model_len, engine.num_blocks * engine.block_size // 2) - 2

    def run(sizes: list[int]) -> StepInfo | None:
        ids = [f"pdserve-calibration-{i}" for i in range(len(sizes))]
        try:
            for rid, n in zip(ids, sizes, strict=True):
                prompt = [int(t) for t in rng.integers(3, vocab, max(1, min(n, longest)))]
                if role != "decode":
                    engine.add_request(rid, prompt, params)
                elif engine.reserve(rid, prompt, params) is not None:
                    engine.prefill_reserved(rid)
            return step()
        finally:
            for rid in ids:
                if engine.has_request(rid):
                    engine.abort(rid)

    try:
        if run([1]) is None:  # the first step of all is slow (allocations, threads): not kept
            return
        ones = [n for n in CALIBRATION_ONES if n <= engine.num_blocks // 2]
        for sizes in [[1] * n for n in ones] + [[n] for n in CALIBRATION_PROMPTS]:
            runs = [run(sizes) for _ in range(CALIBRATION_REPEATS)]
            kept = [info for info in runs if info is not None]
            if len(kept) < len(runs):  # it could not step as asked (no cores): stop
                return
            record(min(kept, key=lambda info: info.seconds))
    finally:
        engine.reset_prefix_cache()  # as new: the calibration's blocks match nothing real
