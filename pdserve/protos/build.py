"""Generating Python code from the ``.proto`` files (``python -m pdserve.protos.build``).

This module owns the one protoc invocation of the project and the rule for when
it has to run again. Sources live in ``<repo>/protos/`` (e.g.
``protos/pdserve/v1/pdserve.proto``); output goes to ``pdserve/protos/gen/`` and is
never committed (its ``.gitignore`` ignores everything) and never edited.

Import paths: protoc writes the gRPC stub's import of its message module from the
proto's *virtual* path. We map the virtual directory ``pdserve/protos/gen`` onto
``protos/`` (``-Ipdserve/protos/gen=protos``), so ``pdserve/v1/pdserve.proto`` is
compiled as ``pdserve/protos/gen/pdserve/v1/pdserve.proto`` and the stub imports
``from pdserve.protos.gen.pdserve.v1 import pdserve_pb2`` — an importable package
path, with no patching of generated code. (The descriptor's file name carries the
same prefix; message and service names keep the proto package ``pdserve.v1``.)

Output is written to a temporary directory and moved into place file by file with
``os.replace``, so a process importing while another one builds never sees a
half-written module.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

PROTO_ROOT = Path(__file__).resolve().parents[2] / "protos"
GEN_DIR = Path(__file__).resolve().parent / "gen"
# The package that GEN_DIR is, as a path: the virtual root protoc compiles under.
GEN_VIRTUAL = "pdserve/protos/gen"
# Suffixes protoc writes per proto: messages, their type stubs, gRPC stubs.
_OUTPUT_SUFFIXES = ("_pb2.py", "_pb2.pyi", "_pb2_grpc.py")


def proto_files(proto_root: Path = PROTO_ROOT) -> list[Path]:
    """Every ``.proto`` under ``proto_root``, sorted."""
    return sorted(proto_root.rglob("*.proto"))


def outputs_for(proto: Path, proto_root: Path = PROTO_ROOT, gen_dir: Path = GEN_DIR) -> list[Path]:
    """The generated files for one proto (e.g. ``gen/pdserve/v1/pdserve_pb2.py``)."""
    rel = proto.relative_to(proto_root).with_suffix("")
    return [gen_dir / rel.parent / f"{rel.name}{suffix}" for suffix in _OUTPUT_SUFFIXES]


def needs_build(proto_root: Path = PROTO_ROOT, gen_dir: Path = GEN_DIR) -> bool:
    """True when a generated file is missing or older than its ``.proto``.

    Without a ``protos/`` directory (an installed wheel) the generated files that
    shipped are used as they are.
    """
    for proto in proto_files(proto_root):
        source_mtime = proto.stat().st_mtime
        for out in outputs_for(proto, proto_root, gen_dir):
            if not out.is_file() or out.stat().st_mtime < source_mtime:
                return True
    return False


def build(proto_root: Path = PROTO_ROOT, gen_dir: Path = GEN_DIR) -> list[Path]:
    """Run protoc over every proto in ``proto_root``; return the files written.

    Raises ``RuntimeError`` with protoc's exit status if compilation fails.
    """
    protos = proto_files(proto_root)
    if not protos:
        raise RuntimeError(f"no .proto files under {proto_root}")
    spec = importlib.util.find_spec("grpc_tools")  # build-time dependency only
    if spec is None or spec.origin is None:
        raise RuntimeError("grpc_tools is not installed (pip install grpcio-tools)")
    # grpc_tools ships the well-known types (google/protobuf/*.proto) beside itself.
    well_known = Path(spec.origin).resolve().parent / "_proto"
    gen_dir.mkdir(parents=True, exist_ok=True)
    written: list[Path] = []
    with tempfile.TemporaryDirectory(prefix=".build-", dir=gen_dir) as tmp:
        # protoc runs in a process of its own: its compiler extension links a
        # protobuf runtime of its own, which crashed a process that had already
        # loaded other protobuf-linked libraries (pyarrow, through lm-eval).
        args = [
            sys.executable,
            "-m",
            "grpc_tools.protoc",
            f"-I{GEN_VIRTUAL}={proto_root}",
            f"-I{well_known}",
            f"--python_out={tmp}",
            f"--pyi_out={tmp}",
            f"--grpc_python_out={tmp}",
            *(f"{GEN_VIRTUAL}/{p.relative_to(proto_root).as_posix()}" for p in protos),
        ]
        done = subprocess.run(args, capture_output=True, text=True, check=False)
        if done.returncode != 0:
            raise RuntimeError(
                f"protoc failed with exit status {done.returncode} (args: {args[3:]}): "
                f"{done.stderr.strip()}"
            )
        produced = Path(tmp) / GEN_VIRTUAL
        for src in sorted(produced.rglob("*")):
            if not src.is_file():
                continue
            dest = gen_dir / src.relative_to(produced)
            dest.parent.mkdir(parents=True, exist_ok=True)
            os.replace(src, dest)
            written.append(dest)
    _mark_packages(gen_dir, written)
    return written


def _mark_packages(gen_dir: Path, written: list[Path]) -> None:
    # Regular packages (not namespace ones) for every generated directory, so
    # mypy and setuptools' package discovery treat them like the rest of pdserve.
    for path in written:
        directory = path.parent
        while directory != gen_dir.parent:
            init = directory / "__init__.py"
            if not init.exists():
                init.touch()
            directory = directory.parent


def clean(gen_dir: Path = GEN_DIR) -> None:
    """Delete everything generated, keeping ``gen/.gitignore``."""
    if not gen_dir.is_dir():
        return
    for entry in gen_dir.iterdir():
        if entry.name == ".gitignore":
            continue
        if entry.is_dir():
            shutil.rmtree(entry)
        else:
            entry.unlink()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m pdserve.protos.build", description=__doc__.splitlines()[0]
    )
    parser.add_argument("--proto-root", type=Path, default=PROTO_ROOT)
    parser.add_argument("--out", type=Path, default=GEN_DIR, help="directory for the gen package")
    parser.add_argument("--clean", action="store_true", help="delete old output first")
    args = parser.parse_args(argv)
    if args.clean:
        clean(args.out)
    try:
        written = build(args.proto_root, args.out)
    except RuntimeError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    for path in written:
        print(path)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
