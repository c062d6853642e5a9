"""README.md and docs/ hold together: every command is run by a test or says why not, the
generated rules tables match the code, links resolve, and pages stay readable.

The commands themselves run in test_readme*.py and test_walkthrough.py (slow); this file is
fast, apart from the lint command.
"""

from __future__ import annotations

import ast
import importlib.util
import os
import re
import shutil
import sys
from pathlib import Path

import pytest
from readme_blocks import ROOT, block, markdown_files, parse, run

TESTS = Path(__file__).resolve().parent
RUNNABLE = ("bash", "python")


def _load_rules_tables():
    spec = importlib.util.spec_from_file_location("rules_tables", ROOT / "docs" / "rules_tables.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _blocks_run_by_tests() -> set[tuple[str, str]]:
    """(file, name) of every `block("FILE", "NAME")` call with literal arguments in tests/."""
    out = set()
    for path in TESTS.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if not isinstance(node, ast.Call) or len(node.args) != 2:
                continue
            func = node.func
            name = func.id if isinstance(func, ast.Name) else getattr(func, "attr", None)
            args = [a.value for a in node.args if isinstance(a, ast.Constant)]
            if name == "block" and len(args) == 2 and all(isinstance(a, str) for a in args):
                out.add((args[0], args[1]))
    return out


def _all_blocks():
    return [b for f in markdown_files() for b in parse(f)]


def test_every_command_block_is_named_or_says_why_it_is_not_run():
    unmarked = [
        f"{b.file}:{b.line}"
        for b in _all_blocks()
        if b.lang in RUNNABLE and b.name is None and not b.not_run
    ]
    assert not unmarked, (
        "bash/python blocks need `<!-- block: NAME -->` (and a test calling block(FILE, NAME)) "
        f"or `<!-- not run: REASON -->` on the line before the fence: {unmarked}"
    )


def test_every_named_block_is_run_by_a_test():
    named = {(b.file, b.name) for b in _all_blocks() if b.name is not None}
    called = _blocks_run_by_tests()
    assert sorted(named - called) == [], "named blocks that no test runs"
    assert sorted(called - named) == [], "tests call blocks that the docs do not have"


def test_block_names_are_unique_per_file():
    for f in markdown_files():
        names = [b.name for b in parse(f) if b.name is not None]
        assert len(names) == len(set(names)), (f, names)


def test_no_named_command_is_a_placeholder():
    for b in _all_blocks():
        if b.name is not None:
            assert "..." not in b.text, f"{b.file}:{b.line}"


def test_readme_opens_with_the_quickstart_that_ci_runs():
    """`.ci/run` takes line 2 of README's first bash block; test_readme.py runs line 1."""
    first = next(b for b in parse("README.md") if b.lang == "bash")
    assert first.name == "quickstart"
    train, tests = first.text.strip().splitlines()
    assert train.startswith("pip install -c constraints.txt -e . && t5lite train ")
    assert tests.startswith('pip install -c constraints.txt -e ".[test') and "pytest" in tests
    ci = run("awk '/^```bash/{n++; next} /^```/{if(n==1) exit} n==1' README.md | sed -n 2p")
    assert ci.stdout.strip() == tests


def test_rules_tables_are_generated_from_presets():
    rules_tables = _load_rules_tables()
    page = (ROOT / "docs" / "partitioning.md").read_text()
    assert rules_tables.current(page) == rules_tables.render(), (
        "docs/partitioning.md's rules tables are stale: run python docs/rules_tables.py"
    )


def test_rules_tables_render_each_preset_in_priority_order():
    """An independent read of the page: each preset's rows are `preset_rules(name)`, in order."""
    from t5lite.partitioning import PRESETS, preset_rules

    page = (ROOT / "docs" / "partitioning.md").read_text()
    for name in PRESETS:
        assert f"### `{name}`\n" in page, f"{name}: run python docs/rules_tables.py"
        section = page.split(f"### `{name}`\n", 1)[1].split("\n\n###", 1)[0]
        rows = re.findall(r"^\| (\d+) \| `(\w+)` \| (.+) \|$", section, flags=re.M)
        want = preset_rules(name)
        assert [int(i) for i, _, _ in rows] == list(range(1, len(want) + 1)), name
        assert [n for _, n, _ in rows] == [n for n, _ in want], name
        for (_, logical, cell), (_, axis) in zip(rows, want, strict=True):
            expected = "replicated" if axis is None else f"`{axis}`"
            if isinstance(axis, tuple):
                expected = "`(" + ", ".join(axis) + ")`"
            assert cell == expected, (name, logical, cell, axis)
    megatron = page.split("### `megatron`\n", 1)[1].split("\n\n###", 1)[0]
    assert "| 3 | `mlp` | `model` |" in megatron
    context = page.split("### `context_parallel`\n", 1)[1].split("\n\n###", 1)[0]
    assert "| 1 | `length` | `model` |" in context  # context parallelism's rule comes first


def _slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def _anchors(path: Path) -> set[str]:
    text = re.sub(r"^```.*?^```$", "", path.read_text(), flags=re.S | re.M)
    return {_slug(h) for h in re.findall(r"^#+ (.+)$", text, flags=re.M)}


def test_links_between_pages_resolve():
    broken = []
    for f in markdown_files():
        text = re.sub(r"^```.*?^```$", "", (ROOT / f).read_text(), flags=re.S | re.M)
        for target in re.findall(r"\]\(([^)\s]+)\)", text):
            if re.match(r"\w+://", target):
                continue
            file, _, anchor = target.partition("#")
            path = (ROOT / f).parent / file if file else ROOT / f
            if not path.exists() or (anchor and anchor not in _anchors(path)):
                broken.append(f"{f}: {target}")
    assert not broken, broken


def test_readme_maps_every_docs_page():
    readme = (ROOT / "README.md").read_text()
    pages = [f for f in markdown_files() if f.startswith("docs/")]
    assert pages and all(f"]({f})" in readme for f in pages), pages


def test_pages_keep_paragraphs_and_table_cells_short():
    """The front page stays a front page; no page grows a wall of text again."""
    assert len((ROOT / "README.md").read_text().splitlines()) <= 200
    for f in markdown_files():
        text = re.sub(r"^```.*?^```$", "", (ROOT / f).read_text(), flags=re.S | re.M)
        for para in re.split(r"\n\s*\n", text):
            lines = para.splitlines()
            if lines and lines[0].startswith("|"):
                for row in lines:
                    cells = row.strip("|").split(" | ")
                    assert max(len(c.split()) for c in cells) <= 40, (f, row[:80])
            else:  # a list item counts as a paragraph of its own
                items = re.split(r"\n(?=- |\d+\. )", para)
                assert max(len(i.splitlines()) for i in items) <= 12, (f, para[:80])


def test_explicit_mode_python_block():
    """docs/partitioning.md's Python form of explicit mode, on the suite's 8 fake devices."""
    import jax

    scope: dict = {}
    exec(block("docs/partitioning.md", "explicit-python"), scope)
    part = scope["part"]
    assert part.shard_mode == "explicit"
    assert dict(part.mesh.shape) == {"data": 2, "model": 4}
    assert set(part.mesh.axis_types) == {jax.sharding.AxisType.Explicit}


def test_lint_command():
    """README's lint command, as written (ruff comes with the [test] extra)."""
    path = os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")])
    if shutil.which("ruff", path=path) is None:
        pytest.skip("ruff is not installed (the [test] extra)")
    run(block("README.md", "lint"), timeout=300)


def test_measured_figures_live_in_performance_md():
    """Speeds and speed-ups have one home; the other pages point to it."""
    measured = re.compile(
        r"\d(?:[\d.]*)\s?(?:tokens/s|GiB/s|ms/step|s wall|× (?:Orbax|PyTorch|transformers))"
    )
    for f in markdown_files():
        if f != "docs/performance.md":
            assert not measured.findall((ROOT / f).read_text()), f
    assert measured.findall((ROOT / "docs" / "performance.md").read_text())
