"""What a CPU worker's engine gets from its pool (pdserve/cluster/config.py ``PoolConfig``): its
prefill step's token budget, and how many engine threads it runs:
``num_cpus`` of its own plus ``shared_cpus``, which on the embedded cluster (one
machine) lets the prefill pool run on the decode pool's cores and the decode pool on
the prefill pool's."""

from __future__ import annotations

import pytest

from pdserve.cluster.config import ClusterConfig, PoolConfig
from pdserve.engine.config import EngineConfig


def threads(cfg: ClusterConfig, role: str) -> int | None:
    pool = {"prefill": cfg.prefill_pool, "decode": cfg.decode_pool}[role]
    return pool.engine_config(role, "cpu").num_threads


def test_the_embedded_pools_share_each_others_cores() -> None:
    cfg = ClusterConfig()  # embedded, 1P + 1D of one CPU each
    assert (threads(cfg, "prefill"), threads(cfg, "decode")) == (2, 2)
    big = ClusterConfig.from_dict({"prefill": {"workers": 2, "num_cpus": 2},
                                   "decode": {"workers": 2, "num_cpus": 3}})
    assert (threads(big, "prefill"), threads(big, "decode")) == (5, 5)  # 2 + 6 // 2, 3 + 4 // 2
    assert big.prefill_pool.bundle(False) == {"CPU": 2}  # nothing more reserved in Ray
    assert big.decode_pool.bundle(False) == {"CPU": 3}
    lopsided = ClusterConfig.from_dict({"decode": {"workers": 3}})
    assert threads(lopsided, "decode") == 1  # 1 // 3: no whole core each


def test_a_cluster_shares_only_what_it_is_told() -> None:
    joined = ClusterConfig.from_dict({"address": "auto"})  # pools may be on other nodes
    assert threads(joined, "prefill") == 1
    told = ClusterConfig.from_dict({"address": "auto", "prefill": {"shared_cpus": 3}})
    assert threads(told, "prefill") == 4
    assert threads(joined, "decode") == 1
    off = ClusterConfig.from_dict({"prefill": {"shared_cpus": 0}, "decode": {"shared_cpus": 0}})
    assert (threads(off, "prefill"), threads(off, "decode")) == (1, 1)
    explicit = ClusterConfig.from_dict({"prefill": {"engine": {"num_threads": 7}}})
    assert threads(explicit, "prefill") == 7  # the engine key wins
    tp = ClusterConfig.from_dict({"prefill": {"tensor_parallel_size": 2, "num_cpus": 2},
                                  "decode": {"num_cpus": 2}})
    assert threads(tp, "prefill") == 2  # (2 + 2) // 2 ranks


def test_shared_cpus_must_not_be_negative() -> None:
    with pytest.raises(ValueError, match="shared_cpus must be >= 0"):
        PoolConfig(shared_cpus=-1)


def test_cpu_prefill_steps_take_512_tokens_unless_the_pool_says() -> None:
    """A CPU prefill step's prompts get their first tokens when the step ends: the
    prefill pool's default budget is 512 tokens (config.py says what it measured);
    the other roles, GPUs and a pool's own engine key keep theirs."""
    cfg = ClusterConfig()
    assert cfg.prefill_pool.engine_config("prefill", "cpu").max_num_batched_tokens == 512
    engine_default = EngineConfig().max_num_batched_tokens
    assert engine_default == 2048
    assert cfg.decode_pool.engine_config("decode", "cpu").max_num_batched_tokens == engine_default
    assert cfg.prefill_pool.engine_config("prefill", "cuda").max_num_batched_tokens == engine_default
    told = ClusterConfig.from_dict({"prefill": {"engine": {"max_num_batched_tokens": 4096}}})
    assert told.prefill_pool.engine_config("prefill", "cpu").max_num_batched_tokens == 4096
