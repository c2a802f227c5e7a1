"""No import cycle between quantgate's top-level folders, nor between the modules of one folder.

Every import counts, also the ones inside functions and under TYPE_CHECKING: a lazy import is still a
dependency, and a cycle means two modules that cannot be understood (or tested) one without the other.
Read from the source with `ast`, nothing is imported; it takes well under a second.
"""

from __future__ import annotations

import ast
from collections.abc import Iterable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
FOLDERS = ("quantgate", "quantize", "serving", "evals", "gates", "flows", "fleet", "benchmarks")


def _modules() -> dict[str, Path]:
    mods = {}
    for folder in FOLDERS:
        for path in (ROOT / folder).rglob("*.py"):
            parts = path.relative_to(ROOT).with_suffix("").parts
            mods[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return mods


def _imported(tree: ast.AST, package: str, modules: dict[str, Path]) -> Iterable[str]:
    """What each import statement names: `from pkg import module` names the module (importing a package's
    module runs the package's __init__ too, but that is the package's business, not a dependency)."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            yield from (a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(up + ([base] if base else []))
            for alias in node.names:
                yield f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base


def import_graph() -> dict[str, set[str]]:
    """Module -> the quantgate modules it imports (a name resolves to the longest module it starts with)."""
    mods = _modules()

    def resolve(name: str) -> str | None:
        while name and name not in mods:
            name = name.rpartition(".")[0]
        return name or None

    graph: dict[str, set[str]] = {}
    for name, path in mods.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        targets = {resolve(t) for t in _imported(ast.parse(path.read_text()), package, mods)}
        graph[name] = {t for t in targets if t is not None and t != name}
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one node (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_the_detector_finds_a_cycle():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []
    graph = import_graph()
    assert "serving.core.scheduler" in graph["serving.core.engine"] and "quantgate.models" in graph["flows.release"]


def test_no_cycle_between_folders():
    graph = import_graph()
    folders: dict[str, set[str]] = {f: set() for f in FOLDERS}
    for module, targets in graph.items():
        folders[module.split(".")[0]] |= {t.split(".")[0] for t in targets} - {module.split(".")[0]}
    assert cycles(folders) == [], folders


def test_no_cycle_inside_a_folder():
    graph = import_graph()
    inside = {m: {t for t in ts if t.split(".")[0] == m.split(".")[0]} for m, ts in graph.items()}
    assert cycles(inside) == []


def test_the_release_never_imports_the_lab():
    """flows/ and gates/ drive servers through serving/loadgen; benchmarks/ may build on them, not the reverse."""
    graph = import_graph()
    reaching = {m: sorted(t for t in ts if t.startswith("benchmarks")) for m, ts in graph.items()
                if m.split(".")[0] in ("flows", "gates", "evals", "serving", "quantize", "quantgate")}
    assert {m: ts for m, ts in reaching.items() if ts} == {}


def _reaching(graph: dict[str, set[str]], source: str, targets: tuple[str, ...]) -> dict[str, list[str]]:
    found = {m: sorted(t for t in ts if t.split(".")[0] in targets) for m, ts in graph.items()
             if m.split(".")[0] == source}
    return {m: ts for m, ts in found.items() if ts}


def test_the_engine_imports_nothing_above_it():
    """serving/ holds the quantized layers, their kernels and the variant loader: the quantizer, the flows, the
    gates and the evals are built on it, never the reverse."""
    assert _reaching(import_graph(), "serving", ("quantize", "flows", "gates", "evals")) == {}


def test_the_foundation_imports_no_layer_above_it():
    graph = import_graph()
    above = ("quantize", "serving", "evals", "gates", "flows", "fleet", "benchmarks")
    assert _reaching(graph, "quantgate", above) == {}


def test_gates_rooms_depend_one_way():
    """judging (pure verdicts) <- records (MLflow) <- evidence (the bundle); the CLIs sit at the edge."""
    graph = import_graph()

    def room(module: str) -> str:
        return module.split(".")[1] if module.startswith("gates.") and module.count(".") >= 2 else ""

    up = {m: sorted(t for t in ts if room(t) in ("records", "evidence")) for m, ts in graph.items()
          if room(m) == "judging"}
    assert {m: ts for m, ts in up.items() if ts} == {}
    up = {m: sorted(t for t in ts if room(t) == "evidence") for m, ts in graph.items() if room(m) == "records"}
    assert {m: ts for m, ts in up.items() if ts} == {}
