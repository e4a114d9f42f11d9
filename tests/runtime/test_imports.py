"""No two modules of the runtime or the delegate import each other, directly or through others: the import graph
of `src/` (module-level and function-level imports, TYPE_CHECKING ones included) read with `ast`."""

import ast
from pathlib import Path

import networkx

SRC = Path(__file__).resolve().parents[2] / "src"


def import_graph() -> "networkx.DiGraph":
    modules = {}
    for path in SRC.rglob("*.py"):
        name = ".".join(path.relative_to(SRC).with_suffix("").parts).removesuffix(".__init__")
        modules[name] = path
    graph = networkx.DiGraph()
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
                    graph.add_edge(name, target)
    return graph


def test_the_runtime_and_the_delegate_import_no_module_that_imports_them_back():
    graph = import_graph()
    assert graph.has_edge("onecopy.runtime.program", "onecopy.runtime.method")  # the graph is read at all
    cycles = [sorted(c) for c in networkx.strongly_connected_components(graph) if len(c) > 1]
    ours = [c for c in cycles if any(m.startswith(("onecopy.runtime", "onecopy.delegate")) for m in c)]
    assert ours == []
