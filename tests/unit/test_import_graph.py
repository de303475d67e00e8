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


# The floors, lowest first: a module imports from its own floor or one below,
# never one above (the wire and shared memory know nothing of models; the
# rules know models, not who moves requests; commands sit on top). The
# package's __init__ (the public API and __version__) is read by every floor.
FLOORS: list[tuple[str, ...]] = [
    ("logs", "protocol", "shm"),          # the wire, memory, logging
    ("config",),                          # the model repository and its configs
    ("rules",),                           # what every path checks, batches and waits by
    ("client", "worker"),                 # who moves requests
    ("broker", "gateway"),                # the daemon's processes (the broker starts the gateway)
    ("perf", "cli", "examples", "__main__"),   # commands
]
SCRIPTS = PACKAGE.parent / "scripts"


def floor_of(module: str) -> int:
    """The floor of a torchpool module (the package itself: none, -1)."""
    parts = module.split(".")
    if len(parts) == 1:
        return -1
    for level, names in enumerate(FLOORS):
        if parts[1] in names:
            return level
    raise AssertionError(f"{module} is on no floor: add its package to FLOORS")


def upward_imports(graph: dict[str, set[str]]) -> list[tuple[str, str]]:
    return sorted((m, t) for m, targets in graph.items() for t in targets
                  if floor_of(t) > floor_of(m) >= 0)


def test_no_module_imports_from_a_floor_above_its_own() -> None:
    """Before the rules had a floor of their own there were three upward
    imports: protocol.validation -> config (the rules sat in the wire's
    package) and perf -> cli.errors, cli.urls (perf is a command)."""
    assert upward_imports({"torchpool.protocol.validation": {"torchpool.config"},
                           "torchpool.config.paths": {"torchpool.protocol.names"}}) == [
        ("torchpool.protocol.validation", "torchpool.config")]
    wrong = upward_imports(import_graph())
    assert not wrong, wrong


def test_the_rules_client_modules_load_nothing_of_the_servers() -> None:
    """The client applies rules.direct, rules.spin and rules.request: they
    (and the rules package itself) import only the wire and each other."""
    graph = import_graph()
    client_rules = {"torchpool.rules", "torchpool.rules.direct", "torchpool.rules.spin", "torchpool.rules.request"}
    for name in client_rules:
        assert {floor_of(t) for t in graph[name] - client_rules} <= {0}, (name, graph[name])


def private_imports() -> list[tuple[str, str]]:
    """(module, name) for each name starting with `_` a torchpool module
    imports from another torchpool module. A module named so (the C
    extensions: `from . import _bytescan`) is a module, not a private name."""
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        name = module_name(path)
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if not isinstance(node, ast.ImportFrom):
                continue
            if node.level:
                base = package.split(".")[:len(package.split(".")) - node.level + 1]
                source = ".".join(base + ([node.module] if node.module else []))
            else:
                source = node.module or ""
            if not source.startswith("torchpool") or source == name:
                continue
            folder = PACKAGE.parent.joinpath(*source.split("."))
            if not folder.is_dir():              # a module: what it imports lies beside it
                folder = folder.parent
            for alias in node.names:
                if alias.name.startswith("_") and not alias.name.startswith("__") \
                        and not any(folder.glob(f"{alias.name}.*")):
                    found.append((name, f"{source}.{alias.name}"))
    return found


def test_no_module_imports_another_modules_private_names() -> None:
    """A name starting with `_` is its module's own: what another module
    needs is public (worker.settings imported config.parameters._boolean; the
    client shm.arena._FreeList, outputs._Encoded, inputs._NeedRoom and
    channel._Waiter)."""
    assert not private_imports(), private_imports()


def script_imports() -> dict[str, set[str]]:
    """The torchpool modules each file in scripts/ imports."""
    found: dict[str, set[str]] = {}
    for path in sorted(SCRIPTS.glob("*.py")):
        names: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                names.update(a.name for a in node.names)
            elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
                names.add(node.module)
        found[path.name] = {n for n in names if n == "torchpool" or n.startswith("torchpool.")}
    return found


def test_scripts_use_the_public_api_and_the_commands() -> None:
    """scripts/ sit above every floor: they drive torchpool as its users do,
    through the package's public names, the client, the example models and
    the commands, not the daemon's insides."""
    public = ("torchpool", "torchpool.client", "torchpool.examples", "torchpool.cli", "torchpool.perf",
              "torchpool.protocol")
    wrong = {name: sorted(m for m in modules if not (m in public or m.startswith(tuple(p + "." for p in public))))
             for name, modules in script_imports().items()}
    wrong = {k: v for k, v in wrong.items() if v}
    assert not wrong, wrong


# What `pip install torchpool` (no extras) brings: setup.cfg's install_requires,
# by import name. Anything else the client imports when loaded would need the
# [server] extra (tests/unit/test_packaging.py installs it for real).
CLIENT_IMPORTS = {"numpy", "zmq", "msgpack", "posix_ipc"}


def imported_at_load(path: Path) -> set[str]:
    """Top-level names of the modules `path` imports when it is loaded: its
    module body and class bodies, not function bodies (a function may import
    torch when the caller hands it a torch tensor: torch is loaded already),
    nor `if TYPE_CHECKING:` blocks (only a type checker reads those)."""
    found: set[str] = set()
    todo: list[ast.AST] = [ast.parse(path.read_text(), str(path))]
    while todo:
        node = todo.pop()
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            continue
        if isinstance(node, ast.If) and _is_type_checking(node.test):
            todo.extend(node.orelse)
            continue
        if isinstance(node, ast.Import):
            found.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
            found.add(node.module.split(".")[0])
        todo.extend(ast.iter_child_nodes(node))
    return found


def _is_type_checking(test: ast.expr) -> bool:
    """`TYPE_CHECKING` or `typing.TYPE_CHECKING`."""
    return ((isinstance(test, ast.Name) and test.id == "TYPE_CHECKING")
            or (isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"))


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
    assert "typing_extensions" not in imported_at_load(PACKAGE / "protocol" / "lane.py")   # not a hint's
