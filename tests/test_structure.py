"""The shape of the source tree: limits the developers' guide sets, checked from the code."""

import ast
import pathlib
import subprocess
import sys

from harness import project_env

ROOT = pathlib.Path(__file__).resolve().parent.parent
KERNELS = ROOT / "tir_kernels"
MAX_FUNCTION_LINES = 200


def function_lengths(path: pathlib.Path):
    """[(name, first line, lines)] of every function in a file, nested ones included: a def
    counts from its `def` line to its last line (its nested defs count inside it too)."""
    tree = ast.parse(path.read_text(), filename=str(path))
    return [(node.name, node.lineno, node.end_lineno - node.lineno + 1) for node in ast.walk(tree)
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))]


def test_function_lengths_are_measured_with_nested_defs(tmp_path):
    """The measure itself: a parent counts its nested def's lines; decorators do not count."""
    source = "@decorator\ndef outer():\n    x = 1\n\n    def inner():\n        return 2\n\n    return inner\n"
    path = tmp_path / "sample.py"
    path.write_text(source)
    assert sorted(function_lengths(path)) == [("inner", 5, 2), ("outer", 2, 7)]


def test_no_function_in_tir_kernels_over_200_lines():
    """No function (nested definitions included) in tir_kernels/ is over 200 lines."""
    files = sorted(KERNELS.glob("*.py"))
    assert files, "tir_kernels/ has no Python files"
    long = [f"{path.name}:{line} {name} ({lines} lines)" for path in files
            for name, line, lines in function_lengths(path) if lines > MAX_FUNCTION_LINES]
    assert not long, f"functions over {MAX_FUNCTION_LINES} lines: {long}"


def kernel_imports(path: pathlib.Path) -> set:
    """The tir_kernels modules (and outside packages of this project) a module imports, at any
    depth of its code (function-level imports included)."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.ImportFrom):
            if node.level == 1:
                names = [node.module] if node.module else [alias.name for alias in node.names]
                out |= {name.split(".")[0] for name in names}
            elif node.level == 0 and node.module:
                out.add(node.module)
        elif isinstance(node, ast.Import):
            out |= {alias.name for alias in node.names}
    return out


def test_tir_kernels_imports_form_no_cycle_and_never_reach_tvmattn():
    """A module of tir_kernels imports only modules below it: the graph of its imports of its
    siblings has no cycle, and nothing in tir_kernels imports tvmattn."""
    modules = {path.stem: path for path in KERNELS.glob("*.py") if path.stem != "__init__"}
    graph = {}
    for name, path in modules.items():
        imports = kernel_imports(path)
        outside = sorted(i for i in imports if i == "tvmattn" or i.startswith("tvmattn."))
        assert not outside, f"tir_kernels/{name}.py imports {outside}"
        graph[name] = {i for i in imports if i in modules}
    done, path = set(), []

    def visit(name):
        if name in path:
            cycle = path[path.index(name):] + [name]
            raise AssertionError(f"import cycle: {' -> '.join(cycle)}")
        if name in done:
            return
        path.append(name)
        for dep in sorted(graph[name]):
            visit(dep)
        path.pop()
        done.add(name)

    for name in sorted(graph):
        visit(name)


def test_loading_the_build_submodule_keeps_the_build_function():
    """`tir_kernels.build` is the compile function even where the submodule of that name was
    loaded first (as the kernels that import its constants, and `import tir_kernels.build`, do):
    the import system binds a loaded submodule on its package, which must not hide the export."""
    code = ("import tir_kernels, tir_kernels.build, tir_kernels.prefill\n"
            "from tir_kernels import build\n"
            "assert callable(build) and build is tir_kernels.build, build\n")
    result = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                            env=project_env())
    assert result.returncode == 0, result.stderr
