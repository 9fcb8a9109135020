"""Generated protobuf / gRPC modules, built on first use.

This package owns access to the code generated from ``protos/``::

    from pdserve.protos import pb, pb_grpc   # pdserve/v1/pdserve.proto

``pb`` is the messages module (``pdserve_pb2``), ``pb_grpc`` the service stubs
(``pdserve_pb2_grpc``). On first access the code is (re)generated when a file is
missing or older than its ``.proto`` (see ``build.py``), so a fresh clone works
before ``python -m pdserve.protos.build`` has run. Access is lazy (PEP 562) so that
running the build module does not first trigger a build through this package.
"""

from __future__ import annotations

import importlib
from types import ModuleType

# Public name -> generated module, for pdserve/v1/pdserve.proto.
_MODULES = {
    "pb": "pdserve.protos.gen.pdserve.v1.pdserve_pb2",
    "pb_grpc": "pdserve.protos.gen.pdserve.v1.pdserve_pb2_grpc",
}

__all__ = ["ensure_generated", "pb", "pb_grpc"]


def ensure_generated() -> None:
    """Generate the code if any output is missing or stale; no-op otherwise."""
    from pdserve.protos import build

    if build.needs_build():
        build.build()


def __getattr__(name: str) -> ModuleType:
    if name not in _MODULES:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    ensure_generated()
    importlib.invalidate_caches()  # files may have appeared since the last import scan
    try:
        module = importlib.import_module(_MODULES[name])
    except ModuleNotFoundError as exc:
        # Only possible without protos/ to build from (an install that lost its gen/).
        raise ImportError(
            f"generated protobuf code is missing ({exc.name}); "
            "run `python -m pdserve.protos.build` from a pdserve checkout"
        ) from exc
    globals()[name] = module  # later accesses skip __getattr__
    return module
