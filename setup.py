"""The one build step pyproject.toml cannot state: a wheel (or ``pip install .``) gets
the gRPC code generated from ``protos/`` at build time, so ``grpcio-tools`` is a build
dependency only. An editable install generates it in place on first use instead
(``pdserve/protos/__init__.py``)."""

import importlib.util
from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py

ROOT = Path(__file__).resolve().parent


class BuildPy(build_py):
    def run(self) -> None:
        super().run()
        if self.editable_mode:
            return
        # By path: importing the pdserve package would import its runtime dependencies.
        spec = importlib.util.spec_from_file_location(
            "pdserve_protos_build", ROOT / "pdserve" / "protos" / "build.py")
        assert spec is not None and spec.loader is not None
        protos = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(protos)
        protos.build(ROOT / "protos", Path(self.build_lib) / "pdserve" / "protos" / "gen")


setup(cmdclass={"build_py": BuildPy})
