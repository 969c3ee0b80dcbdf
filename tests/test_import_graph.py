"""The package's import graph: no cycles (imports under TYPE_CHECKING and inside functions
included), nothing under p2ptrain/ imports from tests/, and no driver helper under
p2ptrain/net/ imports the runtime (only the CLI entry point does)."""

from __future__ import annotations

import ast
from pathlib import Path

import p2ptrain

PACKAGE = Path(p2ptrain.__file__).parent


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_graph() -> dict[str, set[str]]:
    """module -> the modules it names in any import statement (a `from pkg import name` counts
    as an import of pkg.name when that is a module, else of pkg)."""
    modules = {module_name(p): p for p in PACKAGE.rglob("*.py")}
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        is_pkg = path.name == "__init__.py"
        edges: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                edges |= {a.name for a in node.names}
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    anchor = name.split(".") if is_pkg else name.split(".")[:-1]
                    anchor = anchor[: len(anchor) - node.level + 1]
                    base = ".".join([*anchor, base] if base else anchor)
                for a in node.names:
                    sub = f"{base}.{a.name}"
                    edges.add(sub if sub in modules else base)
        graph[name] = {e for e in edges if e.split(".")[0] in ("p2ptrain", "tests")} - {name}
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(n: str) -> list[str] | None:
        state[n] = 1
        stack.append(n)
        for m in sorted(graph.get(n, ())):
            if state.get(m) == 1:
                return stack[stack.index(m):] + [m]
            if m not in state and (found := visit(m)):
                return found
        stack.pop()
        state[n] = 2
        return None

    for n in sorted(graph):
        if n not in state and (found := visit(n)):
            return found
    return None


def test_the_package_has_no_import_cycle():
    assert find_cycle(import_graph()) is None


def test_the_cycle_finder_finds_one():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


def test_the_package_never_imports_the_tests():
    graph = import_graph()
    assert len(graph) > 60
    bad = {m: sorted(e for e in edges if e.split(".")[0] == "tests") for m, edges in graph.items()}
    assert not {m: e for m, e in bad.items() if e}


def test_only_the_cli_imports_the_runtime():
    graph = import_graph()
    users = sorted(m for m, edges in graph.items() if "p2ptrain.net.runtime" in edges)
    assert all(m.startswith("p2ptrain.cli") for m in users), users


def test_drivers_import_the_protocol_through_its_surface():
    """net/ and sims/ use `p2ptrain.proto` (its __init__), never its inner modules."""
    roots = [PACKAGE / "net", PACKAGE.parent / "sims"]
    bad = []
    for path in (p for root in roots for p in root.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                     else [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            bad += [f"{path.name}: {n}" for n in names if n.startswith("p2ptrain.proto.")]
    assert not bad


def test_the_runtime_stays_small():
    lines = (PACKAGE / "net" / "runtime.py").read_text().count("\n")
    assert lines < 400, lines
