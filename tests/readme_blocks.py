"""The code blocks of README.md and docs/*.md, found by name, and a runner for them.

A block is named by an HTML comment on the line right before its fence, which the rendered page
does not show:

    <!-- block: quickstart -->
    ```bash
    ...

A bash or python block that no test runs says so, with the reason, in the same place:
`<!-- not run: needs a Cloud TPU pod slice -->`. tests/test_docs.py checks that every bash and
python block carries one of the two, and that every named block is run by some test (a call
`block("FILE", "NAME")` with literal arguments in a file under tests/).

The commands are split over several test files (quickstart chain, inspect/plan, own data and
multi-process, walkthrough) so that `--dist loadfile` can run them on different workers; each
file clears only the outputs it writes, so they can run at the same time.
"""

from __future__ import annotations

import dataclasses
import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# The marker comment, then the fence on the next line; the block ends at the next closing fence.
_BLOCK = re.compile(
    r"^(?:<!-- (?:block: (?P<name>[\w.-]+)|not run: (?P<reason>[^>]*?)) -->\n)?"
    r"```(?P<lang>[\w-]*)\n(?P<text>.*?)^```$",
    flags=re.S | re.M,
)


@dataclasses.dataclass(frozen=True)
class Block:
    """One fenced block of a markdown file."""

    file: str  # relative to the repository root, e.g. "docs/data.md"
    line: int  # 1-based line of the opening fence
    lang: str  # the info string ("bash", "python", "" for none)
    name: str | None  # from `<!-- block: NAME -->`
    not_run: str | None  # the reason from `<!-- not run: REASON -->`
    text: str


def markdown_files() -> list[str]:
    """README.md and every page of the manual, relative to the repository root."""
    return ["README.md", *sorted(f"docs/{p.name}" for p in (ROOT / "docs").glob("*.md"))]


def parse(file: str) -> list[Block]:
    """Every fenced block of `file` (relative to the repository root), in order."""
    source = (ROOT / file).read_text()
    out = []
    for m in _BLOCK.finditer(source):
        fence = m.start("lang") - 3
        out.append(
            Block(
                file=file,
                line=source.count("\n", 0, fence) + 1,
                lang=m["lang"],
                name=m["name"],
                not_run=m["reason"].strip() if m["reason"] is not None else None,
                text=m["text"],
            )
        )
    return out


def block(file: str, name: str) -> str:
    """The text of the block named `name` in `file` (e.g. `block("docs/data.md", "own-data")`)."""
    found = [b.text for b in parse(file) if b.name == name]
    assert len(found) == 1, f"{file} has {len(found)} blocks named {name!r}, expected one"
    return found[0]


def run(script: str, **kwargs) -> subprocess.CompletedProcess:
    """Runs `script` as written under `bash -e` from the repository root, on CPU, with the
    `t5lite` installed beside this interpreter; fails the test with its stderr if it fails."""
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    env.pop("XLA_FLAGS", None)  # the commands choose their own device counts
    bindir = str(Path(sys.executable).parent)  # `t5lite` is installed beside this interpreter
    env["PATH"] = bindir + os.pathsep + env.get("PATH", "")
    out = subprocess.run(
        ["bash", "-e", "-c", script], cwd=ROOT, env=env, capture_output=True, text=True, **kwargs
    )
    assert out.returncode == 0, (
        f"{script}\n--- stdout ---\n{out.stdout[-2000:]}\n--- stderr ---\n{out.stderr[-4000:]}"
    )
    return out
