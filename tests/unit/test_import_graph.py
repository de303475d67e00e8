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
import sys
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


# What `pip install torchpool` (no extras) brings: setup.cfg's install_requires,
# by import name. Anything else the client imports when loaded would need the
# [server] extra (tests/unit/test_packaging.py installs it for real).
CLIENT_IMPORTS = {"numpy", "zmq", "msgpack", "posix_ipc"}


def imported_at_load(path: Path) -> set[str]:
    """Top-level names of the modules `path` imports when it is loaded: its
    module body and class bodies, not function bodies (a function may import
    torch when the caller hands it a torch tensor: torch is loaded already)."""
    found: set[str] = set()
    todo: list[ast.AST] = [ast.parse(path.read_text(), str(path))]
    while todo:
        node = todo.pop()
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            continue
        if isinstance(node, ast.Import):
            found.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
            found.add(node.module.split(".")[0])
        todo.extend(ast.iter_child_nodes(node))
    return found


def client_modules(graph: dict[str, set[str]]) -> set[str]:
    """torchpool and torchpool.client with every torchpool module they reach."""
    seen: set[str] = set()
    todo = ["torchpool", "torchpool.client"]
    while todo:
        name = todo.pop()
        if name not in seen:
            seen.add(name)
            todo.extend(graph[name])
    return seen


def test_the_client_loads_only_its_own_dependencies() -> None:
    """`import torchpool.client` needs numpy, pyzmq, msgpack and posix_ipc and
    nothing of the server's (torch, the gateways' grpc/httptools/uvloop)."""
    graph = import_graph()
    modules = client_modules(graph)
    server_side = ("broker", "worker", "gateway", "cli", "config", "perf")
    assert not {m for m in modules for layer in server_side
                if m == f"torchpool.{layer}" or m.startswith(f"torchpool.{layer}.")}, sorted(modules)
    wrong = {}
    for name in sorted(modules):
        path = PACKAGE.parent.joinpath(*name.split("."))
        path = path / "__init__.py" if path.is_dir() else path.with_suffix(".py")
        third_party = imported_at_load(path) - set(sys.stdlib_module_names) - {"torchpool"}
        if third_party - CLIENT_IMPORTS:
            wrong[name] = sorted(third_party - CLIENT_IMPORTS)
    assert not wrong, f"client modules importing what a client install lacks: {wrong}"
    assert imported_at_load(PACKAGE / "client" / "values.py") >= {"numpy"}   # the walk sees imports
