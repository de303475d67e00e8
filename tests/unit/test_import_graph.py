"""No import cycles inside torchpool, and the layers import downwards only.

The graph is read from the source with `ast` (nothing is imported): an edge
for every `import` / `from ... import` of a torchpool module, at module
level, inside functions and under TYPE_CHECKING alike, since a cycle through
a function-level import or a type hint still ties two modules together.
Importing `a.b.c` does not count as importing the package `a.b` here (Python
runs `a/b/__init__.py` first, but that is not a dependency of the importer).
"""
from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "torchpool"

# Cycles still expected, each to be deleted here once gone (the test fails
# on an unlisted cycle, and on a listed one that no longer exists). None are:
# the registry holds records and imports neither schedulers nor workers.
ALLOWED_CYCLES: list[frozenset[str]] = []


def allowed(cycle: frozenset[str]) -> bool:
    return cycle in ALLOWED_CYCLES


def module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def import_graph() -> dict[str, set[str]]:
    files = {module_name(p): p for p in PACKAGE.rglob("*.py")}
    graph: dict[str, set[str]] = {name: set() for name in files}
    for name, path in files.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            targets: list[str] = []
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base = package.split(".")
                    base = base[:len(base) - node.level + 1]
                    source = ".".join(base + ([node.module] if node.module else []))
                else:
                    source = node.module or ""
                targets = [f"{source}.{a.name}" if f"{source}.{a.name}" in files else source
                           for a in node.names]
            for target in targets:
                while target and target not in files:   # `import a.b.c` of a name inside a module
                    target = target.rpartition(".")[0]
                if target.startswith("torchpool") and target != name:
                    graph[name].add(target)
    return graph


def cycles(graph: dict[str, set[str]]) -> list[frozenset[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[frozenset[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = set()
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.add(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(frozenset(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_the_graph_is_read() -> None:
    graph = import_graph()
    assert "torchpool.logs" in graph["torchpool.worker.process"]
    assert "torchpool.protocol.internal" in graph["torchpool.worker.process"]
    assert "torchpool.broker.options" in graph["torchpool.cli"]
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [frozenset("abc")]


def test_no_import_cycles() -> None:
    found = cycles(import_graph())
    unexpected = [sorted(c) for c in found if not allowed(c)]
    assert not unexpected, f"import cycles: {unexpected}"
    gone = [sorted(c) for c in ALLOWED_CYCLES if c not in found]
    assert not gone, f"these cycles are gone: delete them from ALLOWED_CYCLES: {gone}"


def test_lower_layers_do_not_import_upper_ones() -> None:
    """The worker never imports the broker or the CLI; protocol/, shm/,
    config/ and logs import neither workers, broker, client nor CLI."""
    graph = import_graph()
    upper = {"worker": ("torchpool.broker", "torchpool.cli", "torchpool.client"),
             "protocol": ("torchpool.broker", "torchpool.worker", "torchpool.cli", "torchpool.client"),
             "config": ("torchpool.broker", "torchpool.worker", "torchpool.cli", "torchpool.client"),
             "shm": ("torchpool.broker", "torchpool.worker", "torchpool.cli", "torchpool.client"),
             "logs": ("torchpool.",)}
    wrong = sorted((m, t) for m, targets in graph.items() for t in targets
                   for layer, banned in upper.items()
                   if (m == f"torchpool.{layer}" or m.startswith(f"torchpool.{layer}."))
                   and t.startswith(banned))
    assert not wrong, wrong
