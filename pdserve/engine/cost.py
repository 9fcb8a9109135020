"""Model FLOPs and memory bytes of one engine step (the numerators of MFU and MBU).

Pure Python on engine types: workers call ``cost_model(...).step(...)`` after each
step; ``pdserve.observability.efficiency`` holds the device peaks they are divided by.

Cost of one step (``StepInfo`` + the model's shape; ``L`` layers, hidden ``h``,
``Hq`` query heads of ``d`` dims, ``Hkv`` KV heads, MLP width ``i``, vocab ``V``,
``b`` bytes per element of the engine dtype)::

    linear params per layer  P = h·(Hq·d + 2·Hkv·d) + Hq·d·h + 3·h·i
    FLOPs = 2·L·P·num_tokens            every computed token through every matmul
          + 2·h·V·num_sampled           the LM head, only on rows that sample
          + 4·L·Hq·d·attended           QKᵀ and PV: 2 FLOPs per multiply-add each
    bytes = w·L·P + [num_sampled>0]·w_head·h·V     weights, read once per step
          + b·2·L·Hkv·d·context_tokens             K and V of every attended token

``w`` = bytes per weight: ``b`` for float weights, 34/32 for int8 (Q8_0 blocks), 20/32
for int4 (Q4_1 blocks), 1 for w8a8; a weight-only quantized model's LM head is int8
(``quant_load.py``), a w8a8 model's keeps the dtype.

``attended`` = Σ over the step's new tokens of the tokens each attends (causal, itself
included): a sequence with ``c`` tokens already computed and ``n`` new ones adds
``n·c + n(n+1)/2``. ``StepInfo`` carries sums over sequences, so ``attended`` is
estimated by giving every sequence the mean prior context and every multi-token chunk
the mean chunk length; it is exact for all-decode steps (the decode pool), for
single-sequence steps, and for equal fresh chunks. Norms, rope, softmax, sampling and
activations are left out (under 1% for the models served here).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

from pdserve.engine.config import ModelConfig
from pdserve.engine.results import StepInfo

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
# Bytes per weight of the quantized formats (block bytes / 32 weights).
QUANT_BYTES = {"int8": 34 / 32, "int4": 20 / 32, "w8a8": 1.0}


@dataclass(frozen=True)
class CostModel:
    """Per-step FLOPs and bytes of one model in one dtype (see the module docstring)."""

    num_layers: int
    linear_params_per_layer: int
    head_params: int  # LM head: h·V
    attn_flops_per_pair: int  # 4·L·Hq·d: one new token attending one context token
    kv_bytes_per_token: int  # K+V of one token, all layers
    dtype_bytes: int
    weight_bytes: float  # per linear weight (dtype_bytes, or a quantized format's)
    head_weight_bytes: float  # per LM-head weight

    def flops(self, info: StepInfo, num_sampled: int) -> float:
        linear = 2 * self.num_layers * self.linear_params_per_layer * info.num_tokens
        return float(linear + 2 * self.head_params * num_sampled
                     + self.attn_flops_per_pair * attended_tokens(info))

    def bytes_read(self, info: StepInfo, num_sampled: int) -> float:
        weights = self.num_layers * self.linear_params_per_layer * self.weight_bytes
        if num_sampled:
            weights += self.head_params * self.head_weight_bytes
        return float(weights + self.kv_bytes_per_token * info.context_tokens)

    @property
    def step_weight_bytes(self) -> float:
        """Weight bytes a decode step reads (every matmul, LM head included)."""
        return (self.num_layers * self.linear_params_per_layer * self.weight_bytes
                + self.head_params * self.head_weight_bytes)

    def step(self, info: StepInfo, num_sampled: int) -> tuple[float, float]:
        """(model FLOPs, bytes read) of one step; ``num_sampled`` = rows that sampled."""
        return self.flops(info, num_sampled), self.bytes_read(info, num_sampled)


@lru_cache(maxsize=16)
def cost_model(model: ModelConfig, dtype: str, quantization: str = "none") -> CostModel:
    """The cost model of ``model`` served in ``dtype`` with weights quantized or not
    (cached: workers call it per step)."""
    h, d, L = model.hidden_size, model.head_dim, model.num_layers
    q, kv = model.num_heads * d, model.num_kv_heads * d
    b = DTYPE_BYTES[dtype]
    w = QUANT_BYTES.get(quantization, b)
    return CostModel(
        num_layers=L,
        linear_params_per_layer=h * (q + 2 * kv) + q * h + 3 * h * model.intermediate_size,
        head_params=h * model.vocab_size,
        attn_flops_per_pair=4 * L * q,
        kv_bytes_per_token=2 * L * kv * b,
        dtype_bytes=b,
        weight_bytes=w,
        head_weight_bytes=QUANT_BYTES["int8"] if quantization in ("int8", "int4") else b,
    )


def attended_tokens(info: StepInfo) -> float:
    """Σ over new tokens of the tokens each attends, estimated from the step's sums."""
    if info.num_seqs == 0:
        return 0.0
    prior = info.context_tokens - info.num_tokens  # tokens computed before this step
    per_seq_prior = prior / info.num_seqs
    # Σ n·c with every sequence at the mean prior context; Σ n(n+1)/2 with decodes
    # (n = 1) exact and the multi-token chunks at their mean length.
    chunks = info.num_seqs - info.num_decode
    chunk_tokens = info.num_tokens - info.num_decode
    triangle = float(info.num_decode)
    if chunks:
        mean = chunk_tokens / chunks
        triangle += chunks * mean * (mean + 1) / 2
    return per_seq_prior * info.num_tokens + triangle
