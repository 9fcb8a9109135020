"""``TokenLogprob``: a token's logprob, rank and top-N -- the engine's sampler makes
them and every layer above passes them on unchanged (the KV transfer's notify payload
as JSON). No torch here: the router imports it."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple


class TokenLogprob(NamedTuple):
    """One token's logprobs: the one shape from the engine's sampler through the workers
    to the API layers (``pdserve.messages`` re-exports it)."""

    token_id: int
    logprob: float  # under the raw model distribution
    top: Sequence[tuple[int, float]] = ()  # top-N (token id, logprob), best first
    rank: int = 0  # 1 + tokens with a strictly higher logprob (0: not computed)

    def to_json(self) -> dict[str, Any]:
        """For the KV transfer's notify payload (JSON on every backend)."""
        return {"token_id": self.token_id, "logprob": self.logprob,
                "top": [list(t) for t in self.top], "rank": self.rank}

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> TokenLogprob:
        return cls(int(d["token_id"]), float(d["logprob"]),
                   [(int(t), float(v)) for t, v in d["top"]], int(d["rank"]))
