"""The package's folders are layers: imports point one way, no module imports itself back through
others (no cycle, also inside a folder), and only the CLI touches gin.

Checked two ways: statically (every `import` in every module, including ones inside functions)
and by importing a layer in a fresh interpreter and looking at what got loaded.
"""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from collections.abc import Iterable, Mapping
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "t5lite"
# Packages checked for import cycles.
CYCLE_CHECKED = ("t5lite", "seqio_lite")

# Folders are layers: a module imports only from its own folder and from the layers listed for
# its folder here (imports point down: `model/` at the bottom, `cli/` at the top), never in a
# cycle, also inside a folder; only `cli/` touches gin.
ALLOWED: dict[str, set[str]] = {
    # `constraints.py` is the one point model code and the partitioning layer share (model code
    # states layouts through it; an explicit-mode partitioner installs how they resolve).
    # `collectives.py` writes sequence/context parallelism's block boundaries from the rules in
    # force (jax and flax only), called by model code with logical axes.
    "constraints": set(),
    # `tensor_nd.py`: 2D/3D tensor parallelism's contractions (called by `collectives.py`) and
    # its mesh axis names (used by `partitioning/tensor_mesh.py`).
    "tensor_nd": {"constraints"},
    "collectives": {"constraints", "tensor_nd"},
    # `context_parallel.py`: context parallelism's attention strategies (the all-gather and the
    # ring's plan), on `collectives.py`'s `Strategy` and layout helpers.
    "context_parallel": {"constraints", "collectives"},
    "model": {"constraints", "collectives", "context_parallel"},
    "pytree": set(),
    "distributed": set(),
    "partitioning": {"pytree", "constraints", "tensor_nd"},
    # `distributed.py`: processes agree (barriers, small values) through the coordination
    # service; the checkpoint's multi-process saves and restores wait on it.
    "checkpoint": {"pytree", "distributed"},
    "trainer": {"model", "partitioning", "pytree"},
    "compat": {"model"},
    "insight": {"model", "partitioning", "trainer", "pytree"},
    "hf": {"model", "checkpoint", "pytree"},
    "programs": {
        "model",
        "partitioning",
        "checkpoint",
        "trainer",
        "insight",
        "distributed",
        "pytree",
    },
    "cli": {
        "compat",
        "model",
        "partitioning",
        "checkpoint",
        "trainer",
        "insight",
        "hf",
        "programs",
        "distributed",
        "pytree",
    },
}
GIN_MODULES = {
    "t5lite/cli/registry.py",
    "t5lite/cli/gin_config.py",
    "t5lite/cli/gin_checks.py",
    "t5lite/cli/gin_unused.py",
    "t5lite/cli/harness_model.py",  # lm-eval's `t5lite` model: builds MODEL from gin files
}


def _layer(module: str) -> str | None:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 and parts[0] == "t5lite" else None


def _imports(path: Path) -> list[tuple[str, int]]:
    out = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out += [(a.name, node.lineno) for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            out += [(node.module, node.lineno)]
            out += [(f"{node.module}.{a.name}", node.lineno) for a in node.names]
    return out


def _modules():
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(PACKAGE.parent)
        parts = rel.with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        if len(parts) > 1 and parts[1] != "__main__":
            yield path, str(rel), ".".join(parts)


def test_every_module_belongs_to_a_known_layer():
    assert {_layer(m) for _, _, m in _modules()} == set(ALLOWED)


def test_imports_point_down_the_layers():
    wrong = []
    for path, rel, module in _modules():
        own = _layer(module)
        for name, line in _imports(path):
            other = _layer(name)
            if other and other != own and other not in ALLOWED[own]:
                wrong.append(f"{rel}:{line} ({own}) imports {name} ({other})")
    assert wrong == []


def test_only_the_cli_imports_gin():
    wrong = [
        f"{rel}:{line}"
        for path, rel, _ in _modules()
        for name, line in _imports(path)
        if name.split(".")[0] == "gin" and rel not in GIN_MODULES
    ]
    assert wrong == []


@pytest.mark.parametrize(
    "module, must_not_load",
    [
        ("t5lite.model.models", ["t5lite.trainer", "t5lite.checkpoint", "t5lite.insight"]),
        ("t5lite.partitioning", ["t5lite.model", "t5lite.trainer"]),
        ("t5lite.checkpoint", ["t5lite.model", "t5lite.partitioning", "t5lite.trainer"]),
        ("t5lite.trainer", ["t5lite.insight", "t5lite.programs", "t5lite.checkpoint"]),
        ("t5lite.programs.train", ["gin", "t5lite.cli"]),
    ],
)
def test_a_layer_imports_alone(module, must_not_load):
    code = (
        f"import sys, {module}\n"
        f"prefixes = {must_not_load!r}\n"
        "print(sorted(m for m in sys.modules for p in prefixes if m == p or m.startswith(p + '.')))"
    )
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": str(PACKAGE.parent)}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "[]"


def test_top_level_names_resolve_lazily():
    code = (
        "import sys, t5lite\n"
        "assert 'jax' not in sys.modules, 'import t5lite must not start JAX'\n"
        "from t5lite import Partitioner, EncoderDecoderModel, DataConfig, train, preset_rules\n"
        "from t5lite.partitioning import Partitioner as P\n"
        "assert Partitioner is P and callable(train) and preset_rules('fsdp')\n"
        "print(sorted(set(t5lite.__all__) - set(dir(t5lite))))\n"
    )
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": str(PACKAGE.parent)}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "[]"


def _body_lines(fn: ast.FunctionDef | ast.AsyncFunctionDef) -> int:
    """Lines of a function without its docstring."""
    lines = fn.end_lineno - fn.lineno + 1
    first = fn.body[0]
    if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant):
        lines -= first.end_lineno - first.lineno + 1
    return lines


def test_modules_and_functions_stay_small():
    too_big = []
    for path in sorted([*PACKAGE.rglob("*.py"), *(PACKAGE.parent / "seqio_lite").rglob("*.py")]):
        rel = path.relative_to(PACKAGE.parent)
        text = path.read_text()
        if text.count("\n") > 600:
            too_big.append(f"{rel}: {text.count(chr(10))} lines")
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) and _body_lines(node) > 80:
                too_big.append(f"{rel}:{node.lineno} {node.name}: {_body_lines(node)} lines")
    assert too_big == []


# --- import cycles ----------------------------------------------------------------------------


def _module_files(root: Path, packages: Iterable[str]) -> dict[str, tuple[Path, bool]]:
    """Dotted module name -> (file, whether it is a package's `__init__.py`)."""
    out = {}
    for package in packages:
        for path in sorted((root / package).rglob("*.py")):
            parts = path.relative_to(root).with_suffix("").parts
            is_package = parts[-1] == "__init__"
            out[".".join(parts[:-1] if is_package else parts)] = (path, is_package)
    return out


def _imported_names(module: str, is_package: bool, node: ast.Import | ast.ImportFrom):
    """The dotted names one import statement asks for, relative imports resolved: `from p import
    x` names `p.x` (a module if one exists, else a name in `p`)."""
    if isinstance(node, ast.Import):
        return [a.name for a in node.names]
    base = node.module or ""
    if node.level:
        package = module.split(".") if is_package else module.split(".")[:-1]
        package = package[: len(package) - node.level + 1]
        base = ".".join([*package, base] if base else package)
    return [f"{base}.{a.name}" for a in node.names]


def import_graph(root: Path, packages: Iterable[str]) -> dict[str, set[str]]:
    """Module -> the modules of `packages` (under `root`) it imports, from every import statement
    (inside functions and `if TYPE_CHECKING:` too).

    An import of `p.q.x` counts as an import of the longest module prefix that exists (`p.q.x` if
    it is a module, else `p.q`, whose `__init__` defines `x`). A submodule's import does not
    count as importing its parent package's `__init__`: Python runs that first, but it is not a
    dependency the submodule states.
    """
    modules = _module_files(root, packages)
    graph: dict[str, set[str]] = {}
    for module, (path, is_package) in modules.items():
        deps = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if not isinstance(node, ast.Import | ast.ImportFrom):
                continue
            for name in _imported_names(module, is_package, node):
                while name and name not in modules:
                    name = name.rpartition(".")[0]
                if name and name != module:
                    deps.add(name)
        graph[module] = deps
    return graph


def _shortest_cycle_through(graph: Mapping[str, set[str]], start: str) -> list[str] | None:
    """The shortest import chain from `start` back to itself (breadth first), or None."""
    parent: dict[str, str] = {}
    frontier = [start]
    while frontier:
        nxt = []
        for node in frontier:
            for dep in sorted(graph.get(node, ())):
                if dep == start:
                    chain = [node]
                    while chain[-1] != start:
                        chain.append(parent[chain[-1]])
                    return [start, *reversed(chain[:-1]), start]
                if dep not in parent:
                    parent[dep] = node
                    nxt.append(dep)
        frontier = nxt
    return None


def import_cycles(graph: Mapping[str, set[str]]) -> list[str]:
    """One readable chain (`a -> b -> a`) per group of modules that import each other, found
    from each group's first module in sorted order."""
    covered: set[str] = set()
    out = []
    for module in sorted(graph):
        if module in covered:
            continue
        chain = _shortest_cycle_through(graph, module)
        if chain is None:
            continue
        # Every module on a path from `module` that leads back to it is in the same group.
        reach = _reachable(graph, module)
        covered |= {m for m in reach if module in _reachable(graph, m)}
        out.append(" -> ".join(chain))
    return out


def _reachable(graph: Mapping[str, set[str]], start: str) -> set[str]:
    seen, todo = {start}, [start]
    while todo:
        for dep in graph.get(todo.pop(), ()):
            if dep not in seen:
                seen.add(dep)
                todo.append(dep)
    return seen


def test_no_import_cycle():
    graph = import_graph(PACKAGE.parent, CYCLE_CHECKED)
    assert "t5lite.insight.report" in graph and "seqio_lite.loader" in graph
    cycles = import_cycles(graph)
    assert not cycles, "import cycles:\n" + "\n".join(cycles)


def test_the_cycle_check_finds_a_cycle_inside_a_folder(tmp_path):
    # `pkg.a` imports `pkg.b` at the top; `pkg.b` imports `pkg.a` back inside a function,
    # through a relative import. `pkg.c` and the package's own `__init__` are no part of it.
    files = {
        "pkg/__init__.py": "from pkg.a import run\n",
        "pkg/a.py": "from pkg import b\nfrom pkg.c import VALUE\n\ndef run():\n    return b\n",
        "pkg/b.py": "def late():\n    from . import a\n    return a\n",
        "pkg/c.py": "import os\nVALUE = os.sep\n",
        "pkg/sub/__init__.py": "",
        "pkg/sub/d.py": "from ..c import VALUE\nfrom .. import c\n",
        "other/__init__.py": "",
        "other/e.py": "from other import f\n",
        "other/f.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import other.e\n",
    }
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    graph = import_graph(tmp_path, ["pkg", "other"])
    assert graph == {
        "pkg": {"pkg.a"},
        "pkg.a": {"pkg.b", "pkg.c"},
        "pkg.b": {"pkg.a"},
        "pkg.c": set(),
        "pkg.sub": set(),
        "pkg.sub.d": {"pkg.c"},
        "other": set(),
        "other.e": {"other.f"},
        "other.f": {"other.e"},
    }
    assert import_cycles(graph) == ["other.e -> other.f -> other.e", "pkg.a -> pkg.b -> pkg.a"]
    # A longer chain is reported whole, from its first module.
    assert import_cycles({"x": {"y"}, "y": {"z"}, "z": {"x", "w"}, "w": set()}) == [
        "x -> y -> z -> x"
    ]
