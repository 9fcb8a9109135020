"""pdserve's CPU kernels (``csrc/``): compiled once per machine, loaded at run time.

In a source checkout ``make`` (``python -m pdserve.engine.kernels``) compiles the C++
sources with torch's extension tooling into ``pdserve/engine/_kernels/``; an installed
package (a wheel, ``pip install .``) ships the sources and compiles them at first use
into pdserve's cache (``pdserve/cache.py``), one folder per fingerprint. A stamp beside
the library holds a hash of the sources, flags and torch version: ``load()`` imports
the library when the stamp matches, and otherwise compiles it first (once, under a
lock that concurrent workers wait on). ``available()`` says whether the fast CPU paths
can run here (x86-64 with AVX2 + FMA, the library built and current); when they
cannot (another CPU, no C++ compiler, a failed build), ``reason()`` says why and the
engine's ``auto`` backends use the plain-torch reference paths.
"""

from __future__ import annotations

import fcntl
import functools
import hashlib
import importlib.machinery
import importlib.util
import logging
import os
import platform
import shutil
import sys
from collections.abc import Callable
from pathlib import Path
from types import ModuleType

import torch

from pdserve.cache import cache_root

log = logging.getLogger("pdserve.engine")
NAME = "pdserve_kernels"
_SRC = Path(__file__).with_name("csrc")
# A source checkout (``make`` builds beside the sources) rather than an installed package.
_CHECKOUT = (Path(__file__).parents[2] / "pyproject.toml").is_file()
_SOURCES = ("bindings.cpp", "gemm.cpp", "amx.cpp", "quant_gemm.cpp", "w8a8.cpp", "attention.cpp",
            "attention_bf16.cpp", "pointwise.cpp", "decoder.cpp")
# -ffp-contract=off: a * b + c is never fused behind our back, so that the same
# source line rounds the same in every inlined or vectorised copy (batch invariance).
_CFLAGS = ("-O3", "-mavx2", "-mfma", "-mf16c", "-ffp-contract=off", "-fopenmp", "-std=c++17")

# The kernel families by name, fastest last: the dense ones that GEMM and attention
# run (``cpu-FAMILY`` backends: model/linear.py, model/attention.py) and the integer
# ones (int4, int8, W8A8; the same results on each, bit for bit). Their ids are the
# C++ enum's (csrc/families.h), read from the library: ``family_id``.
DENSE_FAMILIES = ("avx2", "avx512bf16", "amx")
INT_FAMILIES = ("avx2", "avx512vnni", "amx")

_module: ModuleType | None = None
_why: str | None = None


@functools.cache
def _fingerprint() -> str:
    h = hashlib.sha256()
    for f in sorted(_SRC.iterdir()):
        if f.suffix in (".cpp", ".h"):
            h.update(f.name.encode())
            h.update(f.read_bytes())
    h.update(" ".join(_CFLAGS).encode())
    h.update(torch.__version__.encode())
    return h.hexdigest()


def kernel_dir() -> Path:
    """Where the library is built and loaded from."""
    if _CHECKOUT:
        return Path(__file__).with_name("_kernels")
    return cache_root() / "kernels" / _fingerprint()[:16]


def _library() -> Path:
    return kernel_dir() / f"{NAME}.so"


def _current() -> bool:
    stamp = kernel_dir() / "stamp"
    return _library().is_file() and stamp.is_file() and stamp.read_text() == _fingerprint()


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
    """Compile the kernels (a no-op when the stamp is current). Concurrent callers, in
    any process, wait on a lock file and reuse the first one's work."""
    out = kernel_dir()
    out.mkdir(parents=True, exist_ok=True)
    # Released when the file closes, also if compiling raises. (Not "lock": torch's
    # extension builder waits for a file of that name to go.)
    with open(out / "build.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if _current():
            (out / "stamp").touch()  # current: tell make so
            return _library()
        _compile(out, verbose)
        (out / "stamp").write_text(_fingerprint())
    return _library()


def _compile(out: Path, verbose: bool) -> None:
    from torch.utils import cpp_extension

    try:  # the `ninja` wheel's binary, where the venv's bin/ is not on PATH
        import ninja

        os.environ["PATH"] = f"{ninja.BIN_DIR}{os.pathsep}{os.environ.get('PATH', '')}"
    except ImportError:
        pass
    cpp_extension.load(
        name=NAME,
        sources=[str(_SRC / s) for s in _SOURCES],
        extra_cflags=list(_CFLAGS),
        extra_ldflags=["-fopenmp"],
        build_directory=str(out),
        verbose=verbose,
    )


def _build_at_first_use() -> str | None:
    """Compile the kernels if they are missing or stale; None when done, else why not."""
    if _current():
        return None
    compiler = os.environ.get("CXX", "c++")
    if shutil.which(compiler) is None:
        return (f"the CPU kernels are not built and there is no C++ compiler ({compiler!r} "
                f"is not on PATH): install one (e.g. `apt-get install g++`) and run "
                f"`python -m pdserve.engine.kernels`")
    log.warning("pdserve: compiling the CPU kernels into %s (once per machine, pdserve and "
                "torch version; a minute or two)", kernel_dir())
    try:
        build()
    except Exception as exc:  # a compiler error, missing headers: fall back, loudly
        return f"the CPU kernels failed to compile ({str(exc).strip()[-2000:]})"
    return None


def load() -> ModuleType | None:
    """The kernels module, compiled first where needed, or None (see ``reason()``)."""
    global _module, _why
    if _module is not None or _why is not None:
        return _module
    why = cpu_supported()
    if why is None:
        why = _build_at_first_use()
        if why is not None:  # they could run here: say loudly that they do not
            log.warning("pdserve: %s; the engine falls back to its (much slower) reference "
                        "paths", why)
    if why is not None:
        _why = why
        return None
    loader = importlib.machinery.ExtensionFileLoader(NAME, str(_library()))
    spec = importlib.util.spec_from_file_location(NAME, _library(), loader=loader)
    assert spec is not None
    module = importlib.util.module_from_spec(spec)
    loader.exec_module(module)
    _module = module
    return module


def family_id(name: str) -> int:
    """The id the kernels take for family ``name`` (one of the tuples above)."""
    return int(require().FAMILY_IDS[name])


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
