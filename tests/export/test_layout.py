"""The tree is the architecture: export/ and program/ modules hold one job each, and no two modules import each
other (directly or around a circle). Imports are read with `ast`, at module level and inside functions alike."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[2] / "src"
PACKAGES = ("onecopy.export", "onecopy.program")
MAX_LINES = 400


def _modules() -> dict[str, Path]:
    modules = {}
    for path in (SRC / "onecopy").rglob("*.py"):
        parts = list(path.relative_to(SRC).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        modules[".".join(parts)] = path
    return modules


def _imports(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """The onecopy modules `name` imports anywhere in its body (a package's `__init__` it lives in excluded)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*up, base] if base else up)
            targets = [base, *(f"{base}.{a.name}" for a in node.names)]
        else:
            continue
        found.update(t for t in targets if t in modules and t != name and not name.startswith(f"{t}."))
    return found


def import_graph() -> dict[str, set[str]]:
    modules = _modules()
    return {name: _imports(name, path, modules) for name, path in modules.items()}


def import_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles = []
    for start in graph:
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, successors = work[-1]
            for nxt in successors:
                if nxt not in index:
                    index[nxt] = low[nxt] = len(index)
                    stack.append(nxt)
                    on_stack.add(nxt)
                    work.append((nxt, iter(sorted(graph[nxt]))))
                    break
                if nxt in on_stack:
                    low[node] = min(low[node], index[nxt])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    component = []
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        component.append(member)
                        if member == node:
                            break
                    if len(component) > 1:
                        cycles.append(sorted(component))
    return cycles


def _ours(name: str) -> bool:
    return any(name == p or name.startswith(f"{p}.") for p in PACKAGES)


def test_the_cycle_finder_finds_a_circle():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert import_cycles(graph) == [["a", "b", "c"]]
    assert import_cycles({"a": {"b"}, "b": set()}) == []


def test_no_export_or_program_module_is_in_an_import_cycle():
    cycles = [c for c in import_cycles(import_graph()) if any(_ours(m) for m in c)]
    assert cycles == []


def test_program_imports_nothing_of_onecopy_but_its_errors():
    # A device that loads `vmfb` programs reads the file format without torch, the compiler or any runtime.
    graph = import_graph()
    reached = {(m, d) for m, deps in graph.items() if m.startswith("onecopy.program") for d in deps
               if not d.startswith("onecopy.program") and d != "onecopy.errors"}
    assert reached == set()


@pytest.mark.parametrize("package", PACKAGES)
def test_modules_hold_one_job_each(package):
    long = {name: len(path.read_text().splitlines()) for name, path in _modules().items() if name.startswith(package)}
    assert {name: n for name, n in long.items() if n > MAX_LINES} == {}
