"""The package's folders are layers: imports point one way, and only the CLI touches gin.

Checked two ways: statically (every `import` in every module, including ones inside functions)
and by importing a layer in a fresh interpreter and looking at what got loaded.
"""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "t5lite"

# layer -> the t5lite layers it may import (besides itself). Mirrors README's layout table.
ALLOWED: dict[str, set[str]] = {
    # `constraints.py` is the one point model code and the partitioning layer share (model code
    # states layouts through it; an explicit-mode partitioner installs how they resolve).
    # `collectives.py` writes sequence/context parallelism's block boundaries from the rules in
    # force (jax and flax only), called by model code with logical axes.
    "constraints": set(),
    "collectives": {"constraints"},
    "model": {"constraints", "collectives"},
    "pytree": set(),
    "distributed": set(),
    "partitioning": {"pytree", "constraints"},
    "checkpoint": {"pytree"},
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
