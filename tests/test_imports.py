"""The module graph of runner/: no import cycle (imports inside functions count too), and one module that
reads the command line (sys.argv).

Edges come from the import statements themselves (ast), so an import hidden in a function body, or a module
named by a string in the CLI's command table, is an edge like any other. `from pkg import name` is an edge to
pkg.name when that is a module (a submodule import), else to pkg. A package's own __init__ is not counted
as imported by its submodules: Python runs it first whatever they import, and a package re-exporting its
submodules is the usual shape, not a cycle."""
from __future__ import annotations

import ast
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "runner"
# the job layer: the one place that turns a command line into work
ARGV_READERS = {"runner.jobs.argv"}
# modules built from C++ (setup.py), not .py files: importable by their (private-looking) names
EXTENSION_MODULES = {"runner._C"}
# private names still used across modules; each is to be made public where it is defined
PRIVATE_USES_LEFT = {"runner.finetune: from runner.layers import _Approx",
                     "runner.finetune: from runner.layers import _FakeQuant"}


def runner_modules() -> dict[str, pathlib.Path]:
    mods = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        name = ".".join(path.relative_to(ROOT).with_suffix("").parts)
        mods[name.removesuffix(".__init__")] = path
    return mods


def _owning_module(target: str, mods) -> str | None:
    while target and target not in mods:
        target = target.rpartition(".")[0]
    return target or None


def _string_modules(tree: ast.AST, mods) -> set[str]:
    """Module paths written as strings, alone or as "module:function" (the CLI's command table imports its
    entry points by name)."""
    return {n.value.partition(":")[0] for n in ast.walk(tree)
            if isinstance(n, ast.Constant) and isinstance(n.value, str) and "." in n.value
            and n.value.partition(":")[0] in mods}


def import_graph(mods: dict[str, pathlib.Path]) -> dict[str, set[str]]:
    graph = {m: set() for m in mods}
    for mod, path in mods.items():
        package = mod if path.name == "__init__.py" else mod.rpartition(".")[0]
        tree = ast.parse(path.read_text(), str(path))
        targets: set[str] = set()
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                targets |= {a.name for a in node.names}
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    parts = package.split(".")
                    parts = parts[: len(parts) - node.level + 1]
                    base = ".".join(parts + ([base] if base else []))
                for alias in node.names:
                    sub = f"{base}.{alias.name}"
                    targets.add(sub if sub in mods else base)
        targets |= _string_modules(tree, mods)
        for target in targets:
            owner = _owning_module(target, mods)
            if owner and owner != mod and not mod.startswith(owner + "."):
                graph[mod].add(owner)
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan, iterative)."""
    index, low, on_stack, stack, found = {}, {}, set(), [], []
    counter = 0
    for start in graph:
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = counter
        counter += 1
        stack.append(start)
        on_stack.add(start)
        while work:
            v, children = work[-1]
            for w in children:
                if w not in index:
                    index[w] = low[w] = counter
                    counter += 1
                    stack.append(w)
                    on_stack.add(w)
                    work.append((w, iter(sorted(graph[w]))))
                    break
                if w in on_stack:
                    low[v] = min(low[v], index[w])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[v])
                if low[v] == index[v]:
                    comp = []
                    while True:
                        w = stack.pop()
                        on_stack.discard(w)
                        comp.append(w)
                        if w == v:
                            break
                    if len(comp) > 1:
                        found.append(sorted(comp))
    return found


def test_cycle_finder_can_fail():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_import_graph_sees_function_level_and_string_imports():
    graph = import_graph(runner_modules())
    assert "runner.sweep" in graph["runner.cli"]  # named only as a string in the command table
    assert "runner.compare" in graph["runner.jobs.run"]  # imported inside functions only


def test_no_import_cycle_among_runner_modules():
    found = cycles(import_graph(runner_modules()))
    assert not found, "import cycles (function-level imports included): " + "; ".join(map(" <-> ".join, found))


def test_only_the_job_layer_reads_sys_argv():
    readers = []
    for mod, path in runner_modules().items():
        tree = ast.parse(path.read_text())
        if any(isinstance(n, ast.Attribute) and n.attr == "argv" and isinstance(n.value, ast.Name)
               and n.value.id == "sys" for n in ast.walk(tree)) or "argv" in {
                   a.name for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module == "sys"
                   for a in n.names}:
            readers.append(mod)
    assert set(readers) <= ARGV_READERS, f"sys.argv read outside the job layer: {sorted(set(readers) - ARGV_READERS)}"
    assert readers, "the job layer reads the command line"


@pytest.mark.parametrize("path", sorted(p for p in PACKAGE.rglob("*.py")), ids=lambda p: str(p.relative_to(ROOT)))
def test_no_source_file_over_600_lines(path):
    assert len(path.read_text().splitlines()) <= 600


def _private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def private_uses(mods: dict[str, pathlib.Path]) -> list[str]:
    """`from runner.x import _name` and `x._name` on a runner module bound by an import, in another runner
    module: a private helper used across modules should be public (or live where it is used). Private module
    names (runner._C, runner._ext) are modules, not helpers, and count as public here."""
    found = []
    for mod, path in mods.items():
        package = mod if path.name == "__init__.py" else mod.rpartition(".")[0]
        tree = ast.parse(path.read_text(), str(path))
        bound: dict[str, str] = {}  # local name -> runner module it names
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                for a in node.names:
                    if a.name in mods and a.asname:
                        bound[a.asname] = a.name
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    parts = package.split(".")
                    base = ".".join(parts[: len(parts) - node.level + 1] + ([base] if base else []))
                for a in node.names:
                    if f"{base}.{a.name}" in mods or f"{base}.{a.name}" in EXTENSION_MODULES:
                        bound[a.asname or a.name] = f"{base}.{a.name}"
                    elif base in mods and base != mod and _private(a.name):
                        found.append(f"{mod}: from {base} import {a.name}")
        for node in ast.walk(tree):
            if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in bound
                    and bound[node.value.id] != mod and _private(node.attr)):
                found.append(f"{mod}: {node.value.id}.{node.attr}")
    return sorted(set(found))


def test_private_use_finder_can_fail(tmp_path):
    (tmp_path / "runner").mkdir()
    (tmp_path / "runner" / "a.py").write_text("def _helper(): pass\n")
    (tmp_path / "runner" / "b.py").write_text("from runner.a import _helper\nfrom runner import a\na._helper()\n")
    mods = {"runner.a": tmp_path / "runner" / "a.py", "runner.b": tmp_path / "runner" / "b.py"}
    assert private_uses(mods) == ["runner.b: a._helper", "runner.b: from runner.a import _helper"]


def test_no_private_name_used_across_runner_modules():
    found = set(private_uses(runner_modules())) - PRIVATE_USES_LEFT
    assert not found, "private names used from another module: " + "; ".join(sorted(found))
