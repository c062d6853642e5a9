"""README.md's code blocks and a runner for them, shared by the test files that run them.

The README's commands are split over several test files (quickstart chain, inspect/plan, own
data and multi-process, walkthrough) so that `--dist loadfile` can run them on different
workers; each file clears only the outputs it writes, so they can run at the same time.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()


def blocks(lang: str) -> list[str]:
    """The README's fenced blocks of `lang`, in order."""
    return re.findall(rf"```{lang}\n(.*?)```", README, flags=re.S)


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
    assert out.returncode == 0, f"{script}\n--- stderr ---\n{out.stderr[-4000:]}"
    return out
