"""The shape of the package (STYLE.md, "The house"): no import cycles between its modules,
modules of about 400 lines at most, and no ddptrain import hidden inside a function unless a
comment says why it must be there (a cycle, an optional or heavy dependency kept out of
``import ddptrain``)."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "ddptrain"
MAX_LINES = 410  # "about 400"


def _modules() -> dict[str, Path]:
    found = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        found[name] = path
    return found


MODULES = _modules()


def _imported(module: str, node: ast.Import | ast.ImportFrom) -> list[str]:
    """The ddptrain modules an import statement in ``module`` loads (its own names resolved)."""
    if isinstance(node, ast.Import):
        names = [alias.name for alias in node.names]
    else:
        base = node.module or ""
        if node.level:
            package = module.split(".")
            if MODULES[module].name != "__init__.py":
                package = package[:-1]
            package = package[: len(package) - (node.level - 1)]
            base = ".".join(package + ([node.module] if node.module else []))
        names = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in MODULES else base for alias in node.names]
    found = []
    for name in names:
        while name and name not in MODULES:
            name = name.rpartition(".")[0]
        if name.startswith("ddptrain") and name != module:
            found.append(name)
    return found


def _top_level_imports(module: str, tree: ast.Module) -> set[str]:
    """Imports run when ``module`` is imported (``if TYPE_CHECKING:`` blocks excluded)."""
    deps: set[str] = set()
    for statement in tree.body:
        if isinstance(statement, ast.If) and "TYPE_CHECKING" in ast.unparse(statement.test):
            continue
        if isinstance(statement, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            continue
        for node in ast.walk(statement):
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                deps.update(_imported(module, node))
    return deps


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
        for other in graph.get(node, ()):
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


def test_no_import_cycles_between_modules() -> None:
    graph = {name: _top_level_imports(name, ast.parse(path.read_text())) for name, path in MODULES.items()}
    assert _cycles(graph) == []


def test_the_cycle_finder_finds_a_cycle() -> None:
    """The check above must be able to fail."""
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_modules_are_about_400_lines_at_most() -> None:
    long = {name: n for name, path in MODULES.items() if (n := len(path.read_text().splitlines())) > MAX_LINES}
    assert long == {}, f"split these along a real seam: {long}"


def test_ddptrain_imports_inside_functions_say_why() -> None:
    unexplained = []
    for name, path in MODULES.items():
        source = path.read_text()
        lines = source.splitlines()
        for function in ast.walk(ast.parse(source)):
            if not isinstance(function, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            for node in ast.walk(function):
                if not isinstance(node, (ast.Import, ast.ImportFrom)) or not _imported(name, node):
                    continue
                here, before = lines[node.lineno - 1], lines[node.lineno - 2]
                if "#" not in here and not before.strip().startswith("#"):
                    unexplained.append(f"{path.relative_to(PACKAGE.parent)}:{node.lineno}: {here.strip()}")
    assert unexplained == [], "import at module top, or comment why it cannot be:\n" + "\n".join(unexplained)
