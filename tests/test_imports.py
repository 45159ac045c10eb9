"""The import graph of jspec/: no circles, and the library below the compiled loops never reaches up into
the API, the CLI or the benchmarks. Read from the source (every import statement, at any depth of a
module), so an import inside a function counts as much as one at the top."""

from __future__ import annotations

import ast
import os

import jspec

ROOT = os.path.dirname(os.path.abspath(jspec.__file__))
# The compiled loops and everything they are built from: none of it may import the layers above.
LIBRARY = ("jspec.models", "jspec.verify", "jspec.kernels", "jspec.io", "jspec.drafters", "jspec.decode",
           "jspec.platform", "jspec.parallel")
ABOVE = ("jspec.api", "jspec.cli", "jspec.bench", "jspec.benchmarks", "jspec.aot")


def _modules() -> dict[str, str]:
    out = {}
    for folder, _, files in os.walk(ROOT):
        for f in files:
            if f.endswith(".py"):
                path = os.path.join(folder, f)
                name = os.path.relpath(path, os.path.dirname(ROOT))[:-3].replace(os.sep, ".")
                out[name.removesuffix(".__init__")] = path
    return out


def import_graph() -> dict[str, set[str]]:
    """module -> the jspec modules it imports. `from a.b import c` names a.b.c when that is a module, else
    a.b; a package's __init__ counts only when it is imported itself (not for its submodules)."""
    mods = _modules()
    graph = {}
    for name, path in mods.items():
        package = name if path.endswith("__init__.py") else name.rsplit(".", 1)[0]
        deps = set()
        for node in ast.walk(ast.parse(open(path).read(), path)):
            if isinstance(node, ast.Import):
                deps.update(a.name for a in node.names)
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    parts = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join(parts + ([node.module] if node.module else []))
                deps.update(f"{base}.{a.name}" if f"{base}.{a.name}" in mods else base for a in node.names)
        graph[name] = {d for d in deps if d in mods and d != name}
    return graph


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan, iterative)."""
    index, low, on_stack, stack, out = {}, {}, set(), [], []
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            v, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[v] = min(low[v], index[child])
                continue
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
                    out.append(sorted(comp))
    return out


def _under(name: str, prefixes) -> bool:
    return any(name == p or name.startswith(p + ".") for p in prefixes)


def test_the_circle_finder_finds_circles():
    assert circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert circles({"a": {"b"}, "b": set()}) == []


def test_no_import_circles():
    assert circles(import_graph()) == []


def test_the_library_does_not_import_the_layers_above():
    graph = import_graph()
    bad = {m: sorted(d for d in deps if _under(d, ABOVE) or d == "jspec")
           for m, deps in graph.items() if _under(m, LIBRARY) and m != "jspec.parallel.__main__"}
    assert {m: d for m, d in bad.items() if d} == {}
