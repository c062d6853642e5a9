"""docs/inspect-and-plan.md's block runs as written: inspect on CPU judged as a v5p, inspect on
a v5e:4x4 topology's compiler, then the layout search of the shipped plan.gin.

Its own file (not test_readme.py's quickstart chain, which it does not read) so that
`--dist loadfile` runs it on another worker beside the quickstart's training.
"""

from __future__ import annotations

import pytest
from readme_blocks import block, run

pytestmark = pytest.mark.slow  # compiles T5.1.1-small five times; the README test command runs it


def test_inspect_and_plan_commands():
    out = run(block("docs/inspect-and-plan.md", "inspect-and-plan"), timeout=1200)
    assert out.stdout.count("train step per device") == 2  # inspect on CPU, then on v5e:4x4
    assert "TPU v5 lite" in out.stdout
    # Summaries first, judged as a v5p chip (the first) and a v5e (the topology's).
    assert out.stdout.count("  verdict: ") == 2 and " on TPU v5: " in out.stdout
    assert "[16/16]" in out.stderr and ": compiling..." in out.stderr  # plan's progress
    assert "best: " in out.stdout
    # Piped, not a terminal: every report fits 100 columns.
    assert max(len(line) for line in out.stdout.splitlines()) <= 100
