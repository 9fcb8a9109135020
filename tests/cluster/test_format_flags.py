"""`pdserve serve` / `generate` flags for weight formats reach the pools' engine
configs, merged with a YAML config instead of replacing it."""

from __future__ import annotations

from pathlib import Path

import pytest

from pdserve.cli.main import _cluster_config, build_parser
from pdserve.cluster.config import ClusterConfig


def config(*argv: str) -> ClusterConfig:
    return _cluster_config(build_parser().parse_args(["serve", *argv]))


def test_quantization_flags_per_pool_and_global() -> None:
    c = config("--quantization", "int8", "--decode-quantization", "int4",
               "--quantization-group-size", "64")
    assert c.prefill.engine == {"quantization": "int8", "quantization_group_size": 64}
    assert c.decode.engine == {"quantization": "int4", "quantization_group_size": 64}
    assert c.colocated is None  # the flags do not create a colocated pool
    c = config("--colocated-workers", "1", "--dtype", "bfloat16")
    assert c.colocated is not None and c.colocated.engine == {"dtype": "bfloat16"}
    assert config().decode.engine == {}


def test_flags_merge_with_the_yaml_engine_keys(tmp_path: Path) -> None:
    yaml = tmp_path / "c.yaml"
    yaml.write_text("decode: {workers: 2, engine: {num_blocks: 512, quantization: int8}}\n")
    c = config("--config", str(yaml), "--decode-quantization", "int4")
    assert c.decode.workers == 2
    assert c.decode.engine == {"num_blocks": 512, "quantization": "int4"}
    assert c.prefill.engine == {}


def test_bad_values_are_clear_errors(tmp_path: Path) -> None:
    yaml = tmp_path / "c.yaml"
    yaml.write_text("decode: {engine: {quantization: int3}}\n")
    with pytest.raises(ValueError, match="quantization must be none, int8, int4 or w8a8"):
        config("--config", str(yaml))
    with pytest.raises(ValueError, match="quantization_group_size must be 32, 64 or 128"):
        config("--quantization-group-size", "48")
    with pytest.raises(SystemExit):
        config("--quantization", "int3")


def test_the_router_counts_blocks_of_the_pools_size() -> None:
    """The router's block size is the workers' (a pool of 32-token blocks is not counted
    and hashed in 16-token ones); pools that disagree are refused."""
    assert ClusterConfig().block_size == 16
    big = {"engine": {"block_size": 32}}
    c = ClusterConfig.from_dict({"prefill": big, "decode": big})
    assert c.block_size == 32
    with pytest.raises(ValueError, match=r"one KV block size.*prefill 32, decode 16"):
        ClusterConfig.from_dict({"prefill": big})


def test_kv_cache_dtype_reaches_every_pool_and_pools_must_agree(tmp_path: Path) -> None:
    c = config("--kv-cache-dtype", "int8", "--colocated-workers", "1")
    for pool in (c.prefill, c.decode, c.colocated):
        assert pool is not None and pool.engine == {"kv_cache_dtype": "int8"}
    yaml = tmp_path / "c.yaml"
    yaml.write_text("prefill: {engine: {kv_cache_dtype: int8}}\n")
    with pytest.raises(ValueError, match=r"one format .*got prefill int8, decode auto"):
        config("--config", str(yaml))
    yaml.write_text("decode: {engine: {kv_cache_dtype: int4}}\n")
    with pytest.raises(ValueError, match="kv_cache_dtype must be auto or one of"):
        config("--config", str(yaml))
