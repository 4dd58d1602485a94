"""The project's import graph, read from the source with ast: no import circles, and the layering
of the developers' guide (`tir_kernels` knows nothing of `tvmattn`; `tvmattn.runtime` nothing of
the models, their compilation or what runs them).

Every import statement counts, lazy ones inside functions included, with relative imports
resolved. A package's `__init__.py` is left out of the circle checks (as the project's
before-stop hook does): it imports its modules to re-export them, so any module importing a name
from its package would close a circle through it. The layering checks read `__init__.py` too.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("tvmattn", "tir_kernels")

# what tvmattn.runtime must not import: the model libraries, their compilation, and what runs them
ABOVE_RUNTIME = ("tvmattn.models", "tvmattn.compiler", "tvmattn.quant", "tvmattn.build", "tvmattn.session", "tvmattn.generate",
                 "tvmattn.serve", "tvmattn.quickstart", "tvmattn.speculative", "tvmattn.__main__")


def module_files(root: Path, packages) -> dict[str, Path]:
    """Dotted module name -> file, for every .py under the packages (a package's own file is
    named `<package>.__init__`)."""
    return {".".join(path.relative_to(root).with_suffix("").parts): path
            for package in packages for path in sorted((root / package).rglob("*.py"))}


def imported_names(module: str, path: Path) -> set[str]:
    """The absolute names the module's import statements (anywhere in it) name: for
    `from p import a`, both p and p.a (a may be a module or a name in p)."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # relative to the module's package (`<package>.__init__` drops its last part too)
                base = ".".join(module.split(".")[:-node.level] + ([node.module] if node.module else []))
            else:
                base = node.module
            names.add(base)
            names.update(f"{base}.{alias.name}" for alias in node.names)
    return names


def import_graph(root: Path, packages) -> dict[str, set[str]]:
    """Module -> the modules of the packages it imports (package `__init__`s left out)."""
    files = module_files(root, packages)
    graph = {m: set() for m in files if not m.endswith(".__init__")}
    for module in graph:
        for name in imported_names(module, files[module]):
            while name and name not in files:  # p.a where a is a name in module p: p
                name = name.rpartition(".")[0]
            if name in graph and name != module:
                graph[module].add(name)
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's, iterative), sorted."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, successors = work[-1]
            for succ in successors:
                if succ not in index:
                    index[succ] = low[succ] = len(index)
                    stack.append(succ)
                    on_stack.add(succ)
                    work.append((succ, iter(sorted(graph[succ]))))
                    break
                if succ in on_stack:
                    low[node] = min(low[node], index[succ])
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
                        found.append(sorted(component))
    return sorted(found)


def package_graph(graph: dict[str, set[str]]) -> dict[str, set[str]]:
    """The graph between subpackages: every module of `p.q.*` counted as `p.q` (a top-level
    module such as tvmattn.build stays itself)."""
    def package(module):
        return ".".join(module.split(".")[:2])

    out = {package(m): set() for m in graph}
    for module, targets in graph.items():
        out[package(module)].update(package(t) for t in targets if package(t) != package(module))
    return out


def describe(graph: dict[str, set[str]], component: list[str]) -> str:
    edges = [f"    {a} -> {b}" for a in component for b in sorted(graph[a]) if b in component]
    return "import circle among " + ", ".join(component) + ":\n" + "\n".join(edges)


def offending_imports(root: Path, package_dir: str, forbidden) -> list[str]:
    """`module: name` for every import under root/package_dir (its __init__ files too) of a name
    in or below one of `forbidden`."""
    top = package_dir.split("/")[0]
    files = {m: p for m, p in module_files(root, [top]).items() if p.is_relative_to(root / package_dir)}
    return sorted(f"{module}: {name}" for module, path in files.items() for name in imported_names(module, path)
                  if any(name == f or name.startswith(f + ".") for f in forbidden))


# ---------------------------------------------------------------------------- the project


def test_no_import_circles():
    graph = import_graph(ROOT, PACKAGES)
    found = cycles(graph)
    assert not found, "\n".join(describe(graph, component) for component in found)


def test_no_circles_between_subpackages():
    """A subpackage sits wholly above or below another (tvmattn.flashinfer below tvmattn.runtime,
    tvmattn.quant below tvmattn.models, ...), not with some modules on each side. (tir_kernels
    has no subpackages: test_no_import_circles covers it.)"""
    graph = package_graph(import_graph(ROOT, ["tvmattn"]))
    found = cycles(graph)
    assert not found, "\n".join(describe(graph, component) for component in found)


def test_tir_kernels_never_imports_tvmattn():
    bad = offending_imports(ROOT, "tir_kernels", ["tvmattn"])
    assert not bad, "tir_kernels imports tvmattn:\n" + "\n".join(bad)


def test_runtime_imports_nothing_above_it():
    bad = offending_imports(ROOT, "tvmattn/runtime", ABOVE_RUNTIME)
    assert not bad, "tvmattn.runtime imports the layers above it:\n" + "\n".join(bad)


def test_the_graph_covers_every_module():
    graph = import_graph(ROOT, PACKAGES)
    files = module_files(ROOT, PACKAGES)
    assert set(graph) == {m for m in files if not m.endswith(".__init__")}
    assert {"tvmattn.models.llama", "tvmattn.runtime.cache", "tir_kernels.support"} <= set(graph)
    assert sum(map(len, graph.values())) > len(graph)  # modules do import each other


# ---------------------------------------------------------------------------- the checker itself


def _tree(tmp_path: Path, files: dict[str, str]) -> Path:
    for name, text in files.items():
        path = tmp_path / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return tmp_path


@pytest.mark.parametrize("x_imports, found", [
    ("from . import y", [["a.b.x", "a.b.y"]]),                   # relative, a module
    ("from .y import g", [["a.b.x", "a.b.y"]]),                  # relative, a name in a module
    ("import a.b.y", [["a.b.x", "a.b.y"]]),                      # absolute
    ("def f():\n    from a.b.y import g", [["a.b.x", "a.b.y"]]),  # lazy, inside a function
    ("from .. import top", [["a.b.x", "a.b.y", "a.top"]]),        # two levels up: x -> top -> y -> x
    ("from .c.deep import h", [["a.b.c.deep", "a.b.x"]]),         # into a subpackage and back
    ("from .. import b", []),                                    # a package's __init__: left out
    ("import os", []),                                           # outside the packages
])
def test_a_circle_is_found_however_it_is_imported(tmp_path, x_imports, found):
    root = _tree(tmp_path, {
        "a/__init__.py": "from .b.x import *\n",
        "a/b/__init__.py": "from .x import *\nfrom .y import *\n",  # a package importing its modules
        "a/b/x.py": x_imports + "\n",
        "a/b/y.py": "from .x import *\ndef g(): pass\n",
        "a/top.py": "import a.b.y\n",
        "a/b/c/__init__.py": "",
        "a/b/c/deep.py": "from a.b.x import *\nh = 1\n",
    })
    assert cycles(import_graph(root, ["a"])) == found


def test_a_circle_between_subpackages_is_found(tmp_path):
    root = _tree(tmp_path, {
        "a/__init__.py": "",
        "a/low/__init__.py": "",
        "a/low/x.py": "from a.high.y import g\n",   # the low package's one module above the other
        "a/low/z.py": "z = 1\n",
        "a/high/__init__.py": "",
        "a/high/y.py": "from a.low.z import z\ndef g(): pass\n",
    })
    graph = import_graph(root, ["a"])
    assert cycles(graph) == []
    assert cycles(package_graph(graph)) == [["a.high", "a.low"]]


def test_a_layering_violation_is_found(tmp_path):
    root = _tree(tmp_path, {
        "t/__init__.py": "from . import runtime\n",
        "t/build.py": "",
        "t/weights/__init__.py": "",
        "t/models/__init__.py": "",
        "t/runtime/__init__.py": "from .. import build\n",
        "t/runtime/cache.py": "from ..weights import w\nimport t.models.llama\ndef f():\n    from t import build\n",
    })
    assert offending_imports(root, "t/runtime", ["t.models", "t.build"]) == [
        "t.runtime.__init__: t.build", "t.runtime.cache: t.build", "t.runtime.cache: t.models.llama"]
    assert offending_imports(root, "t/weights", ["t.models", "t.build"]) == []


def test_a_tree_without_circles_passes(tmp_path):
    root = _tree(tmp_path, {
        "a/__init__.py": "from .x import *\n",
        "a/x.py": "from .y import g\nimport os\n",
        "a/y.py": "def g():\n    from a.z import c\n",
        "a/z.py": "c = 1\n",
    })
    graph = import_graph(root, ["a"])
    assert graph == {"a.x": {"a.y"}, "a.y": {"a.z"}, "a.z": set()}
    assert cycles(graph) == []
