"""Tensor-parallel engines as processes: rank 0 is the ``LLMEngine`` the worker
holds; ranks 1.. are processes spawned here on the same node, each building its own
engine (its shard; ``engine/tp/``) and its KV channel over its KV heads, driven by
the leader through a pipe (``kv_transfer.sharded``), then following the leader's calls
in lockstep (``tp.follow``).

A layer over the engine and the KV channels (the engine imports neither this nor
``kv_transfer``): ``create_engine`` is what workers and tools call.
"""

from __future__ import annotations

import multiprocessing
import os
import threading
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from pdserve.engine.config import EngineConfig
from pdserve.engine.engine import LLMEngine
from pdserve.engine.tokenizer import Tokenizer
from pdserve.engine.tp.collectives import TIMEOUT_S, TPGroup
from pdserve.engine.tp.lockstep import follow
from pdserve.kv_transfer.rank_channel import serve_rank


def create_engine(model_dir: str | Path, config: EngineConfig | None = None,
                  tokenizer: Tokenizer | None = None) -> LLMEngine:
    """An engine of ``config.tensor_parallel_size`` ranks on this machine: the
    followers are spawned here, the returned engine is rank 0 (its ``close()`` stops
    them)."""
    config = config or EngineConfig()
    size = config.tensor_parallel_size
    if size == 1:
        return LLMEngine(model_dir, config, tokenizer)
    store, procs, links = spawn_followers(model_dir, config, size)
    try:
        group = TPGroup(0, size, "127.0.0.1", store.port, torch.device(config.device),
                        store=store)
        engine = LLMEngine(model_dir, config, tokenizer, tp=group)
        wait_followers(store, procs)
    except BaseException:
        for p in procs:
            p.kill()
        raise
    engine._followers, engine.rank_links = procs, links
    group.peer_gone = lambda: next((f"tensor-parallel rank {r} died (exit code "
                                    f"{p.exitcode})" for r, p in enumerate(procs, 1)
                                    if not p.is_alive()), None)
    return engine


def spawn_followers(model_dir: str | Path, config: EngineConfig, size: int,
                    host: str = "127.0.0.1") -> tuple[dist.TCPStore, list[Any], list[Any]]:
    """Start ranks 1..size-1 (spawned processes, each building its engine and
    following); returns the leader's store, the processes and a pipe to each (its KV
    transfer channel: ``kv_transfer.sharded``)."""
    store = TPGroup.host_store(size, host)
    ctx = multiprocessing.get_context("spawn")
    procs, links = [], []
    for rank in range(1, size):
        mine, theirs = ctx.Pipe()
        p = ctx.Process(target=_follower_main, args=(str(model_dir), config, rank, size, host,
                                                     store.port, theirs), daemon=True,
                        name=f"pdserve-tp-rank{rank}")
        p.start()
        theirs.close()
        procs.append(p)
        links.append(mine)
    return store, procs, links


def wait_followers(store: dist.TCPStore, procs: list[Any], timeout_s: float = TIMEOUT_S,
                   ) -> None:
    """Until every follower has built its engine; ``RuntimeError`` with its error if
    one failed or died first."""
    deadline = time.monotonic() + timeout_s
    for rank, p in enumerate(procs, start=1):
        while not store.check([f"ready/{rank}"]):
            if not p.is_alive():
                raise RuntimeError(f"tensor-parallel rank {rank} exited with {p.exitcode} "
                                   "while loading")
            if time.monotonic() > deadline:
                raise RuntimeError(f"tensor-parallel rank {rank} not ready in {timeout_s:.0f}s")
            time.sleep(0.05)
        status = store.get(f"ready/{rank}").decode()
        if status != "ok":
            raise RuntimeError(f"tensor-parallel rank {rank}: {status}")


def _follower_main(model_dir: str, config: EngineConfig, rank: int, size: int, host: str,
                   port: int, link: Any) -> None:
    if config.device == "cuda":  # "cuda" means this rank's GPU from here on
        torch.cuda.set_device(rank)
    leader = os.getppid()
    group = TPGroup(rank, size, host, port, torch.device(config.device))
    group.peer_gone = lambda: None if os.getppid() == leader else "the leader (rank 0) died"
    try:
        # (its tokenizer too: the end tokens it stops on must be rank 0's)
        engine = LLMEngine(model_dir, config, tp=group)
    except Exception as exc:
        group.store.set(f"ready/{rank}", f"error: {type(exc).__name__}: {exc}")
        raise
    layout = engine.kv_layout()
    channel = threading.Thread(target=serve_rank, args=(link, engine.kv_cache, layout,
                                                        f"rank{rank}"),
                               name=f"kv-rank{rank}", daemon=True)
    channel.start()
    group.store.set(f"ready/{rank}", "ok")
    follow(engine)
    channel.join(10)  # the leader closed its end first: the channel is closing
