"""The packages follow the data flow: every import points down it, and nothing imports in a circle.

Order of the flow (a module may import its own layer and the layers before it):
base (errors, options, version) -> frontend -> cost -> planning -> runtime -> distributed (one process per
rank, on torch.distributed) -> refine -> the API
(``fxpipe.compile``, ``fxpipe.checks``, ``fxpipe.analytic``, the CLI, the package root). ``solvers`` is
torch-free and imports nothing of fxpipe. The runtime does not know the CPU-sharing model
(``fxpipe.cost.cpu``): it reaches it only through the host interface. Imports inside functions count;
``if TYPE_CHECKING:`` blocks do not count for the direction of the flow (they never run), but they do for
circles: a module typed against another that imports it is one design, not two layers.
"""

from __future__ import annotations

import ast
from pathlib import Path

import networkx as nx
import pytest

ROOT = Path(__file__).resolve().parent.parent
LAYERS = ["base", "frontend", "cost", "planning", "runtime", "distributed", "refine", "api"]
BASE = {"fxpipe._version", "fxpipe.errors", "fxpipe.options", "fxpipe.compression_spec"}


def _modules(package: str) -> dict[str, Path]:
    found = {}
    for path in sorted((ROOT / package).rglob("*.py")):
        parts = list(path.relative_to(ROOT).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        found[".".join(parts)] = path
    return found


MODULES = {**_modules("fxpipe"), **_modules("solvers")}


def _is_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _imports(path: Path, module: str, typed: bool = False) -> set[str]:
    """Every module (fxpipe, solvers or outside) that ``module`` imports where it runs (``typed``: and in
    its ``if TYPE_CHECKING:`` blocks)."""
    tree = ast.parse(path.read_text())
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    out: set[str] = set()

    def visit(node: ast.AST) -> None:
        if isinstance(node, ast.If) and _is_type_checking(node) and not typed:
            for child in node.orelse:
                visit(child)
            return
        if isinstance(node, ast.Import):
            out.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package.split(".")[: len(package.split(".")) - node.level + 1] + ([base] if base else []))
            for alias in node.names:   # `from pkg import module` imports the module, else the package
                out.add(f"{base}.{alias.name}" if f"{base}.{alias.name}" in MODULES else base)
        for child in ast.iter_child_nodes(node):
            visit(child)
    visit(tree)
    return out


def layer(module: str) -> int:
    if module in BASE:
        return LAYERS.index("base")
    parts = module.split(".")
    if len(parts) > 1 and parts[1] in LAYERS[1:-1]:
        return LAYERS.index(parts[1])
    return LAYERS.index("api")   # fxpipe itself, compile, checks, analytic, demo, __main__


def _graph(typed: bool = False) -> nx.DiGraph:
    graph = nx.DiGraph()
    for module, path in MODULES.items():
        graph.add_node(module)
        for target in _imports(path, module, typed):
            graph.add_edge(module, target)
    return graph


GRAPH = _graph()
TYPED_GRAPH = _graph(typed=True)


def test_the_walk_sees_the_imports_it_must():
    assert "fxpipe.planning.plan" in GRAPH.successors("fxpipe.runtime.execute.pipeline")
    assert "torch" in GRAPH.successors("fxpipe.runtime.execute.step")
    assert "solvers.dp" in GRAPH.successors("solvers.anchors")
    assert len([m for m in MODULES if m.startswith("fxpipe.")]) > 30


def test_no_module_imports_in_a_circle():
    project = TYPED_GRAPH.subgraph(MODULES)
    cycles = list(nx.simple_cycles(project))
    assert cycles == [], f"import cycles: {cycles}"


@pytest.mark.parametrize("module", sorted(m for m in MODULES if m.startswith("fxpipe")))
def test_imports_point_down_the_data_flow(module):
    upward = [t for t in GRAPH.successors(module) if t.startswith("fxpipe") and t in MODULES and layer(t) > layer(module)]
    assert upward == [], (f"{module} ({LAYERS[layer(module)]}) imports {upward} from later in the flow "
                          f"({[LAYERS[layer(t)] for t in upward]})")


@pytest.mark.parametrize("module", sorted(m for m in MODULES if m.startswith("solvers")))
def test_solvers_never_import_torch_or_fxpipe(module):
    bad = [t for t in GRAPH.successors(module) if t.split(".")[0] in ("torch", "fxpipe")]
    assert bad == [], f"{module} imports {bad}: solvers/ stays torch-free"


def test_the_runtime_does_not_know_the_cpu_sharing_model():
    runtime = [m for m in MODULES if m.startswith("fxpipe.runtime")]
    reach = {m: [t for t in GRAPH.successors(m) if t.startswith("fxpipe.cost.cpu")] for m in runtime}
    assert {m: t for m, t in reach.items() if t} == {}


def test_an_upward_import_is_caught(tmp_path):
    """The checks above can fail: a runtime module that imported the refine step would be upward."""
    assert layer("fxpipe.refine.rounds") > layer("fxpipe.runtime.execute.step")
    assert layer("fxpipe.errors") < layer("fxpipe.frontend.trace") < layer("fxpipe.cost.profile") \
        < layer("fxpipe.planning.plan") < layer("fxpipe.runtime.execute.pipeline") < layer("fxpipe.compile")
    fake = tmp_path / "step.py"
    fake.write_text("def f():\n    from fxpipe.refine.rounds import refine\n")
    assert "fxpipe.refine.rounds" in _imports(fake, "fxpipe.runtime.execute.step")
    hidden = tmp_path / "typed.py"
    hidden.write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from fxpipe.compile import compile\n")
    assert "fxpipe.compile" not in _imports(hidden, "fxpipe.runtime.typed")
    assert "fxpipe.compile" in _imports(hidden, "fxpipe.runtime.typed", typed=True)   # for circles it counts
