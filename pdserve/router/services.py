"""``Services``: what every request's orchestration in the router shares."""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import Any

from pdserve.engine.tokenizer import Tokenizer
from pdserve.router.admission import Admission
from pdserve.router.fanout import Fanout
from pdserve.router.policies import PrefixIndex
from pdserve.router.workers import WorkerSet
from pdserve.tracing import Tracing


@dataclass
class Services:
    """What every request's orchestration shares (owned by ``Router``)."""

    workers: WorkerSet
    admission: Admission
    fanout: Fanout
    prefix: PrefixIndex
    tokenizer: Tokenizer
    block_size: int
    max_retries: int
    metrics: Any = None  # RouterMetrics or None
    tracing: Tracing | None = None  # tracing.py: None when off
    model: str = ""  # the served model's name (in traces)
    attempt_ids: itertools.count[int] = field(default_factory=itertools.count)
