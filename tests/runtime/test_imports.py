"""No two modules of the runtime or the delegate import each other, directly or through others: the import graph
of `src/` (module-level and function-level imports, TYPE_CHECKING ones included) read with `ast`."""

import ast
from pathlib import Path

SRC = Path(__file__).resolve().parents[2] / "src"


def import_graph() -> dict[str, set[str]]:
    """Module -> the modules of `src/` it imports."""
    modules = {}
    for path in SRC.rglob("*.py"):
        name = ".".join(path.relative_to(SRC).with_suffix("").parts).removesuffix(".__init__")
        modules[name] = path
    graph: dict[str, set[str]] = {name: set() for name in modules}
    for name, path in modules.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    parts = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join(parts + ([base] if base else []))
                targets = [base] + [f"{base}.{alias.name}" for alias in node.names]
            else:
                continue
            for target in targets:
                if target in modules and target != name and not name.startswith(target + "."):
                    graph[name].add(target)
    return graph


def reaches(graph: dict[str, set[str]], start: str, goal: str) -> bool:
    seen, todo = set(), [start]
    while todo:
        module = todo.pop()
        if module == goal:
            return True
        if module not in seen:
            seen.add(module)
            todo.extend(graph[module])
    return False


def test_the_runtime_and_the_delegate_import_no_module_that_imports_them_back():
    graph = import_graph()
    assert "onecopy.runtime.method" in graph["onecopy.runtime.program"]  # the graph is read at all
    ours = [name for name in graph if name.startswith(("onecopy.runtime", "onecopy.delegate"))]
    in_cycles = sorted(name for name in ours if any(reaches(graph, imported, name) for imported in graph[name]))
    assert in_cycles == []
