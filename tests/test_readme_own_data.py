"""docs/data.md's "train on your own data" and cache blocks and docs/multi-process.md's block
run as written.

Their own file (neither reads the quickstart's checkpoint) so that `--dist loadfile` runs them
on another worker beside test_readme.py's quickstart chain. Each clears only what it writes.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from readme_blocks import block, run

from t5lite.programs.evaluate import read_eval_results

pytestmark = pytest.mark.slow  # three trainings, an eval and a Beam job


def test_own_data_commands():
    """'Train on your own data': a JSONL file the block writes, a task in gin, train, eval,
    then the cache job and training from the cache."""
    shutil.rmtree("/tmp/t5lite_mydata", ignore_errors=True)
    out = run(block("docs/data.md", "own-data"), timeout=1200)
    model = Path("/tmp/t5lite_mydata/model")
    results = read_eval_results(model, "my_qa")  # train's evaluation, then `t5lite eval`'s
    assert [r["step"] for r in results] == [400, 400]
    metrics = results[-1]["metrics"]
    assert metrics["exact_match"] > 50 and 1.0 <= metrics["perplexity"] < 2.0, metrics
    assert (model / "checkpoint_400" / "COMMIT").is_file()
    assert "my_qa/exact_match" in out.stderr  # printed by train's evaluation and by eval
    run(block("docs/data.md", "cache"), timeout=1200)
    cache = Path("/tmp/t5lite_mydata/cache/my_qa")
    assert (cache / "COMPLETED").is_file() and list(cache.glob("train.array_record-*"))
    assert (Path("/tmp/t5lite_mydata/model_cached") / "checkpoint_20" / "COMMIT").is_file()


def test_multi_process_command():
    shutil.rmtree("/tmp/t5lite_2proc", ignore_errors=True)  # as on a fresh machine, right here
    run(block("docs/multi-process.md", "two-processes"), timeout=1200)
    assert (Path("/tmp/t5lite_2proc") / "checkpoint_60" / "COMMIT").is_file()
