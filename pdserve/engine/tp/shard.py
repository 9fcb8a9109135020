"""``Shard``: what one tensor-parallel rank holds of a model (Megatron-style cuts,
see the package docstring), and ``check_shardable``."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from pdserve.engine.config import ModelConfig


@dataclass(frozen=True)
class Shard:
    """What rank ``rank`` of ``size`` holds of a model."""

    rank: int
    size: int
    q_heads: tuple[int, int]  # query heads [lo, hi)
    kv_heads: tuple[int, int]  # KV heads [lo, hi)
    inter: tuple[int, int]  # MLP columns [lo, hi)
    vocab: tuple[int, int]  # vocabulary rows [lo, hi) (the last shard may be short)

    @classmethod
    def of(cls, cfg: ModelConfig, rank: int, size: int) -> Shard:
        """Balanced contiguous shards: ranks differ by at most one KV head (its query
        heads follow it), MLP column counts by at most one; the vocabulary is cut into
        equal padded shards (the gathered logits line up)."""
        check_shardable(cfg, size)
        hq, hkv = cfg.num_heads, cfg.num_kv_heads
        if hkv >= size:
            kv = (rank * hkv // size, (rank + 1) * hkv // size)
            group = hq // hkv
            q = (kv[0] * group, kv[1] * group)
        else:  # replicated: the KV head this rank's query heads read
            kv_lo = rank * hkv // size
            kv, q = (kv_lo, kv_lo + 1), (rank * hq // size, (rank + 1) * hq // size)
        inter = cfg.intermediate_size
        vocab = -(-cfg.vocab_size // size)
        return cls(rank, size, q, kv, (rank * inter // size, (rank + 1) * inter // size),
                   (min(rank * vocab, cfg.vocab_size), min((rank + 1) * vocab, cfg.vocab_size)))

    def local_config(self, cfg: ModelConfig) -> ModelConfig:
        """The shapes this rank's modules have (vocab: the padded shard width)."""
        return dataclasses.replace(
            cfg, num_heads=self.q_heads[1] - self.q_heads[0],
            num_kv_heads=self.kv_heads[1] - self.kv_heads[0],
            intermediate_size=self.inter[1] - self.inter[0],
            vocab_size=-(-cfg.vocab_size // self.size))

    @staticmethod
    def widest_kv(cfg: ModelConfig, size: int) -> ModelConfig:
        """``cfg`` with the most KV heads any rank holds: every rank sizes its KV cache
        (the number of blocks) from it, so all ranks have the same block ids."""
        return dataclasses.replace(cfg, num_kv_heads=-(-cfg.num_kv_heads // size))


def check_shardable(cfg: ModelConfig, size: int) -> None:
    """``ValueError`` naming the model's dimension that ``size`` ranks cannot split."""
    if size < 1:
        raise ValueError(f"tensor_parallel_size must be >= 1, got {size}")
    hq, hkv = cfg.num_heads, cfg.num_kv_heads
    if hkv < size and (size % hkv or hq % size):
        raise ValueError(
            f"tensor_parallel_size={size} cannot split {cfg.name or 'the model'}: with "
            f"fewer KV heads ({hkv}) than ranks, the ranks must be a multiple of the KV "
            f"heads and divide the {hq} attention heads")
    if cfg.intermediate_size < size:
        raise ValueError(f"tensor_parallel_size={size} is more than the MLP width "
                         f"{cfg.intermediate_size}")
