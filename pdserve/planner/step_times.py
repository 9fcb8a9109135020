"""The step-time models the planner and the autoscaler run on: what a prefill and a
decode step cost on a worker, from an ``AnalyticModel`` (``pdserve.engine.cost`` FLOPs
and bytes over datasheet peaks x ``tp`` x MFU/MBU) or from a measured ``Profile``
(``profile.py`` measures one)::

    prefill_ms(N)      = max(FLOPs(N) / (peak·tp·mfu), bytes(N) / (bw·tp·mbu))
    decode_ms(B, ctx)  = max(bytes(B, ctx) / (bw·tp·mbu), FLOPs(B, ctx) / (peak·tp·mfu))
    profile:  prefill_ms(N) = a + b·N + c·N²,  decode_ms(B, ctx) = d + e·B + f·B·ctx

and the inputs they need: the model's shape (a preset name or a checkpoint directory)
and the hardware's peaks (``--hardware``). Nothing here imports torch; the analytic
model imports ``pdserve.engine.cost`` on first use.
"""
from __future__ import annotations

import functools
import json
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from pdserve.engine import defaults
from pdserve.observability.efficiency import lookup_device

if TYPE_CHECKING:
    from pdserve.engine.config import ModelConfig
    from pdserve.engine.cost import CostModel
    from pdserve.engine.results import StepInfo


PROFILE_FORMAT = "pdserve-planner-profile/1"
# Step-time clocks of a profile: "cpu" (this process's CPU time: with one engine
# thread, the step's time on a core of its own even while other processes share the
# machine) or "wall".
CLOCKS: dict[str, Callable[[], float]] = {"cpu": time.process_time, "wall": time.perf_counter}
DEFAULT_MFU = 0.5  # prefill: large matmuls; well-tuned GPU stacks reach 0.4-0.6
DEFAULT_MBU = 0.8  # decode: streaming the weights; 0.7-0.85 is typical on GPUs
GPU_MEMORY_UTILIZATION = 0.9  # share of HBM for weights + KV (the rest: activations)

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
    from pdserve.engine.model.gguf_convert import DEFAULT_MODEL_NAME, resolve_model

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

        from pdserve.observability.efficiency import measure_peaks

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

    def step_ms(self, info: StepInfo) -> float: ...  # any step: chunks and decodes mixed

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

    @functools.cached_property
    def cost(self) -> CostModel:  # (read per simulated step: built once)
        from pdserve.engine.cost import cost_model

        return cost_model(self.model, self.dtype, self.quantization)

    def _seconds(self, flops: float, nbytes: float) -> float:
        hw = self.hardware
        return max(flops / (hw.flops_per_s * self.tp * self.mfu),
                   nbytes / (hw.bytes_per_s * self.tp * self.mbu))

    def prefill_step_ms(self, num_seqs: int, tokens_each: int) -> float:
        """One step prefilling ``num_seqs`` fresh prompts of ``tokens_each`` tokens."""
        from pdserve.engine.results import StepInfo

        n = num_seqs * tokens_each
        flops, nbytes = self.cost.step(StepInfo(num_seqs, n, 0, n, 0.0), num_seqs)
        return self._seconds(flops, nbytes) * 1e3

    def prefill_ms(self, prompt_len: float) -> float:
        return self.prefill_step_ms(1, max(1, round(prompt_len)))

    def decode_ms(self, batch: float, context: float) -> float:
        """One decode step of ``batch`` sequences attending ``context`` tokens each:
        weights once plus every sequence's KV (costs are affine in the batch, so a
        fractional batch interpolates the cost model's integer points)."""
        from pdserve.engine.results import StepInfo

        c = max(1, round(context))
        f1, b1 = self.cost.step(StepInfo(1, 1, 1, c, 0.0), 1)
        f2, b2 = self.cost.step(StepInfo(2, 2, 2, 2 * c, 0.0), 2)
        b = max(batch, 0.0)
        return self._seconds(f1 + (b - 1) * (f2 - f1), b1 + (b - 1) * (b2 - b1)) * 1e3

    def step_ms(self, info: StepInfo) -> float:
        """Any step (``StepInfo``: prefill chunks and decodes together), every row
        sampling."""
        flops, nbytes = self.cost.step(info, info.num_seqs)
        return self._seconds(flops, nbytes) * 1e3

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
            return defaults.KV_CACHE_BYTES // self.kv_bytes_per_token
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

    def step_ms(self, info: StepInfo) -> float:
        """Any step: a step of prompt chunks costs ``a + b·tokens + 2c·pairs``
        (``pairs``: what its new tokens attend, ``StepInfo.prompt_pairs``, else
        estimated: a fresh prompt of N attends about N²/2, so this is the fit's
        ``c·N²``, and a later chunk attends its prompt's earlier chunks too), plus what
        its decoding rows add to a step (every row at the step's mean context)."""
        from pdserve.engine.cost import attended_tokens

        rows, chunks = info.num_decode, info.num_seqs - info.num_decode
        tokens = info.num_tokens - rows
        if chunks == 0:
            return self.decode_ms(rows, info.context_tokens / max(1, rows))
        a, b, c = self.prefill_coef
        _, e, f = self.decode_coef
        mean_context = info.context_tokens / info.num_seqs
        pairs = info.prompt_pairs
        if pairs is None:  # estimated: every sequence at the mean prior context
            pairs = max(0.0, attended_tokens(info) - rows * mean_context)
        return a + b * tokens + 2 * c * pairs + rows * (e + f * mean_context)

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
