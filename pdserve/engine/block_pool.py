"""The KV block allocator: integer block ids, reference counts and the prefix cache.

No tensors live here; the pool only decides *which* block ids hold which tokens.

Every block is in exactly one of three states::

    free    ref == 0, no hash      -> in ``_free`` (handed out first)
    cached  ref == 0, has a hash   -> in ``_evictable`` (LRU; reused on a prefix hit,
                                      evicted when ``_free`` runs dry)
    used    ref >= 1               -> owned by one or more requests

so ``free + cached + used == total`` always (``check_integrity``).

Prefix caching: a *full* block's identity is a chained hash of (parent block's hash,
the block's token ids), so equal hashes mean equal whole prefixes. A request whose
leading full blocks hash to cached blocks shares them (ref += 1) instead of
recomputing them.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict, deque
from collections.abc import Iterable, Sequence

ROOT_HASH = 0


def hash_block(parent_hash: int, token_ids: Sequence[int]) -> int:
    """Chained 128-bit hash of one full block (collision-safe, process-stable)."""
    h = hashlib.blake2b(digest_size=16)
    h.update(parent_hash.to_bytes(16, "little"))
    h.update(array("q", token_ids).tobytes())
    return int.from_bytes(h.digest(), "little")


def root_hash(cache_salt: str | None) -> int:
    """The parent of a request's first block: ``ROOT_HASH``, or one of the salt's own
    (vLLM's ``cache_salt``: only requests with the same salt share cached blocks)."""
    if cache_salt is None:
        return ROOT_HASH
    return int.from_bytes(hashlib.blake2b(cache_salt.encode(), digest_size=16,
                                          person=b"pdserve-salt").digest(), "little")


def prefix_block_hashes(token_ids: Sequence[int], block_size: int,
                        known: Sequence[int] = (), root: int = ROOT_HASH) -> list[int]:
    """Chained hashes of every full block of ``token_ids``, the first one's parent
    ``root``; ``known``: those of its first blocks, computed before (only the blocks
    after them are hashed)."""
    hashes = list(known)
    parent = hashes[-1] if hashes else root
    for start in range(len(hashes) * block_size, len(token_ids) - block_size + 1, block_size):
        parent = hash_block(parent, token_ids[start : start + block_size])
        hashes.append(parent)
    return hashes


class BlockPool:
    def __init__(self, num_blocks: int, enable_prefix_caching: bool = True) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        self.num_blocks = num_blocks
        self.enable_prefix_caching = enable_prefix_caching
        self._ref = [0] * num_blocks
        self._hash: list[int | None] = [None] * num_blocks
        self._free: deque[int] = deque(range(num_blocks))
        self._evictable: OrderedDict[int, None] = OrderedDict()
        self._by_hash: dict[int, int] = {}
        # Counters for metrics: prefix-cache queries and hits, in blocks.
        self.prefix_queries = 0
        self.prefix_hits = 0

    # ------------------------------------------------------------------ queries
    @property
    def num_free(self) -> int:
        """Blocks an ``allocate`` call can hand out (free + evictable cached)."""
        return len(self._free) + len(self._evictable)

    @property
    def num_cached(self) -> int:
        return len(self._evictable)

    @property
    def num_used(self) -> int:
        return self.num_blocks - self.num_free

    def usage(self) -> float:
        return self.num_used / self.num_blocks

    def ref_count(self, block_id: int) -> int:
        return self._ref[block_id]

    # --------------------------------------------------------------- allocation
    def allocate(self, n: int) -> list[int] | None:
        """``n`` fresh blocks (ref = 1), or ``None`` if there is no room."""
        free, ref = self._free, self._ref
        if n > len(free) + len(self._evictable):
            return None
        out = [free.popleft() for _ in range(min(n, len(free)))]
        if len(out) < n:  # evict the least recently released cached blocks
            evictable, hashes, by_hash = self._evictable, self._hash, self._by_hash
            for _ in range(n - len(out)):
                block, _ = evictable.popitem(last=False)
                h = hashes[block]  # (a cached block has one)
                hashes[block] = None
                if by_hash.get(h) == block:  # type: ignore[arg-type]
                    del by_hash[h]  # type: ignore[arg-type]
                out.append(block)
        for block in out:
            ref[block] = 1
        return out

    def free(self, block_ids: Iterable[int]) -> None:
        """Drop one reference from each block; released in reverse so the tail of a
        sequence (least likely to be shared) is evicted first."""
        ref, hashes, evictable, free = self._ref, self._hash, self._evictable, self._free
        for block in reversed(list(block_ids)):
            r = ref[block] - 1
            if r < 0:
                raise RuntimeError(f"double free of block {block}")
            ref[block] = r
            if r == 0:
                if hashes[block] is not None:
                    evictable[block] = None
                else:
                    free.append(block)

    # ------------------------------------------------------------- prefix cache
    def lookup(self, block_hashes: Sequence[int]) -> list[int]:
        """Block ids holding the longest cached prefix of ``block_hashes``.
        Does not take references: call ``acquire`` on what you keep."""
        if not self.enable_prefix_caching:
            return []
        hits: list[int] = []
        for h in block_hashes:
            block = self._by_hash.get(h)
            if block is None:
                break
            hits.append(block)
        self.prefix_queries += len(block_hashes)
        self.prefix_hits += len(hits)
        return hits

    def acquire(self, block_ids: Iterable[int]) -> None:
        """Take a reference on cached or used blocks (prefix hits)."""
        for block in block_ids:
            if self._ref[block] == 0:
                if block not in self._evictable:
                    raise RuntimeError(f"block {block} is free, not cached")
                del self._evictable[block]
            self._ref[block] += 1

    def register(self, block_ids: Sequence[int], block_hashes: Sequence[int]) -> None:
        """Mark used, fully computed blocks as holding the prefixes ``block_hashes``
        (in order; a block registered already, or whose prefix another block holds,
        stays as it is)."""
        if not self.enable_prefix_caching:
            return
        ref, hashes, by_hash = self._ref, self._hash, self._by_hash
        for block, h in zip(block_ids, block_hashes, strict=True):
            if hashes[block] is not None:
                continue
            if ref[block] <= 0:
                raise RuntimeError(f"cannot register unreferenced block {block}")
            if h in by_hash:  # an equal block is cached already
                continue
            hashes[block] = h
            by_hash[h] = block

    def reset_prefix_cache(self) -> None:
        """Forget every cached prefix and the prefix-cache counters (used blocks keep
        their data); with no block in use, the pool is as new."""
        for block in list(self._evictable):
            self._forget_hash(block)
            self._free.append(block)
        self._evictable.clear()
        for block in range(self.num_blocks):
            self._forget_hash(block)
        if not self.num_used:
            self._free = deque(range(self.num_blocks))
        self.prefix_queries = self.prefix_hits = 0

    def _forget_hash(self, block: int) -> None:
        h = self._hash[block]
        if h is not None:
            self._hash[block] = None
            if self._by_hash.get(h) == block:
                del self._by_hash[h]

    # ---------------------------------------------------------------- integrity
    def check_integrity(self) -> None:
        """Raise ``AssertionError`` unless the pool's bookkeeping is consistent."""
        free, cached = set(self._free), set(self._evictable)
        used = {b for b in range(self.num_blocks) if self._ref[b] > 0}
        problems = []
        if len(free) != len(self._free):
            problems.append("a block is twice in the free list")
        if free & cached or free & used or cached & used:
            problems.append("a block is in two states")
        if len(free) + len(cached) + len(used) != self.num_blocks:
            problems.append(
                f"free {len(free)} + cached {len(cached)} + used {len(used)} != total "
                f"{self.num_blocks}"
            )
        if any(self._hash[b] is not None for b in free):
            problems.append("a free block still has a hash")
        if any(self._hash[b] is None for b in cached):
            problems.append("a cached block has no hash")
        if any(r < 0 for r in self._ref):
            problems.append("negative ref count")
        for h, b in self._by_hash.items():
            if self._hash[b] != h:
                problems.append(f"hash index points at block {b} holding another hash")
                break
        if problems:
            raise AssertionError("block pool integrity: " + "; ".join(problems))
