"""``pdserve plan``: size the prefill and decode pools for a rate and two SLOs, and
the ``Autoscaler`` that turns live load into target pool sizes.

This module owns the step-time models the planner runs on (a ``Profile`` is measured
by ``planner_profile.py``), the pool sizing and the autoscale decision; the command
line is ``planner_cli.py``. Formulas and their limits are in ``docs/planner.md``; in
short:

* step times come from an ``AnalyticModel`` (``pdserve.engine.cost`` FLOPs and bytes
  over datasheet peaks x ``tp`` x MFU/MBU) or from a measured ``Profile``::

      prefill_ms(N)      = max(FLOPs(N) / (peak·tp·mfu), bytes(N) / (bw·tp·mbu))
      decode_ms(B, ctx)  = max(bytes(B, ctx) / (bw·tp·mbu), FLOPs(B, ctx) / (peak·tp·mfu))
      profile:  prefill_ms(N) = a + b·N + c·N²,  decode_ms(B, ctx) = d + e·B + f·B·ctx

* a prefill worker is an M/D/1 queue: at utilisation rho = (R/P)·S the predicted
  TTFT is ``S·(1 + rho / (2·(1 - rho)))`` (S = prefill time), so the most it serves
  within the TTFT SLO T is ``rho_max / S`` with ``rho_max = 2x / (1 + 2x)``,
  ``x = T/S - 1``;
* a decode worker runs the largest batch B whose step time meets the TPOT SLO and
  whose requests fit its KV cache (and ``max_batch``): ``B / ((M - 1)·decode_ms(B))``
  requests/s (context = N + M/2, the mean over a request's decode);
* P and D are the smallest counts within the bounds whose capacity covers R.

Nothing here imports torch (``pdserve plan`` stays light); the analytic model imports
``pdserve.engine.cost`` on first use.
"""

from __future__ import annotations

import json
import math
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from itertools import pairwise
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from pdserve.deploy.efficiency import lookup_device

if TYPE_CHECKING:
    from pdserve.engine.config import ModelConfig
    from pdserve.engine.cost import CostModel

PROFILE_FORMAT = "pdserve-planner-profile/1"
# Step-time clocks of a profile: "cpu" (this process's CPU time: with one engine
# thread, the step's time on a core of its own even while other processes share the
# machine) or "wall".
CLOCKS: dict[str, Callable[[], float]] = {"cpu": time.process_time, "wall": time.perf_counter}
DEFAULT_MFU = 0.5  # prefill: large matmuls; well-tuned GPU stacks reach 0.4-0.6
DEFAULT_MBU = 0.8  # decode: streaming the weights; 0.7-0.85 is typical on GPUs
GPU_MEMORY_UTILIZATION = 0.9  # share of HBM for weights + KV (the rest: activations)
# The engine's defaults (EngineConfig): KV cache bytes, max_num_seqs, block_size.
ENGINE_KV_CACHE_BYTES = 256 * 1024 * 1024
ENGINE_MAX_NUM_SEQS = 64
ENGINE_BLOCK_SIZE = 16

# --hardware name -> (efficiency.DEVICE_PEAKS key, HBM bytes of one GPU)
HARDWARE: dict[str, tuple[str, float]] = {
    "h100": ("H100", 80e9),  # H100 SXM5 80GB
    "h100-pcie": ("H100 PCIe", 80e9),
    "h100-nvl": ("H100 NVL", 94e9),
    "h200": ("H200", 141e9),
    "h200-nvl": ("H200 NVL", 141e9),
    "a100": ("A100", 80e9),  # A100 SXM4 80GB
    "a100-pcie": ("A100 80GB PCIe", 80e9),
    "b200": ("B200", 180e9),
}


def _llama3(layers: int, hidden: int, heads: int, inter: int) -> dict[str, Any]:
    return {"architectures": ["LlamaForCausalLM"], "vocab_size": 128256,
            "hidden_size": hidden, "intermediate_size": inter, "num_hidden_layers": layers,
            "num_attention_heads": heads, "num_key_value_heads": 8, "head_dim": 128,
            "rms_norm_eps": 1e-5, "max_position_embeddings": 8192, "rope_theta": 500000.0,
            "tie_word_embeddings": False}


# Named model shapes (Hugging Face config.json keys); any local directory works too.
MODEL_PRESETS: dict[str, dict[str, Any]] = {
    "llama-3-70b": _llama3(80, 8192, 64, 28672),
    "llama-3-8b": _llama3(32, 4096, 32, 14336),
    "llama-3.1-70b": _llama3(80, 8192, 64, 28672),
    "llama-3.1-8b": _llama3(32, 4096, 32, 14336),
}


# ------------------------------------------------------------------ inputs
def resolve_model_config(name_or_dir: str | None) -> ModelConfig:
    """A preset name (``MODEL_PRESETS``, case-insensitive), the default model's name,
    or a model directory with a config.json. Anything else: ``ValueError``."""
    from pdserve.engine.config import ModelConfig
    from pdserve.engine.gguf_convert import DEFAULT_MODEL_NAME, resolve_model

    if not name_or_dir:
        raise ValueError("--model is required: a preset "
                         f"({', '.join(MODEL_PRESETS)}) or a model directory")
    preset = MODEL_PRESETS.get(name_or_dir.lower())
    if preset is not None:
        return ModelConfig.from_dict(preset, name=name_or_dir.lower())
    path = Path(name_or_dir).expanduser()
    if name_or_dir == DEFAULT_MODEL_NAME and not path.is_dir():
        path = resolve_model(name_or_dir)
    if not (path / "config.json").is_file():
        raise ValueError(f"model {name_or_dir!r} is neither a preset "
                         f"({', '.join(MODEL_PRESETS)}) nor a directory with a config.json")
    return ModelConfig.from_dir(path)


@dataclass(frozen=True)
class Hardware:
    """One device (one GPU, or the CPU threads one worker uses)."""

    name: str
    flops_per_s: float
    bytes_per_s: float
    memory_bytes: float | None  # None: unknown (the CPU: the engine's KV default applies)
    source: str  # "datasheet" | "measured" | "given"


def resolve_hardware(name: str, *, peak_flops: float | None = None,
                     peak_bandwidth: float | None = None, threads: int = 1) -> Hardware:
    """``h100``/``h200``/``a100``/``b200`` (and their ``-pcie``/``-nvl`` forms) from the
    datasheet table, or ``cpu``: measured with ``threads`` torch threads unless both
    peaks are given. Given peaks override a GPU's datasheet numbers too."""
    key = name.lower().strip()
    for value, flag in ((peak_flops, "--peak-flops"), (peak_bandwidth, "--peak-bandwidth")):
        if value is not None and not value > 0:
            raise ValueError(f"{flag} must be > 0, got {value}")
    if key == "cpu":
        if peak_flops is not None and peak_bandwidth is not None:
            return Hardware("cpu", peak_flops, peak_bandwidth, None, "given")
        if threads < 1:
            raise ValueError(f"--threads must be >= 1, got {threads}")
        import torch

        from pdserve.deploy.efficiency import measure_peaks

        before = torch.get_num_threads()
        torch.set_num_threads(threads)
        try:
            m = measure_peaks("cpu", "float32")
        finally:
            torch.set_num_threads(before)
        return Hardware(m.device, peak_flops or m.flops_per_s, peak_bandwidth or m.bytes_per_s,
                        None, "measured")
    if key not in HARDWARE:
        raise ValueError(f"unknown hardware {name!r}; known: {', '.join(HARDWARE)}, cpu")
    table_key, memory = HARDWARE[key]
    peaks = lookup_device(table_key)
    assert peaks is not None, table_key
    given = peak_flops is not None or peak_bandwidth is not None
    return Hardware(table_key, peak_flops or peaks.flops_per_s,
                    peak_bandwidth or peaks.bytes_per_s, memory, "given" if given else "datasheet")


# -------------------------------------------------------------- step times
class StepTimes(Protocol):
    """What the planner needs of a worker: how long its engine steps take."""

    @property
    def source(self) -> str: ...  # "analytic" | "profile"

    @property
    def kv_bytes_per_token(self) -> int: ...

    @property
    def default_kv_tokens(self) -> int | None: ...  # one decode worker's KV capacity

    def prefill_ms(self, prompt_len: float) -> float: ...

    def decode_ms(self, batch: float, context: float) -> float: ...

    def describe(self) -> str: ...


@dataclass(frozen=True)
class AnalyticModel:
    """Step times from the model's FLOPs and bytes (``pdserve.engine.cost``) over
    ``tp`` devices' peaks at the given MFU (compute) and MBU (memory). Tensor
    parallelism is taken as perfect (peaks x tp, no all-reduce time)."""

    model: ModelConfig
    hardware: Hardware
    tp: int = 1
    dtype: str = "bfloat16"
    quantization: str = "none"
    mfu: float = DEFAULT_MFU
    mbu: float = DEFAULT_MBU
    source: str = field(default="analytic", init=False)

    def __post_init__(self) -> None:
        from pdserve.engine.cost import DTYPE_BYTES

        if self.tp < 1:
            raise ValueError(f"--tp must be >= 1, got {self.tp}")
        for name in ("mfu", "mbu"):
            v = getattr(self, name)
            if not 0 < v <= 1:
                raise ValueError(f"--{name} must be in (0, 1], got {v}")
        if self.dtype not in DTYPE_BYTES:
            raise ValueError(f"--dtype must be one of {', '.join(DTYPE_BYTES)}, got {self.dtype!r}")
        if self.quantization not in ("none", "int8", "int4"):
            raise ValueError(f"--quantization must be none, int8 or int4, got {self.quantization!r}")

    @property
    def cost(self) -> CostModel:
        from pdserve.engine.cost import cost_model

        return cost_model(self.model, self.dtype, self.quantization)

    def _seconds(self, flops: float, nbytes: float) -> float:
        hw = self.hardware
        return max(flops / (hw.flops_per_s * self.tp * self.mfu),
                   nbytes / (hw.bytes_per_s * self.tp * self.mbu))

    def prefill_step_ms(self, num_seqs: int, tokens_each: int) -> float:
        """One step prefilling ``num_seqs`` fresh prompts of ``tokens_each`` tokens."""
        from pdserve.engine.engine import StepInfo

        n = num_seqs * tokens_each
        flops, nbytes = self.cost.step(StepInfo(num_seqs, n, 0, n, 0.0), num_seqs)
        return self._seconds(flops, nbytes) * 1e3

    def prefill_ms(self, prompt_len: float) -> float:
        return self.prefill_step_ms(1, max(1, round(prompt_len)))

    def decode_ms(self, batch: float, context: float) -> float:
        """One decode step of ``batch`` sequences attending ``context`` tokens each:
        weights once plus every sequence's KV (costs are affine in the batch, so a
        fractional batch interpolates the cost model's integer points)."""
        from pdserve.engine.engine import StepInfo

        c = max(1, round(context))
        f1, b1 = self.cost.step(StepInfo(1, 1, 1, c, 0.0), 1)
        f2, b2 = self.cost.step(StepInfo(2, 2, 2, 2 * c, 0.0), 2)
        b = max(batch, 0.0)
        return self._seconds(f1 + (b - 1) * (f2 - f1), b1 + (b - 1) * (b2 - b1)) * 1e3

    @property
    def kv_bytes_per_token(self) -> int:
        return self.cost.kv_bytes_per_token

    @property
    def weight_memory_bytes(self) -> float:
        """Weights held in memory: every matmul, LM head and (untied) embeddings."""
        m, c = self.model, self.cost
        emb = 0 if m.tie_word_embeddings else m.vocab_size * m.hidden_size * c.dtype_bytes
        return c.step_weight_bytes + emb

    @property
    def default_kv_tokens(self) -> int | None:
        """GPU: (tp x HBM x 0.9 - weights) / KV bytes per token; CPU: the engine's
        default KV cache (256 MiB)."""
        mem = self.hardware.memory_bytes
        if mem is None:
            return ENGINE_KV_CACHE_BYTES // self.kv_bytes_per_token
        free = self.tp * mem * GPU_MEMORY_UTILIZATION - self.weight_memory_bytes
        return max(0, int(free // self.kv_bytes_per_token))

    def describe(self) -> str:
        name = self.model.name or "model"
        hw = self.hardware
        return (f"{name} on {self.tp} x {hw.name} ({hw.source}: "
                f"{hw.flops_per_s / 1e12:.3g} TFLOP/s, {hw.bytes_per_s / 1e9:.4g} GB/s each), "
                f"{self.dtype}{'' if self.quantization == 'none' else ' ' + self.quantization}, "
                f"MFU {self.mfu:.2f}, MBU {self.mbu:.2f}")


@dataclass(frozen=True)
class Profile:
    """Step times of one worker measured on its engine (``measure_profile``)::

        prefill_ms(N)     = a + b·N + c·N²        (k prompts in one step: a + b·kN + c·kN²)
        decode_ms(B, ctx) = d + e·B + f·B·ctx     (ctx = tokens each sequence attends)
    """

    model: str
    device: str
    dtype: str
    quantization: str
    threads: int
    prefill_coef: tuple[float, float, float]  # a, b, c
    decode_coef: tuple[float, float, float]  # d, e, f
    kv_bytes_per_token: int
    kv_tokens: int  # a decode worker's KV capacity at the engine's default cache size
    samples: dict[str, list[list[float]]] = field(default_factory=dict)
    fit_error_pct: dict[str, float] = field(default_factory=dict)  # worst |residual| / y
    measured_s: float = 0.0
    clock: str = "cpu"  # CLOCKS key the step times were measured with
    source: str = field(default="profile", init=False)

    @property
    def default_kv_tokens(self) -> int | None:
        return self.kv_tokens

    def prefill_step_ms(self, num_seqs: int, tokens_each: float) -> float:
        a, b, c = self.prefill_coef
        return a + b * num_seqs * tokens_each + c * num_seqs * tokens_each ** 2

    def prefill_ms(self, prompt_len: float) -> float:
        return self.prefill_step_ms(1, prompt_len)

    def decode_ms(self, batch: float, context: float) -> float:
        d, e, f = self.decode_coef
        return d + e * batch + f * batch * context

    def describe(self) -> str:
        return (f"{self.model}, measured profile ({self.device}, {self.threads} thread(s), "
                f"{self.dtype}{'' if self.quantization == 'none' else ' ' + self.quantization})")

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d.pop("source")
        return {"format": PROFILE_FORMAT, **d}

    def save(self, path: str | Path) -> Path:
        p = Path(path)
        p.write_text(json.dumps(self.to_dict(), indent=2) + "\n")
        return p

    @classmethod
    def load(cls, path: str | Path) -> Profile:
        p = Path(path)
        if not p.is_file():
            raise ValueError(f"profile {str(p)!r} not found (write one with "
                             "`pdserve plan --measure-profile FILE --model DIR`)")
        try:
            d = json.loads(p.read_text())
        except json.JSONDecodeError as exc:
            raise ValueError(f"profile {str(p)!r} is not JSON: {exc}") from exc
        if not isinstance(d, dict) or d.get("format") != PROFILE_FORMAT:
            raise ValueError(f"profile {str(p)!r} is not a {PROFILE_FORMAT} file")
        try:
            return cls(model=str(d["model"]), device=str(d["device"]), dtype=str(d["dtype"]),
                       quantization=str(d["quantization"]), threads=int(d["threads"]),
                       prefill_coef=coef3(d["prefill_coef"]),
                       decode_coef=coef3(d["decode_coef"]),
                       kv_bytes_per_token=int(d["kv_bytes_per_token"]),
                       kv_tokens=int(d["kv_tokens"]), samples=dict(d.get("samples", {})),
                       fit_error_pct=dict(d.get("fit_error_pct", {})),
                       measured_s=float(d.get("measured_s", 0.0)),
                       clock=str(d.get("clock", "wall")))
        except (KeyError, TypeError, ValueError) as exc:
            raise ValueError(f"profile {str(p)!r} is malformed: {exc!r}") from exc


def coef3(v: Sequence[float]) -> tuple[float, float, float]:
    a, b, c = (float(x) for x in v)
    return a, b, c


# ------------------------------------------------------------------ sizing
@dataclass(frozen=True)
class SLO:
    ttft_ms: float
    tpot_ms: float

    def __post_init__(self) -> None:
        for name in ("ttft_ms", "tpot_ms"):
            v = getattr(self, name)
            if not v > 0:
                raise ValueError(f"--{name.split('_')[0]}-slo must be > 0 ms, got {v}")


@dataclass(frozen=True)
class Bounds:
    min_prefill: int = 1
    max_prefill: int = 64
    min_decode: int = 1
    max_decode: int = 64

    def __post_init__(self) -> None:
        for pool in ("prefill", "decode"):
            lo, hi = getattr(self, f"min_{pool}"), getattr(self, f"max_{pool}")
            if lo < 0 or hi < 1 or lo > hi:
                raise ValueError(f"bad {pool} bounds: need 0 <= --min-{pool} ({lo}) <= "
                                 f"--max-{pool} ({hi}) and --max-{pool} >= 1")

    def clamp(self, pool: str, n: int) -> int:
        return max(getattr(self, f"min_{pool}"), min(getattr(self, f"max_{pool}"), n))


@dataclass(frozen=True)
class PrefillEstimate:
    workers: int
    prefill_ms: float  # one prompt, unloaded
    capacity_rps: float  # per worker, with the predicted TTFT within the SLO
    utilisation: float  # rho = (rate / workers) x prefill time
    ttft_ms: float | None  # predicted mean (M/D/1) at rho; None when rho >= 1


@dataclass(frozen=True)
class DecodeEstimate:
    workers: int
    step_ms_batch1: float  # the TPOT floor
    max_batch: int  # largest batch within the TPOT SLO that fits KV and max_batch
    batch_limit: int  # what KV and max_batch allow, SLO aside
    capacity_rps: float  # per worker, at max_batch
    utilisation: float  # (rate / workers) / capacity
    batch: float | None  # steady-state running requests per worker (Little's law)
    tpot_ms: float | None  # predicted at that batch; None when the pool cannot keep up


@dataclass(frozen=True)
class Plan:
    rate: float
    prompt_len: int
    output_len: int
    slo: SLO
    prefill: PrefillEstimate
    decode: DecodeEstimate
    goodput_rps: float  # the most of `rate` these sizes serve within both SLOs
    problems: tuple[str, ...]  # empty when feasible
    model: str

    @property
    def feasible(self) -> bool:
        return not self.problems

    @property
    def sizes(self) -> dict[str, int]:
        return {"prefill": self.prefill.workers, "decode": self.decode.workers}

    @property
    def ratio(self) -> str:
        return f"{self.prefill.workers}:{self.decode.workers}"

    def to_dict(self) -> dict[str, Any]:
        def num(v: float | None, nd: int = 3) -> float | None:
            return None if v is None or math.isinf(v) else round(v, nd)

        p, d = self.prefill, self.decode
        return {
            "feasible": self.feasible, "problems": list(self.problems),
            "prefill_workers": p.workers, "decode_workers": d.workers, "ratio": self.ratio,
            "ttft_ms": num(p.ttft_ms), "tpot_ms": num(d.tpot_ms),
            "goodput_rps": num(self.goodput_rps, 4), "rate_rps": self.rate,
            "prompt_len": self.prompt_len, "output_len": self.output_len,
            "ttft_slo_ms": self.slo.ttft_ms, "tpot_slo_ms": self.slo.tpot_ms,
            "prefill": {"workers": p.workers, "prefill_ms": num(p.prefill_ms),
                        "capacity_rps_per_worker": num(p.capacity_rps, 4),
                        "utilisation": num(p.utilisation, 4), "ttft_ms": num(p.ttft_ms)},
            "decode": {"workers": d.workers, "step_ms_batch1": num(d.step_ms_batch1),
                       "max_batch": d.max_batch, "batch_limit": d.batch_limit,
                       "capacity_rps_per_worker": num(d.capacity_rps, 4),
                       "utilisation": num(d.utilisation, 4), "batch": num(d.batch, 2),
                       "tpot_ms": num(d.tpot_ms)},
            "model": self.model,
        }

    def describe(self) -> str:
        p, d = self.prefill, self.decode

        def ms(v: float | None) -> str:
            return "unbounded (queue grows)" if v is None else f"{v:.1f} ms"

        lines = [
            f"pdserve plan: {self.model}",
            f"  workload: {self.rate:g} req/s, {self.prompt_len}-token prompts, "
            f"{self.output_len} output tokens; SLOs TTFT {self.slo.ttft_ms:g} ms, "
            f"TPOT {self.slo.tpot_ms:g} ms",
            f"  {'recommended' if self.feasible else 'best within bounds'} P:D = {self.ratio}",
            f"  prefill {p.workers:>3} worker(s): {p.prefill_ms:.1f} ms per prompt, "
            f"{p.capacity_rps:.3g} req/s each within the TTFT SLO, utilisation "
            f"{p.utilisation:.0%}, predicted TTFT {ms(p.ttft_ms)}",
            f"  decode  {d.workers:>3} worker(s): batch {'-' if d.batch is None else f'{d.batch:.1f}'}"
            f" of at most {d.max_batch} within the TPOT SLO, {d.capacity_rps:.3g} req/s each, "
            f"utilisation {d.utilisation:.0%}, predicted TPOT {ms(d.tpot_ms)}",
            f"  goodput {self.goodput_rps:.3g} req/s of {self.rate:g} within both SLOs",
        ]
        if self.problems:
            lines.append("  NOT FEASIBLE within the bounds:")
            lines += [f"    - {m}" for m in self.problems]
        return "\n".join(lines)


def _ceil(x: float) -> int:
    return max(0, math.ceil(x - 1e-9))


def ttft_mdl(prefill_ms: float, rho: float) -> float | None:
    """Mean TTFT of an M/D/1 queue (Poisson arrivals, deterministic service S):
    S·(1 + rho / (2(1 - rho))); None when rho >= 1 (the queue grows)."""
    if rho >= 1:
        return None
    return prefill_ms * (1 + rho / (2 * (1 - rho)))


class Planner:
    """Pool sizes for a rate and two SLOs on ``times`` (an ``AnalyticModel`` or a
    ``Profile``). ``kv_tokens``: one decode worker's KV capacity in tokens (default:
    the step-time model's); ``max_batch``: the decode engine's ``max_num_seqs``."""

    def __init__(self, times: StepTimes, slo: SLO, bounds: Bounds | None = None, *,
                 max_batch: int = ENGINE_MAX_NUM_SEQS, kv_tokens: int | None = None,
                 block_size: int = ENGINE_BLOCK_SIZE) -> None:
        if max_batch < 1:
            raise ValueError(f"--max-batch must be >= 1, got {max_batch}")
        if block_size < 1:
            raise ValueError(f"--block-size must be >= 1, got {block_size}")
        self.times = times
        self.slo = slo
        self.bounds = bounds or Bounds()
        self.max_batch = max_batch
        self.kv_tokens = times.default_kv_tokens if kv_tokens is None else kv_tokens
        self.block_size = block_size

    # per worker
    def prefill_capacity(self, prompt_len: int) -> tuple[float, float]:
        """(prefill ms, req/s one prefill worker serves with mean TTFT <= the SLO)."""
        s = max(self.times.prefill_ms(prompt_len), 1e-9)
        x = self.slo.ttft_ms / s - 1
        if x <= 0:
            return s, 0.0
        return s, (2 * x / (1 + 2 * x)) / s * 1e3

    def decode_limits(self, prompt_len: int, output_len: int) -> tuple[int, int]:
        """(batch KV and max_batch allow, largest such batch within the TPOT SLO)."""
        need = -(-(prompt_len + output_len) // self.block_size) * self.block_size
        limit = self.max_batch
        if self.kv_tokens is not None:
            limit = min(limit, self.kv_tokens // need)
        ctx = prompt_len + output_len / 2
        lo, hi = 0, limit  # largest B in [1, limit] with decode_ms(B) <= SLO (monotone)
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if self.times.decode_ms(mid, ctx) <= self.slo.tpot_ms:
                lo = mid
            else:
                hi = mid - 1
        return limit, lo

    def _steady_batch(self, rate: float, prompt_len: int, output_len: int,
                      limit: int) -> float | None:
        """Running requests per decode worker at ``rate``: b = rate·(M-1)·step(b)."""
        ctx = prompt_len + output_len / 2
        steps = output_len - 1

        def excess(b: float) -> float:
            return rate * steps * self.times.decode_ms(max(b, 1.0), ctx) / 1e3 - b

        if limit < 1 or excess(limit) > 0:
            return None
        lo, hi = 0.0, float(limit)
        for _ in range(60):
            mid = (lo + hi) / 2
            lo, hi = (mid, hi) if excess(mid) > 0 else (lo, mid)
        return hi

    def plan(self, rate: float, prompt_len: int, output_len: int) -> Plan:
        if not rate > 0:
            raise ValueError(f"--rate must be > 0 req/s, got {rate}")
        if prompt_len < 1:
            raise ValueError(f"--prompt-len must be >= 1, got {prompt_len}")
        if output_len < 2:
            raise ValueError(f"--output-len must be >= 2 (TPOT is between output tokens), "
                             f"got {output_len}")
        b, slo = self.bounds, self.slo
        problems: list[str] = []

        # prefill pool
        s, cap_p = self.prefill_capacity(prompt_len)
        if cap_p <= 0:
            need_p = b.max_prefill
            problems.append(
                f"prefill: the TTFT SLO ({slo.ttft_ms:g} ms) is below the unloaded prefill "
                f"time of a {prompt_len}-token prompt ({s:.1f} ms): no number of prefill "
                "workers meets it (more --tp, faster hardware, or shorter prompts)")
        else:
            need_p = _ceil(rate / cap_p)
            if need_p > b.max_prefill:
                problems.append(
                    f"prefill: {rate:g} req/s needs {need_p} prefill workers to keep TTFT <= "
                    f"{slo.ttft_ms:g} ms (each serves {cap_p:.3g} req/s); --max-prefill is "
                    f"{b.max_prefill}")
        p = b.clamp("prefill", need_p)
        rho = rate / p * s / 1e3 if p else math.inf
        prefill = PrefillEstimate(p, s, cap_p, rho, ttft_mdl(s, rho) if p else None)

        # decode pool
        ctx = prompt_len + output_len / 2
        step1 = self.times.decode_ms(1, ctx)
        limit, bmax = self.decode_limits(prompt_len, output_len)
        cap_d = bmax / ((output_len - 1) * self.times.decode_ms(bmax, ctx) / 1e3) if bmax else 0.0
        if limit < 1:
            need_d = b.max_decode
            problems.append(
                f"decode: a request of {prompt_len}+{output_len} tokens does not fit a decode "
                f"worker's KV cache ({self.kv_tokens} tokens; set --kv-cache-gb)")
        elif bmax < 1:
            need_d = b.max_decode
            problems.append(
                f"decode: the TPOT SLO ({slo.tpot_ms:g} ms) is below a batch-1 decode step "
                f"({step1:.2f} ms): no number of decode workers meets it")
        else:
            need_d = _ceil(rate / cap_d)
            if need_d > b.max_decode:
                problems.append(
                    f"decode: {rate:g} req/s needs {need_d} decode workers to keep TPOT <= "
                    f"{slo.tpot_ms:g} ms (each runs at most batch {bmax}, {cap_d:.3g} req/s); "
                    f"--max-decode is {b.max_decode}")
        d = b.clamp("decode", need_d)
        per_d = rate / d if d else math.inf
        batch = self._steady_batch(per_d, prompt_len, output_len, limit) if d else None
        tpot = None if batch is None else self.times.decode_ms(max(batch, 1.0), ctx)
        decode = DecodeEstimate(d, step1, bmax, limit, cap_d,
                                per_d / cap_d if cap_d else math.inf, batch, tpot)

        goodput = min(rate, p * cap_p, d * cap_d)
        return Plan(rate, prompt_len, output_len, slo, prefill, decode, goodput,
                    tuple(problems), self.times.describe())


# -------------------------------------------------------------- autoscale
@dataclass(frozen=True)
class PoolLoad:
    """One pool's live load, summed (or averaged, ``kv_usage``) over its workers."""

    workers: int  # workers in the pool, including any being started (the last target)
    waiting: int = 0  # requests queued for the pool (decode: waiting for KV or a slot)
    running: int = 0  # requests in the engines' running batches (decode: batch size)
    kv_usage: float = 0.0  # mean KV-cache occupancy 0..1
    prefill_tokens_per_s: float = 0.0  # prompt tokens computed per second (prefill pool)


@dataclass(frozen=True)
class LoadSnapshot:
    """What the cluster looks like now (one per autoscale period)."""

    prefill: PoolLoad
    decode: PoolLoad
    arrival_rate: float | None = None  # req/s; None: prefill tokens/s / prompt length
    ttft_p90_ms: float | None = None  # over the last period; None when unknown
    tpot_p90_ms: float | None = None
    prompt_len: float | None = None  # observed mean lengths; None: the configured ones
    output_len: float | None = None


POOLS = ("prefill", "decode")


class Autoscaler:
    """Target pool sizes from periodic ``LoadSnapshot``s (pure logic: no Ray, no clock).

    Call ``decide(snapshot)`` once per period (e.g. every 10-30 s) with the pools'
    current sizes and load; apply the returned ``{"prefill": P, "decode": D}`` with the
    cluster's scaling API. ``reasons`` then says why each pool moved (or did not).
    Rules per pool, every step within ``planner.bounds`` and at most one worker:

    * **required** = ``planner.plan(rate, prompt_len, output_len)``'s size for the
      pool (rate = ``arrival_rate``, else prefill tokens/s / prompt length; rate <= 0:
      the minimum). Below it, the pool grows by one per decision.
    * **at risk** (grow by one even if the plan says the size suffices): prefill: TTFT
      p90 > ``up_fraction`` x SLO, or the prefill queue grew in each of the last
      ``queue_growth`` snapshots; decode: TPOT p90 > ``up_fraction`` x SLO, the decode
      queue grew ``queue_growth`` times running, KV occupancy >= ``kv_high``, or the
      running batch per worker > ``up_fraction`` x the largest batch within the TPOT
      SLO. For ``settle`` decisions after a pool changed, its risk signals are not
      acted on (a new worker needs time to take load); the rate rule still is.
    * **down** by one only after the requirement has been below the current size for
      ``cooldown`` consecutive snapshots with no risk and the pool's observed p90
      at most ``down_fraction`` x SLO (the band between ``down_fraction`` and
      ``up_fraction`` is the hysteresis); then the count starts again. Never below
      the requirement.

    ``workers`` in a snapshot must count workers being started, so a decision is not
    repeated while its worker comes up.
    """

    def __init__(self, planner: Planner, prompt_len: int, output_len: int, *,
                 up_fraction: float = 0.9, down_fraction: float = 0.7, queue_growth: int = 3,
                 cooldown: int = 5, settle: int = 2, kv_high: float = 0.9) -> None:
        if not 0 < down_fraction < up_fraction:
            raise ValueError("need 0 < down_fraction < up_fraction")
        if queue_growth < 1 or cooldown < 1 or settle < 0:
            raise ValueError("need queue_growth >= 1, cooldown >= 1, settle >= 0")
        if not 0 < kv_high <= 1:
            raise ValueError("kv_high must be in (0, 1]")
        self.planner = planner
        self.prompt_len = prompt_len
        self.output_len = output_len
        self.up_fraction = up_fraction
        self.down_fraction = down_fraction
        self.queue_growth = queue_growth
        self.cooldown = cooldown
        self.settle = settle
        self.kv_high = kv_high
        self._waiting = {p: deque[int](maxlen=queue_growth + 1) for p in POOLS}
        self._lower = dict.fromkeys(POOLS, 0)
        self._settling = dict.fromkeys(POOLS, 0)
        self.reasons: dict[str, str] = {}
        self.last_plan: Plan | None = None

    def _required(self, snap: LoadSnapshot, n_in: int, n_out: int) -> dict[str, int]:
        rate = snap.arrival_rate
        if rate is None:
            rate = snap.prefill.prefill_tokens_per_s / n_in
        b = self.planner.bounds
        if rate <= 0:
            self.last_plan = None
            return {"prefill": b.min_prefill, "decode": b.min_decode}
        self.last_plan = self.planner.plan(rate, n_in, n_out)
        return self.last_plan.sizes

    def _growing(self, pool: str) -> bool:
        h = self._waiting[pool]
        return len(h) == h.maxlen and all(a < b for a, b in pairwise(h))

    def _risk(self, pool: str, load: PoolLoad, snap: LoadSnapshot, bslo: int) -> str | None:
        slo = self.planner.slo
        p90, target = ((snap.ttft_p90_ms, slo.ttft_ms) if pool == "prefill"
                       else (snap.tpot_p90_ms, slo.tpot_ms))
        name = "TTFT" if pool == "prefill" else "TPOT"
        if p90 is not None and p90 > self.up_fraction * target:
            return f"{name} p90 {p90:.1f} ms > {self.up_fraction:g} x SLO {target:g} ms"
        if self._growing(pool):
            return f"queue grew {self.queue_growth} times running ({load.waiting} waiting)"
        if pool == "decode":
            if load.kv_usage >= self.kv_high:
                return f"KV occupancy {load.kv_usage:.0%} >= {self.kv_high:.0%}"
            if bslo and load.workers and load.running / load.workers > self.up_fraction * bslo:
                return (f"batch {load.running / load.workers:.1f} per worker near the "
                        f"TPOT limit {bslo}")
        return None

    def _safe(self, pool: str, load: PoolLoad, snap: LoadSnapshot) -> bool:
        slo = self.planner.slo
        p90, target = ((snap.ttft_p90_ms, slo.ttft_ms) if pool == "prefill"
                       else (snap.tpot_p90_ms, slo.tpot_ms))
        if p90 is not None and p90 > self.down_fraction * target:
            return False
        return not (pool == "decode" and load.kv_usage >= self.down_fraction * self.kv_high)

    def decide(self, snap: LoadSnapshot) -> dict[str, int]:
        n_in = max(1, round(snap.prompt_len or self.prompt_len))
        n_out = max(2, round(snap.output_len or self.output_len))
        required = self._required(snap, n_in, n_out)
        _, bslo = self.planner.decode_limits(n_in, n_out)
        out: dict[str, int] = {}
        for pool in POOLS:
            load: PoolLoad = getattr(snap, pool)
            cur, req = load.workers, required[pool]
            self._waiting[pool].append(load.waiting)
            settling = self._settling[pool] > 0
            self._settling[pool] = max(0, self._settling[pool] - 1)
            risk = self._risk(pool, load, snap, bslo)
            lo = getattr(self.planner.bounds, f"min_{pool}")
            hi = getattr(self.planner.bounds, f"max_{pool}")
            lowering = req < cur and not risk and self._safe(pool, load, snap)
            self._lower[pool] = self._lower[pool] + 1 if lowering else 0
            target, why = cur, f"hold at {cur} (required {req})"
            if cur > hi:
                target, why = cur - 1, f"above --max-{pool} {hi}"
            elif req > cur:
                target, why = cur + 1, f"rate needs {req}"
            elif risk and not settling:
                target, why = cur + 1, f"at risk: {risk}"
            elif risk:
                why = f"hold at {cur}: settling after a change ({risk})"
            elif lowering and self._lower[pool] >= self.cooldown:
                target, why = cur - 1, f"required {req} for {self._lower[pool]} snapshots"
            elif lowering:
                why = f"hold at {cur}: required {req}, cool-down {self._lower[pool]}/{self.cooldown}"
            target = max(cur - 1, min(cur + 1, max(lo, min(hi, target))))
            if target != cur:
                self._lower[pool] = 0
                self._settling[pool] = self.settle
            out[pool] = target
            self.reasons[pool] = why
        return out
