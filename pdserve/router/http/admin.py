"""The operator's HTTP API under ``/admin/`` (on the router's HTTP port):

* ``GET /admin/workers`` -- every worker: id, pool, state (joining | serving |
  draining | down | refused), restarts, requests on it, free/total KV blocks, its /metrics;
* ``GET /admin/scale`` -- each pool's target and current size, whether the targets
  are reached, the last scaling error;
* ``POST /admin/scale`` with ``{"prefill": N, "decode": M, "colocated": K}`` (any
  of them) and ``"remove": [worker ids]`` (those leave; each one's pool shrinks by
  one unless its size is given) -- set target sizes; answers 202 with the status at
  once (poll ``GET`` until ``reached``), 400 naming the problem for bad sizes.

With API keys configured, these need ``Authorization: Bearer <key>`` like every
route but the probes (``ApiKeyMiddleware`` denies by default). Without keys the API
is as open as the rest of the server: bind it to a private address.
"""

from __future__ import annotations

from typing import Any, Protocol

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse

from pdserve.router.http.json_body import BadJson, parse_json
from pdserve.router.openai.response_objects import error_object


class Admin(Protocol):
    """What the admin API drives (``pdserve.cluster.scaler.Scaler``)."""

    def workers(self) -> list[dict[str, Any]]: ...
    def status(self) -> dict[str, Any]: ...
    def set_targets(self, changes: dict[str, Any]) -> dict[str, Any]: ...


def admin_routes(admin: Admin) -> APIRouter:
    r = APIRouter(prefix="/admin")

    @r.get("/workers")
    async def workers() -> dict[str, Any]:
        return {"workers": admin.workers()}

    @r.get("/scale")
    async def scale_status() -> dict[str, Any]:
        return admin.status()

    @r.post("/scale")
    async def scale(request: Request) -> JSONResponse:
        try:
            body = parse_json(await request.body())
            return JSONResponse(admin.set_targets(body), status_code=202)
        except BadJson as exc:
            return JSONResponse(error_object(exc.message), status_code=400)
        except ValueError as exc:
            return JSONResponse(error_object(str(exc)), status_code=400)

    return r
