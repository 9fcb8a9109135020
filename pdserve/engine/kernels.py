"""pdserve's CPU kernels (``csrc/``): build once at install time, load at run time.

``python -m pdserve.engine.kernels`` (run by ``make``'s set-up) compiles the C++
sources with torch's extension tooling into ``pdserve/engine/_kernels/``, next to a
stamp holding a hash of the sources and flags. At run time ``load()`` imports that
library if the stamp matches the sources; it never compiles. ``available()`` says
whether the fast CPU paths can run here (x86-64 with AVX2 + FMA, the library built
and current); when they cannot, ``reason()`` says why and the engine's ``auto``
backends use the plain-torch reference paths.
"""

from __future__ import annotations

import hashlib
import importlib.machinery
import importlib.util
import logging
import os
import platform
import sys
from collections.abc import Callable
from pathlib import Path
from types import ModuleType

import torch

log = logging.getLogger("pdserve.engine")
NAME = "pdserve_kernels"
_SRC = Path(__file__).with_name("csrc")
_OUT = Path(__file__).with_name("_kernels")
_SOURCES = ("bindings.cpp", "gemm.cpp", "amx.cpp", "quant_gemm.cpp", "w8a8.cpp", "attention.cpp",
            "attention_bf16.cpp", "pointwise.cpp", "decoder.cpp")
# -ffp-contract=off: a * b + c is never fused behind our back, so that the same
# source line rounds the same in every inlined or vectorised copy (batch invariance).
_CFLAGS = ("-O3", "-mavx2", "-mfma", "-mf16c", "-ffp-contract=off", "-fopenmp", "-std=c++17")

# The paged attention's kernel families (csrc/attention.h's enum), fastest last; the
# engine's attention backends are these as ``cpu-FAMILY`` (engine/attention.py).
ATTENTION_FAMILIES = {"avx2": 0, "avx512bf16": 1, "amx": 2}

_module: ModuleType | None = None
_why: str | None = None


def _fingerprint() -> str:
    h = hashlib.sha256()
    for f in sorted(_SRC.iterdir()):
        if f.suffix in (".cpp", ".h"):
            h.update(f.name.encode())
            h.update(f.read_bytes())
    h.update(" ".join(_CFLAGS).encode())
    h.update(torch.__version__.encode())
    return h.hexdigest()


def _library() -> Path:
    return _OUT / f"{NAME}.so"


def cpu_supported() -> str | None:
    """None when this CPU can run the kernels, else why not."""
    if platform.machine() not in ("x86_64", "AMD64"):
        return f"the CPU kernels need x86-64 with AVX2; this machine is {platform.machine()}"
    cap = torch.backends.cpu.get_cpu_capability()
    if cap not in ("AVX2", "AVX512"):
        return f"the CPU kernels need AVX2 + FMA; torch reports CPU capability {cap}"
    return None


# Flags to take no notice of (space- or comma-separated), so that this machine picks
# the kernel families a CPU without them would: a Zen 4 or Zen 3 run of the suite on
# an AMX Xeon, or one family across a fleet of mixed CPUs (docs/internals.md).
HIDE_FLAGS_ENV = "PDSERVE_HIDE_CPU_FLAGS"


def cpu_flags() -> frozenset[str]:
    """The CPU's feature flags (Linux /proc/cpuinfo; empty elsewhere), less those
    ``PDSERVE_HIDE_CPU_FLAGS`` names."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return frozenset()
    hidden = set(os.environ.get(HIDE_FLAGS_ENV, "").replace(",", " ").split())
    for line in text.splitlines():
        if line.startswith("flags"):
            return frozenset(line.split(":", 1)[1].split()) - hidden
    return frozenset()


def resolve_backend(kind: str, name: str, device: str, fits: bool, needs: str,
                    families: Callable[[], list[str]], refused: Callable[[], str]) -> str:
    """A ``kind`` (linear, attention) backend's name resolved: ``auto`` -> ``cpu`` where
    the kernels run here and the shapes fit, else ``torch``; ``cpu`` -> ``cpu-<family>``,
    the fastest of ``families()``; ``cpu-<family>`` checked. ``needs`` says what the
    shapes must be, ``refused()`` why a family this CPU does not offer is refused."""
    if name == "auto":
        if device != "cpu" or not fits or not available():
            return "torch"
        name = "cpu"
    if name == "torch":
        return name
    if device != "cpu":
        raise ValueError(f"{kind} backend {name!r} runs on the CPU only")
    if reason() is not None:
        raise ValueError(f"{kind} backend {name!r} cannot run here: {reason()}")
    if not fits:
        raise ValueError(f"{kind} backend {name!r} needs {needs}")
    runs = families()
    if name == "cpu":
        return f"cpu-{runs[-1]}"
    if name.removeprefix("cpu-") not in runs:
        raise ValueError(f"{kind} backend {name!r} cannot run here: {refused()}")
    return name


def build(verbose: bool = False) -> Path:
    """Compile the kernels (a no-op when the stamp is current)."""
    from torch.utils import cpp_extension

    stamp = _OUT / "stamp"
    fp = _fingerprint()
    if _library().is_file() and stamp.is_file() and stamp.read_text() == fp:
        stamp.touch()  # current: tell make so
        return _library()
    _OUT.mkdir(exist_ok=True)
    cpp_extension.load(
        name=NAME,
        sources=[str(_SRC / s) for s in _SOURCES],
        extra_cflags=list(_CFLAGS),
        extra_ldflags=["-fopenmp"],
        build_directory=str(_OUT),
        verbose=verbose,
    )
    stamp.write_text(fp)
    return _library()


def load() -> ModuleType | None:
    """The kernels module, or None (see ``reason()``). Never compiles."""
    global _module, _why
    if _module is not None or _why is not None:
        return _module
    why = cpu_supported()
    stamp = _OUT / "stamp"
    if why is None and not (_library().is_file() and stamp.is_file()):
        why = "the CPU kernels are not built (run `make venv` or `python -m pdserve.engine.kernels`)"
    elif why is None and stamp.read_text() != _fingerprint():
        why = "the CPU kernels are older than their sources (run `python -m pdserve.engine.kernels`)"
    if why is not None:
        _why = why
        if cpu_supported() is None:  # they could run here: say loudly that they do not
            log.warning("pdserve: %s; the engine falls back to its (much slower) reference "
                        "paths", why)
        return None
    loader = importlib.machinery.ExtensionFileLoader(NAME, str(_library()))
    spec = importlib.util.spec_from_file_location(NAME, _library(), loader=loader)
    assert spec is not None
    module = importlib.util.module_from_spec(spec)
    loader.exec_module(module)
    _module = module
    return module


def available() -> bool:
    return load() is not None


def reason() -> str | None:
    """Why the kernels cannot be used here (None when they can)."""
    load()
    return _why


def set_num_threads(n: int) -> None:
    """``torch.set_num_threads(n)`` for the calling thread, fixed there now. torch sets a
    process-wide count too and gives it to a thread at its first parallel work (in torch
    and, separately, in these kernels): a thread that set its count but had not yet
    multiplied would otherwise take whatever count another thread set since (a worker's
    KV channel threads set 1: kv_transfer/driver.py)."""
    torch.set_num_threads(n)
    torch.get_num_threads()  # torch's own flag
    module = load()
    if module is not None:
        module.set_num_threads(n)


def require() -> ModuleType:
    module = load()
    if module is None:
        raise RuntimeError(str(_why))
    return module


def main() -> None:
    why = cpu_supported()
    if why is not None:
        print(f"pdserve kernels: skipped ({why}); the engine uses its reference paths")
        return
    path = build(verbose="-v" in sys.argv)
    print(f"pdserve kernels: {path}")


if __name__ == "__main__":
    main()
