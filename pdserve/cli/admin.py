"""``pdserve scale`` and ``pdserve workers``: the operator's commands, over a running
server's ``/admin/`` API (``pdserve.router.http.admin``).

``pdserve scale --prefill N --decode M --colocated K`` sets the pools' target sizes
(``--remove WORKER``: that worker is the one that leaves)
and waits until the server reports them reached (or ``--timeout`` passes, or the
server reports a scaling error); ``--no-wait`` returns at once. ``pdserve workers``
lists every worker. Both send ``--api-key`` (default ``$PDSERVE_API_KEY``) as a
Bearer token.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import urllib.error
import urllib.request
from typing import Any

POLL_S = 0.5


def add_scale_arguments(p: argparse.ArgumentParser) -> None:
    _add_common(p)
    for pool in ("prefill", "decode", "colocated"):
        p.add_argument(f"--{pool}", type=int, default=None, help=f"target {pool} workers")
    p.add_argument("--remove", action="append", default=[], metavar="WORKER",
                   help="this worker leaves (its pool shrinks by one unless its size is "
                        "given; a decode worker's requests move to the others); repeatable")
    p.add_argument("--timeout", type=float, default=600.0,
                   help="seconds to wait for the targets (default 600)")
    p.add_argument("--no-wait", action="store_true", help="set the targets and return")


def add_workers_arguments(p: argparse.ArgumentParser) -> None:
    _add_common(p)


def _add_common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--url", default="http://127.0.0.1:8000",
                   help="the server's HTTP address (default http://127.0.0.1:8000)")
    p.add_argument("--api-key", default=os.environ.get("PDSERVE_API_KEY"),
                   help="sent as 'Authorization: Bearer KEY' (default: $PDSERVE_API_KEY)")
    p.add_argument("--json", action="store_true", help="print JSON")


def run_scale(args: argparse.Namespace) -> int:
    changes: dict[str, Any] = {pool: n for pool in ("prefill", "decode", "colocated")
                               if (n := getattr(args, pool)) is not None}
    if args.remove:
        changes["remove"] = args.remove
    if not changes:
        raise ValueError("give --prefill, --decode, --colocated and/or --remove")
    status = _call(args, "POST", "/admin/scale", changes)
    deadline = time.monotonic() + args.timeout
    while not args.no_wait and not status["reached"] and status["error"] is None:
        if time.monotonic() >= deadline:
            _print_status(args, status)
            print(f"pdserve: targets not reached after {args.timeout:g}s", file=sys.stderr)
            return 1
        time.sleep(POLL_S)
        status = _call(args, "GET", "/admin/scale")
    _print_status(args, status)
    if status["error"] is not None:
        print(f"pdserve: scaling failed: {status['error']}", file=sys.stderr)
        return 1
    return 0


def run_workers(args: argparse.Namespace) -> int:
    workers = _call(args, "GET", "/admin/workers")["workers"]
    if args.json:
        print(json.dumps(workers))
        return 0
    cols = ("id", "role", "state", "requests", "free_blocks", "blocks", "restarts", "metrics")
    rows = [[str(w.get(c) if w.get(c) is not None else "-") for c in cols] for w in workers]
    widths = [max(len(c), *(len(r[i]) for r in rows)) for i, c in enumerate(cols)]
    for line in [list(cols), *rows]:
        print("  ".join(v.ljust(n) for v, n in zip(line, widths, strict=True)).rstrip())
    return 0


def _print_status(args: argparse.Namespace, status: dict[str, Any]) -> None:
    if args.json:
        print(json.dumps(status))
        return
    for pool, target in status["targets"].items():
        print(f"{pool:<10} {status['current'][pool]} / {target}")
    if status.get("failed_over"):
        print(f"{status['failed_over']} request(s) failed over at a drain timeout")


def _call(args: argparse.Namespace, method: str, path: str,
          body: dict[str, Any] | None = None) -> dict[str, Any]:
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(args.url.rstrip("/") + path, data=data, method=method)
    req.add_header("Content-Type", "application/json")
    if args.api_key:
        req.add_header("Authorization", f"Bearer {args.api_key}")
    try:
        with urllib.request.urlopen(req, timeout=30) as resp:
            out: dict[str, Any] = json.loads(resp.read())
            return out
    except urllib.error.HTTPError as exc:
        try:
            message = json.loads(exc.read())["error"]["message"]
        except (ValueError, KeyError, TypeError):
            message = exc.reason
        raise ValueError(f"{args.url}{path}: {exc.code} {message}") from None
    except (urllib.error.URLError, OSError) as exc:
        raise ValueError(f"cannot reach {args.url}: {getattr(exc, 'reason', exc)}") from None
