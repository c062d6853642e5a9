"""Every command of the quickstart chain runs as written, in order, and does what the text says.

The chain: README's quickstart trains `/tmp/t5lite_quickstart`; docs/running.md's eval and
infer, docs/huggingface.md's convert and fine-tune, docs/checkpoints.md's TensorStore snippet
and docs/partitioning.md's explicit-mode command read its checkpoint. The quickstart's
`pip install` half is not repeated here (CI's `.ci/run` runs that install); everything else
runs verbatim in bash. The blocks that do not read the quickstart's checkpoint run from their
own files (test_readme_inspect.py, test_readme_own_data.py, test_walkthrough.py), so that
`--dist loadfile` can run them beside this chain instead of after it.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
from readme_blocks import block, run

pytestmark = pytest.mark.slow  # the quickstart trains for minutes; the README test command runs it

# What this file's commands write (all under /tmp, as the docs say); cleared first so that a
# rerun of the suite starts like a fresh machine (infer refuses to overwrite a complete output).
# The other docs test files clear their own outputs, which may be in use meanwhile.
OUTPUTS = [
    "/tmp/t5lite_quickstart",
    "/tmp/t5lite_predictions.jsonl",
    "/tmp/t5lite_hf",
    "/tmp/t5lite_imported",
    "/tmp/t5lite_finetune",
]


@pytest.fixture(scope="module")
def quickstart():
    for path in OUTPUTS:
        shutil.rmtree(path, ignore_errors=True) if os.path.isdir(path) else None
        if os.path.isfile(path):
            os.remove(path)
    install, _run_tests = block("README.md", "quickstart").strip().splitlines()  # CI: line 2
    pip, command = install.split(" && ")
    assert pip == "pip install -c constraints.txt -e ."
    out = run(command, timeout=1800)
    return out.stdout + out.stderr


def test_quickstart_learns_and_checkpoints(quickstart):
    metrics = [
        json.loads(s) for s in Path("/tmp/t5lite_quickstart/metrics.jsonl").read_text().splitlines()
    ]
    evals = [m for m in metrics if m["split"] == "eval"]
    assert evals, "the quickstart evaluates after its last step"
    accuracy = [v for k, v in evals[-1].items() if k.endswith("exact_match")]
    # Percent of exactly reversed strings after the last step (100 when last measured).
    assert evals[-1]["step"] == 1200 and accuracy and accuracy[0] > 90, evals[-1]
    steps = sorted(p.name for p in Path("/tmp/t5lite_quickstart").glob("checkpoint_*"))
    assert "checkpoint_1200" in steps
    assert "predictions:" in quickstart


def test_eval_and_infer_commands(quickstart):
    run(block("docs/running.md", "eval-and-infer"), timeout=1200)
    records = [
        json.loads(s) for s in Path("/tmp/t5lite_predictions.jsonl").read_text().splitlines()
    ]
    assert len(records) == 64
    assert set(records[0]) == {"task", "inputs", "targets", "prediction"}


def test_convert_and_finetune_commands(quickstart):
    for path in ("/tmp/t5lite_hf", "/tmp/t5lite_imported", "/tmp/t5lite_finetune"):
        shutil.rmtree(path, ignore_errors=True)
    run(block("docs/huggingface.md", "convert-and-finetune"), timeout=1200)
    assert (Path("/tmp/t5lite_hf") / "model.safetensors").is_file()
    assert (Path("/tmp/t5lite_finetune") / "checkpoint_20" / "COMMIT").is_file()


def test_tensorstore_snippet(quickstart):
    scope: dict = {}
    exec(block("docs/checkpoints.md", "tensorstore"), scope)
    assert scope["w"].shape == tuple(scope["meta"]["shape"])


def test_explicit_mode_command(quickstart):
    """docs/partitioning.md's explicit-mode command on the quickstart's finished run: the
    Trainer is built (and its train step traced) on Explicit axes and the last checkpoint is
    restored onto them; the run is complete, so no step runs and nothing new is written."""
    before = sorted(p.name for p in Path("/tmp/t5lite_quickstart").glob("checkpoint_*"))
    out = run(block("docs/partitioning.md", "explicit-train"), timeout=1200)
    assert "resumed from /tmp/t5lite_quickstart/checkpoint_1200" in out.stdout + out.stderr
    after = sorted(p.name for p in Path("/tmp/t5lite_quickstart").glob("checkpoint_*"))
    assert after == before
