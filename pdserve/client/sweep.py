r"""What a request-rate sweep concludes: the DistServe goodput.

DistServe (Zhong et al., OSDI '24) defines a system's goodput as the highest
request rate it serves while at least a target share of the requests (90% by
default) meet *every* latency SLO. Each run of a sweep measures one point of the
attainment curve: the configured rate against ``slo_attainment`` (requests that
completed within all of ``--goodput``'s SLOs over all requests sent, so a failed
request is a miss). Between measured rates the curve is taken as linear::

    attainment
     100% | *-----*
      90% |.......:\.......... target
          |       : \
      50% |       :  `--*
          +-+-----+--^--+----> request rate (req/s)
            1     2  |  4
                     goodput: 2.4 req/s

Rules, for noisy curves too: the goodput lies on the segment that starts at the
*highest* measured rate still at or above the target. If that is the highest rate
measured, the goodput is at least that rate (``bound = "at_least"``: sweep
higher); if no measured rate meets the target it is below the lowest one
(``bound = "below"``, ``rate = None``: sweep lower). Unbounded ("inf") runs have
no place on the rate axis and are left out.

This is not vLLM's ``request_goodput`` (completed requests meeting every SLO per
second of one run, in ``metrics``): that one is a throughput, this one a rate.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

DEFAULT_ATTAINMENT_TARGET = 0.9


def distserve_goodput(rows: Sequence[Mapping[str, Any]],
                      target: float = DEFAULT_ATTAINMENT_TARGET) -> dict[str, Any] | None:
    """The DistServe goodput of a sweep's rows (``request_rate``, ``slo_attainment``)
    as saved in the sweep JSON: ``target`` (share), ``rate`` (req/s or None),
    ``bound`` and ``between`` (the measured rates it lies between; None: no upper
    one measured). None when
    the rows carry no attainment (no ``--goodput``) or no finite rate."""
    if not 0 < target <= 1:
        raise ValueError(f"the attainment target must be in (0, 1], got {target}")
    points = sorted((float(r["request_rate"]), float(r["slo_attainment"])) for r in rows
                    if r.get("slo_attainment") is not None
                    and math.isfinite(float(r["request_rate"])))
    if not points:
        return None
    meeting = [i for i, (_, attained) in enumerate(points) if attained >= target]
    if not meeting:
        lowest = points[0][0]
        return {"target": target, "rate": None, "bound": "below", "between": [0.0, lowest]}
    i = meeting[-1]
    if i == len(points) - 1:
        highest = points[i][0]
        return {"target": target, "rate": highest, "bound": "at_least",
                "between": [highest, None]}
    (r0, a0), (r1, a1) = points[i], points[i + 1]
    # a0 >= target > a1, so a0 > a1: the segment crosses the target once.
    rate = r0 + (a0 - target) / (a0 - a1) * (r1 - r0)
    return {"target": target, "rate": rate, "bound": "interpolated", "between": [r0, r1]}


def describe_goodput(goodput: Mapping[str, Any]) -> str:
    """One printed line for a `distserve_goodput` result."""
    head = (f"DistServe goodput (highest rate with >= {100 * goodput['target']:g}% "
            f"SLO attainment):")
    low, high = goodput["between"]
    if goodput["bound"] == "below":
        return f"{head} below {high:g} req/s (no measured rate met it; sweep lower)"
    if goodput["bound"] == "at_least":
        return f"{head} at least {low:g} req/s (the highest rate measured met it; sweep higher)"
    return (f"{head} {goodput['rate']:.3g} req/s (interpolated between {low:g} and "
            f"{high:g} req/s)")
