"""The shape of the package (STYLE.md, "The house"; the README's map of the packages).

The import graph counts every ``import`` of a ddptrain module: at module level and inside
functions (a deferred import still ties two modules together), and ``import ddptrain`` as an
edge to the package root. Imports under ``if TYPE_CHECKING:`` are left out: they never run.
The implicit import of a parent package (importing ``ddptrain.driver.run`` runs
``ddptrain/__init__.py`` first) is left out too: the package root re-exports the public API,
so counting it would tie every module to every other.

Checked here: no import cycle at all; the direction between the packages that follow the
process roles; and a short list of deferred imports from the public API into the driver,
each with its reason. A module over about 400 lines is a warning, not a failure: split it
along a real seam when you touch it.
"""

from __future__ import annotations

import ast
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "ddptrain"
ADVISED_LINES = 400

# The packages that follow the process roles. Everything else (the package root, config,
# checkpoint, result, context, torch/, data/, tune/, the other trainers, util/sgd/) is "api".
ROLES = ("wire", "storage", "launch", "agent", "worker", "driver", "cli")
# What any role may use: the small modules of plain types and settings the API defines, and
# the one reader of /proc and prctl (standard library only).
TYPES = {
    "ddptrain._env",
    "ddptrain._proc",
    "ddptrain._version",
    "ddptrain.errors",
    "ddptrain.config",
    "ddptrain.checkpoint",
    "ddptrain.result",
}
MAY_IMPORT = {
    "wire": {"wire"},  # what travels: the standard library and cloudpickle, the types
    "storage": {"storage"},  # where results go: the types only
    "launch": {"launch", "wire"},  # starting agents: no run logic
    "agent": {"agent", "wire", "worker"},  # forks workers; never the driver
    "worker": {"worker", "wire", "storage", "api"},  # runs the user's function with the API
    "driver": {"driver", "wire", "storage", "launch", "api"},  # never agent or worker
    "cli": {"cli", "driver", "storage", "launch", "wire", "api"},
    "api": {"api", "wire", "storage", "launch"},  # the driver only through ALLOWED below
}
# Edges the rules above do not allow, each with its reason. Every one must still exist (a
# stale entry fails too), so the list stays as short as the code lets it be.
ALLOWED = {
    (
        "ddptrain.data_parallel_trainer",
        "ddptrain.driver.controller",
    ): "fit() runs the driver: imported when called",
    ("ddptrain.data_parallel_trainer", "ddptrain.driver.run"): "fit() runs the driver: imported when called",
    ("ddptrain.data_parallel_trainer", "ddptrain.driver.local_run"): "fit() with num_workers=0 runs here",
    ("ddptrain", "ddptrain.driver.warm"): "ddptrain.reuse_workers is public; warm.py imports nothing at load",
    ("ddptrain.progress", "ddptrain.driver.progress"): "the documented path of set_progress, quiet",
    ("ddptrain.worker_group", "ddptrain.driver.worker_group"): "the documented path of WorkerGroup",
    ("ddptrain.agent.main", "ddptrain.ray_compat"): "Ray's module names must exist before the agent unpickles",
    ("ddptrain.__main__", "ddptrain.cli.main"): "`python -m ddptrain` is the command line",
    (
        "ddptrain.storage.base",
        "ddptrain.wire.protocol",
    ): "RunStorage.spec makes the StorageSpec workers get (a message: standard library only)",
}
LAZY_ONLY = {  # of ALLOWED, these must stay deferred (inside a function)
    ("ddptrain.data_parallel_trainer", "ddptrain.driver.controller"),
    ("ddptrain.data_parallel_trainer", "ddptrain.driver.run"),
    ("ddptrain.data_parallel_trainer", "ddptrain.driver.local_run"),
}


def _modules() -> dict[str, Path]:
    found = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        found[name] = path
    return found


MODULES = _modules()


@dataclass(frozen=True)
class Edge:
    source: str
    target: str
    line: int
    deferred: bool  # inside a function


def _imported(module: str, node: ast.Import | ast.ImportFrom, modules: dict[str, Path]) -> list[str]:
    """The ddptrain modules an import statement in ``module`` loads (relative names resolved)."""
    if isinstance(node, ast.Import):
        names = [alias.name for alias in node.names]
    else:
        base = node.module or ""
        if node.level:
            package = module.split(".")
            if modules[module].name != "__init__.py":
                package = package[:-1]
            package = package[: len(package) - (node.level - 1)]
            base = ".".join(package + ([node.module] if node.module else []))
        names = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base for alias in node.names]
    found = []
    for name in names:
        while name and name not in modules:
            name = name.rpartition(".")[0]
        if name.startswith("ddptrain") and name != module:
            found.append(name)
    return found


def _edges(module: str, tree: ast.Module, modules: dict[str, Path]) -> Iterator[Edge]:
    def visit(node: ast.AST, deferred: bool) -> Iterator[Edge]:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and "TYPE_CHECKING" in ast.unparse(child.test):
                for statement in child.orelse:
                    yield from visit_one(statement, deferred)
                continue
            yield from visit_one(child, deferred)

    def visit_one(node: ast.AST, deferred: bool) -> Iterator[Edge]:
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            for target in dict.fromkeys(_imported(module, node, modules)):
                yield Edge(module, target, node.lineno, deferred)
        inside = deferred or isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
        yield from visit(node, inside)

    yield from visit(tree, False)


def import_graph(modules: dict[str, Path] = MODULES) -> list[Edge]:
    return [edge for name, path in modules.items() for edge in _edges(name, ast.parse(path.read_text()), modules)]


def role(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 and parts[1] in ROLES else "api"


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for other in sorted(graph.get(node, ())):
            if other not in index:
                visit(other)
                low[node] = min(low[node], low[other])
            elif other in on_stack:
                low[node] = min(low[node], index[other])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def _breaking_rules(edges: list[Edge]) -> list[Edge]:
    """Edges between roles that ``MAY_IMPORT`` does not allow (``TYPES`` are open to all)."""
    return [
        edge for edge in edges if edge.target not in TYPES and role(edge.target) not in MAY_IMPORT[role(edge.source)]
    ]


EDGES = import_graph()


def _where(edge: Edge) -> str:
    return f"{MODULES[edge.source].relative_to(PACKAGE.parent)}:{edge.line}: {edge.source} -> {edge.target}"


def test_no_import_cycles_counting_deferred_imports() -> None:
    graph: dict[str, set[str]] = {}
    for edge in EDGES:
        graph.setdefault(edge.source, set()).add(edge.target)
    cycles = _cycles(graph)
    detail = [_where(e) for e in EDGES if any(e.source in c and e.target in c for c in cycles)]
    assert cycles == [], "import cycles (break one edge of each):\n" + "\n".join(detail)


def test_the_cycle_finder_finds_a_cycle() -> None:
    """The check above must be able to fail."""
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_the_graph_sees_deferred_imports_the_root_and_not_type_checking(tmp_path: Path) -> None:
    """The graph builder must see what the rules are about: a deferred import, ``import
    ddptrain``, a relative import; and must skip ``if TYPE_CHECKING:`` blocks."""
    root = tmp_path / "ddptrain"
    (root / "driver").mkdir(parents=True)
    (root / "__init__.py").write_text("from ddptrain.data_parallel_trainer import X\n")
    (root / "data_parallel_trainer.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from ddptrain.driver import run\n"
        "def fit():\n    from ddptrain.driver.run import Run\n"
    )
    (root / "driver" / "__init__.py").write_text("")
    (root / "driver" / "run.py").write_text("import ddptrain\nfrom . import plan\n")
    (root / "driver" / "plan.py").write_text("")
    modules = {
        "ddptrain": root / "__init__.py",
        "ddptrain.data_parallel_trainer": root / "data_parallel_trainer.py",
        "ddptrain.driver": root / "driver" / "__init__.py",
        "ddptrain.driver.run": root / "driver" / "run.py",
        "ddptrain.driver.plan": root / "driver" / "plan.py",
    }
    edges = {(e.source, e.target, e.deferred) for e in import_graph(modules)}
    assert edges == {
        ("ddptrain", "ddptrain.data_parallel_trainer", False),
        ("ddptrain.data_parallel_trainer", "ddptrain.driver.run", True),
        ("ddptrain.driver.run", "ddptrain", False),
        ("ddptrain.driver.run", "ddptrain.driver.plan", False),
    }
    graph: dict[str, set[str]] = {}
    for source, target, _ in edges:
        graph.setdefault(source, set()).add(target)
    assert _cycles(graph) == [["ddptrain", "ddptrain.data_parallel_trainer", "ddptrain.driver.run"]]


def test_imports_go_one_way_between_the_process_roles() -> None:
    breaking = [e for e in _breaking_rules(EDGES) if (e.source, e.target) not in ALLOWED]
    assert breaking == [], "imports against the direction of the roles (README, 'The house'):\n" + "\n".join(
        _where(e) for e in breaking
    )


def test_the_rules_catch_an_import_against_the_direction() -> None:
    wrong = [
        Edge("ddptrain.driver.attempt", "ddptrain.worker.main", 1, False),  # the driver into a worker
        Edge("ddptrain.launch.ssh", "ddptrain.driver.logs", 1, False),  # a launcher into the driver
        Edge("ddptrain.wire.boot", "ddptrain", 1, False),  # the wire into the public API
        Edge("ddptrain.torch.torch_trainer", "ddptrain.driver.run", 1, True),  # a trainer into the driver
    ]
    right = [
        Edge("ddptrain.driver.run", "ddptrain.storage.layout", 1, False),
        Edge("ddptrain.agent.main", "ddptrain.worker.main", 1, True),
        Edge("ddptrain.storage.read", "ddptrain.errors", 1, False),
    ]
    assert _breaking_rules(wrong + right) == wrong


def test_each_exception_is_still_needed_and_stays_deferred_where_it_must() -> None:
    crossing = {(e.source, e.target) for e in _breaking_rules(EDGES)}
    stale = sorted(set(ALLOWED) - crossing)
    assert stale == [], f"remove these from ALLOWED, the code no longer needs them: {stale}"
    eager = [_where(e) for e in EDGES if (e.source, e.target) in LAZY_ONLY and not e.deferred]
    assert eager == [], "these must be imported inside the function that needs them:\n" + "\n".join(eager)


def test_the_roles_are_the_packages_on_disk() -> None:
    packages = {p.name for p in PACKAGE.iterdir() if (p / "__init__.py").is_file()}
    assert set(ROLES) <= packages


def test_modules_of_about_400_lines_at_most_advice() -> None:
    """Advice, not a rule: a long module is a warning in the test report."""
    long = {name: n for name, path in MODULES.items() if (n := len(path.read_text().splitlines())) > ADVISED_LINES}
    for name, lines in sorted(long.items()):
        warnings.warn(
            f"{name} has {lines} lines (about {ADVISED_LINES} advised): split it along a real seam", stacklevel=1
        )


def test_ddptrain_imports_inside_functions_say_why() -> None:
    unexplained = []
    for edge in EDGES:
        if not edge.deferred:
            continue
        lines = MODULES[edge.source].read_text().splitlines()
        here, before = lines[edge.line - 1], lines[edge.line - 2]
        if "#" not in here and not before.strip().startswith("#"):
            unexplained.append(f"{_where(edge)}: {here.strip()}")
    assert unexplained == [], "import at module top, or comment why it cannot be:\n" + "\n".join(unexplained)
