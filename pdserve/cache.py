"""Where pdserve keeps what it makes once per machine: the converted default model and,
outside a source checkout, the compiled CPU kernels.

``$PDSERVE_CACHE_DIR`` when set, else ``$XDG_CACHE_HOME/pdserve``, else
``~/.cache/pdserve``.
"""

from __future__ import annotations

import os
from pathlib import Path

CACHE_ENV = "PDSERVE_CACHE_DIR"


def cache_root() -> Path:
    if os.environ.get(CACHE_ENV):
        return Path(os.environ[CACHE_ENV]).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg) if xdg else Path.home() / ".cache") / "pdserve"
