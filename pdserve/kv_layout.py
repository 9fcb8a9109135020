"""The shape of one worker's KV cache: the one definition the engine (which allocates
the cache) and the KV channels (which move its blocks) both import. A leaf: it imports
nothing of pdserve.

Owns the cache's element formats (`KV_CACHE_DTYPES`), `KVLayout` (what both ends of a
channel must agree on), its compatibility hash, the byte arithmetic every backend uses
to address a block or a layer range of a block, and `check_tensor` (the KV tensor a
channel wraps really has this layout).

Memory layout of the one KV tensor a worker owns (block-major):

    kv: [num_blocks, num_layers, 2 (K,V), num_kv_heads, block_size, row]

(a row: head_dim values; in an int8 cache head_dim int8 values, then their float32
scale, so the scales travel with their block)

    byte offset of block b = b * block_bytes
    ┌──────────────────────────── block b (block_bytes) ─────────────────────────────┐
    │ layer 0                   │ layer 1                   │ ... │ layer L-1        │
    │ K[H,bs,D]    │ V[H,bs,D]  │ K[H,bs,D]    │ V[H,bs,D]  │     │                  │
    └────────────────────────────────────────────────────────────────────────────────┘
    |<------ layer_bytes ------>|
    layer_bytes = 2 * block_size * num_kv_heads * row * itemsize
    block_bytes = num_layers * layer_bytes

So a whole block is one contiguous region, a layer range [lo, hi) of one block is one
contiguous region of (hi - lo) * layer_bytes bytes at b * block_bytes + lo * layer_bytes,
and consecutive block ids are contiguous with each other. Heads sit outside slots
("HND"), so a range of heads of one (block, layer, K or V) is contiguous too.

Tensor parallelism: a rank's tensor holds only its KV heads, ``heads = (lo, hi)`` of
the model's ``num_kv_heads`` (H above is then hi - lo). Two layouts are compatible when
every model-wide field agrees (the heads may differ); what one sender writes into one
receiver is a ``Slice``: a range of heads both hold, and which part of the receiver's
request it is (a receiver rank fed by several sender ranks expects several parts).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from dataclasses import dataclass
from typing import Any

import torch

# name (what travels in endpoints, JSON-able) -> (element dtype of the tensor, bytes a
# row has beyond its head_dim elements: an int8 row ends with its float32 scale,
# engine/model/kv_cache.py)
KV_CACHE_DTYPES: dict[str, tuple[torch.dtype, int]] = {
    "float32": (torch.float32, 0),
    "bfloat16": (torch.bfloat16, 0),
    "float16": (torch.float16, 0),
    "int8": (torch.int8, 4),
}


class KVLayoutMismatch(ValueError):
    """Two workers' KV layouts differ; the message names each differing field."""


@dataclass(frozen=True)
class KVLayout:
    """What a prefill and a decode worker must agree on before any block moves."""

    model_id: str  # checkpoint name; two models with equal shapes still must not mix
    dtype: str  # one of DTYPES
    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_size: int  # tokens per block
    version: int = 2  # bumped when the tensor layout above changes (2: heads outside slots)
    heads: tuple[int, int] | None = None  # this tensor's KV heads [lo, hi); None: all
    # speculative decoding's draft model, whose prompt KV travels beside this one
    # (``with_draft.py``); None: no draft model
    draft: str | None = None

    def __post_init__(self) -> None:
        if self.dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"KVLayout.dtype {self.dtype!r} is not one of {sorted(KV_CACHE_DTYPES)}")
        for name in ("num_layers", "num_kv_heads", "head_dim", "block_size", "version"):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise ValueError(f"KVLayout.{name} must be a positive int, got {value!r}")
        if not self.model_id:
            raise ValueError("KVLayout.model_id must not be empty")
        if self.heads is not None:
            lo, hi = (int(h) for h in self.heads)
            if not 0 <= lo < hi <= self.num_kv_heads:
                raise ValueError(f"KVLayout.heads {self.heads!r} is not a range within "
                                 f"[0, {self.num_kv_heads})")
            object.__setattr__(self, "heads", (lo, hi))  # a JSON list becomes a tuple

    # --- byte arithmetic -------------------------------------------------------------

    @property
    def torch_dtype(self) -> torch.dtype:
        return KV_CACHE_DTYPES[self.dtype][0]

    @property
    def itemsize(self) -> int:
        return torch.empty((), dtype=self.torch_dtype).element_size()

    @property
    def head_range(self) -> tuple[int, int]:
        """The KV heads this tensor holds, [lo, hi) of the model's."""
        return self.heads if self.heads is not None else (0, self.num_kv_heads)

    @property
    def local_heads(self) -> int:
        lo, hi = self.head_range
        return hi - lo

    @property
    def row_width(self) -> int:
        """Elements of one token's K (or V) of one head: head_dim, and an int8 row's scale."""
        return self.head_dim + KV_CACHE_DTYPES[self.dtype][1]

    def layer_bytes_of(self, num_heads: int) -> int:
        """Bytes of one layer (K and V) of one block, for ``num_heads`` heads."""
        return 2 * self.block_size * num_heads * self.row_width * self.itemsize

    @property
    def layer_bytes(self) -> int:
        """Bytes of one layer (K and V) of one block."""
        return self.layer_bytes_of(self.local_heads)

    @property
    def block_bytes(self) -> int:
        """Bytes of one block, all layers."""
        return self.num_layers * self.layer_bytes

    def block_shape(self) -> tuple[int, ...]:
        """Shape of one block: kv[b]."""
        return (self.num_layers, 2, self.local_heads, self.block_size, self.row_width)

    def kv_shape(self, num_blocks: int) -> tuple[int, ...]:
        return (num_blocks, *self.block_shape())

    def layer_range(self, layers: tuple[int, int] | None) -> tuple[int, int]:
        """Validated [lo, hi) layer range; None means all layers."""
        if layers is None:
            return (0, self.num_layers)
        lo, hi = int(layers[0]), int(layers[1])
        if not 0 <= lo < hi <= self.num_layers:
            raise ValueError(f"layer range {layers!r} is not within [0, {self.num_layers})")
        return (lo, hi)

    # --- compatibility -----------------------------------------------------------------

    def to_dict(self) -> dict[str, Any]:
        data = dataclasses.asdict(self)
        if self.draft is None:
            del data["draft"]  # a layout without a draft reads as before
        if self.heads is None:
            del data["heads"]  # a whole-model layout reads as before
        else:
            data["heads"] = list(self.heads)
        return data

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> KVLayout:
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = set(data) - names
        if unknown:
            raise ValueError(f"unknown KVLayout fields {sorted(unknown)}")
        return cls(**data)

    def model_wide(self) -> KVLayout:
        """This layout with all KV heads (what two ranks of one model share)."""
        return dataclasses.replace(self, heads=None)

    def compat_hash(self) -> str:
        """Stable hex digest of the model-wide fields; equal <=> compatible layouts."""
        canon = json.dumps(self.model_wide().to_dict(), sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(canon.encode()).hexdigest()[:16]

    def check_compatible(self, peer: KVLayout) -> None:
        """Raise KVLayoutMismatch naming every model-wide field where `peer` differs
        (the KV heads each holds may differ: ``plan_slice`` matches them)."""
        if self.compat_hash() == peer.compat_hash():
            return
        diffs = [
            f"{f.name}: local={getattr(self, f.name)!r} peer={getattr(peer, f.name)!r}"
            for f in dataclasses.fields(self)
            if f.name != "heads" and getattr(self, f.name) != getattr(peer, f.name)
        ]
        if self.draft != peer.draft:
            diffs.append("both workers need speculative_config's draft model, in the same "
                         "weight format (speculative_config.quantization, else each pool's "
                         "own): its prompt KV is made by the prefill worker and moves with "
                         "the target's")
        raise KVLayoutMismatch("KV layout mismatch: " + "; ".join(diffs))

    def check_tensor(self, kv: torch.Tensor) -> int:
        """Check `kv` has this layout (any block count); return its number of blocks."""
        if kv.dtype != self.torch_dtype:
            raise ValueError(f"kv dtype {kv.dtype} != layout dtype {self.dtype}")
        if kv.dim() != 6 or tuple(kv.shape[1:]) != self.block_shape():
            raise ValueError(f"kv shape {tuple(kv.shape)} != [num_blocks, *{self.block_shape()}]")
        if not kv.is_contiguous():
            raise ValueError("kv must be contiguous (one registered region per worker)")
        return int(kv.shape[0])
