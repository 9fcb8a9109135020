"""The package's layering, read from the source (every import, top-level or inside a
function): no import cycles among pdserve's modules; the engine imports nothing of
pdserve outside itself but leaf modules (which import nothing of pdserve), and no Ray;
the KV channels import neither the engine nor the workers, and their shared machinery
none of the backends; the workers import neither the router nor what deploys them; the
router imports neither torch, Ray nor the workers, and its core none of its front ends;
inside the engine, model/, sampling/ and tp/ import only a few named modules of the rest
(ARCHITECTURE.md)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent / "pdserve"


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def parse(path: Path) -> ast.Module:
    """``ast.parse``, again when CPython 3.11 says "AST constructor recursion depth
    mismatch": its AST builder's depth check misfires now and then in a process with
    other threads (python/cpython#106905; a clean-clone run of the suite hit it once)."""
    for _ in range(2):
        try:
            return ast.parse(path.read_text())
        except SystemError:
            continue
    return ast.parse(path.read_text())


def imports_of(path: Path) -> set[str]:
    """Every module name an import statement in ``path`` mentions (absolute)."""
    name = module_name(path)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out: set[str] = set()
    for node in ast.walk(parse(path)):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*up, base] if base else up)
            out.add(base)
            out.update(f"{base}.{a.name}" for a in node.names)
    return out


MODULES = {module_name(p): p for p in ROOT.rglob("*.py") if "gen" not in p.parts}


def graph() -> dict[str, set[str]]:
    """module -> the pdserve modules it imports (a name is cut back to a module)."""
    out: dict[str, set[str]] = {}
    for name, path in MODULES.items():
        deps = set()
        for imp in imports_of(path):
            while imp and imp not in MODULES:
                imp = imp.rpartition(".")[0]
            if imp and imp != name:
                deps.add(imp)
        out[name] = deps
    return out


def cycles(g: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in g[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                found.append(sorted(comp))

    for v in g:
        if v not in index:
            visit(v)
    return found


def test_the_walk_sees_the_package() -> None:
    g = graph()
    assert "pdserve.engine.engine" in g and "pdserve.router.orchestrator" in g
    assert "pdserve.engine.tp.lockstep" in g["pdserve.engine.engine"]  # edges are found
    assert "pdserve.worker.loop" in g["pdserve.worker.prefill"]


def test_no_import_cycles() -> None:
    assert cycles(graph()) == []


def test_a_cycle_is_found() -> None:
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


# Leaf modules every layer may import: they import nothing of pdserve themselves.
LEAVES = ("pdserve.kv_layout",  # the KV cache's shape: the engine's and the channels'
          "pdserve.cache")  # where pdserve keeps what it makes once (the kernels, the model)


def test_the_package_never_imports_the_benchmarks() -> None:
    """benchmarks/ does not ship in the wheel: nothing installed may need it."""
    bad = [f"{name} imports {imp}" for name, path in MODULES.items()
           for imp in imports_of(path) if imp == "benchmarks" or imp.startswith("benchmarks.")]
    assert bad == []


def test_leaves_import_nothing_of_pdserve() -> None:
    for leaf in LEAVES:
        assert not [imp for imp in imports_of(MODULES[leaf]) if imp.startswith("pdserve")]


# The router's front ends over its core (the modules directly in pdserve/router/),
# bottom up: what both share (api), the OpenAI shapes (openai), then the two servers.
FRONT_ENDS = ("pdserve.router.api", "pdserve.router.openai", "pdserve.router.http",
              "pdserve.router.grpc")


@pytest.mark.parametrize(("layer", "may_not"), [
    ("pdserve.engine", ("pdserve.", "ray")),  # only itself (checked below)
    ("pdserve.kv_transfer", ("pdserve.engine", "pdserve.worker", "pdserve.router",
                             "pdserve.cluster", "pdserve.cli", "pdserve.planner")),
    ("pdserve.worker", ("pdserve.router", "pdserve.cluster", "pdserve.cli",
                        "pdserve.planner")),
    ("pdserve.router", ("torch", "ray", "pdserve.cluster", "pdserve.cli",
                        "pdserve.kv_transfer", "pdserve.worker")),
    ("pdserve.planner", ("ray", "pdserve.cluster", "pdserve.cli", "pdserve.router",
                         "pdserve.worker")),
    # the simulator runs the router's core and the engine's scheduler, never a worker,
    # a transfer channel or a front end
    ("pdserve.sim", ("torch", "ray", "pdserve.worker", "pdserve.kv_transfer", "pdserve.cli",
                     *FRONT_ENDS)),
])
def test_layers_import_only_below_them(layer: str, may_not: tuple[str, ...]) -> None:
    bad = []
    for name, path in MODULES.items():
        if name != layer and not name.startswith(layer + "."):
            continue
        for imp in imports_of(path):
            if imp.startswith(layer) or imp.startswith(LEAVES):
                continue
            if any(imp == m.rstrip(".") or imp.startswith(m if m.endswith(".") else m + ".")
                   or imp == m for m in may_not):
                bad.append(f"{name} imports {imp}")
    assert bad == []


def test_the_kv_channels_machinery_imports_no_backend() -> None:
    """kv_transfer's shared modules (directly in the folder) never import a backend:
    the factory loads one by name, so a worker imports only its own backend."""
    layer = "pdserve.kv_transfer"
    bad = [f"{name} imports {imp}" for name, path in MODULES.items()
           if name.rpartition(".")[0] == layer or name == layer
           for imp in imports_of(path) if imp.startswith(layer + ".backends")]
    assert bad == []




@pytest.mark.parametrize(("layer", "may_not"), [
    ("pdserve.router", FRONT_ENDS),  # the core: its own modules only (checked below)
    ("pdserve.router.api", FRONT_ENDS[1:]),
    ("pdserve.router.openai", FRONT_ENDS[2:]),
    ("pdserve.router.http", ("pdserve.router.grpc",)),
    ("pdserve.router.grpc", ("pdserve.router.http",)),
])
def test_router_front_ends_sit_over_the_core(layer: str, may_not: tuple[str, ...]) -> None:
    def inside(name: str) -> bool:
        if layer == "pdserve.router":  # the core: the modules directly in the folder
            return name.rpartition(".")[0] == layer
        return name.startswith(layer + ".")

    bad = [f"{name} imports {imp}" for name, path in MODULES.items() if inside(name)
           for imp in imports_of(path) if any(imp == m or imp.startswith(m + ".") for m in may_not)]
    assert bad == []


# Inside the engine: the model and sampling sit under the scheduling core and speculation,
# and beside each other; of the rest of the engine each imports only these modules.
@pytest.mark.parametrize(("layer", "may"), [
    ("pdserve.engine.model", ("pdserve.engine.config", "pdserve.engine.defaults",
                              "pdserve.engine.kernels", "pdserve.engine.tp")),
    ("pdserve.engine.sampling", ("pdserve.engine.kernels", "pdserve.engine.tokenizer")),
    ("pdserve.engine.tp", ("pdserve.engine.config",)),
])
def test_engine_layers_import_only_their_leaves(layer: str, may: tuple[str, ...]) -> None:
    assert layer in MODULES  # a package that was moved or renamed fails here, not silently
    bad = [f"{name} imports {imp}" for name, path in MODULES.items()
           if name == layer or name.startswith(layer + ".")
           for imp in imports_of(path)
           if imp.startswith("pdserve.engine.") and imp != layer and not imp.startswith(layer + ".")
           and not any(imp == m or imp.startswith(m + ".") for m in may)]
    assert bad == []
