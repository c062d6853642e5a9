"""Every command in README.md runs as written, in order, and does what the text says.

The README's blocks chain: the quickstart trains `/tmp/t5lite_quickstart`, and eval, infer,
convert and the TensorStore snippet read its checkpoint. The quickstart's `pip install` half is
not repeated here (CI's `.ci/run` runs that install); everything else runs verbatim in bash.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow  # the quickstart trains for minutes; the README test command runs it

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()
# What the commands write (all under /tmp, as the README says); cleared first so that a rerun
# of the suite starts like a fresh machine (infer refuses to overwrite a complete output).
OUTPUTS = ["/tmp/t5lite_quickstart", "/tmp/t5lite_predictions.jsonl", "/tmp/t5lite_hf",
           "/tmp/t5lite_imported", "/tmp/t5lite_finetune", "/tmp/t5lite_2proc",
           "/tmp/t5lite_mydata"]  # fmt: skip


def _blocks(lang: str) -> list[str]:
    return re.findall(rf"```{lang}\n(.*?)```", README, flags=re.S)


def _run(script: str, **kwargs) -> subprocess.CompletedProcess:
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    env.pop("XLA_FLAGS", None)  # the commands choose their own device counts
    bindir = str(Path(sys.executable).parent)  # `t5lite` is installed beside this interpreter
    env["PATH"] = bindir + os.pathsep + env.get("PATH", "")
    out = subprocess.run(
        ["bash", "-e", "-c", script], cwd=ROOT, env=env, capture_output=True, text=True, **kwargs
    )
    assert out.returncode == 0, f"{script}\n--- stderr ---\n{out.stderr[-4000:]}"
    return out


def test_no_command_is_a_placeholder():
    for block in _blocks("bash") + _blocks("python"):
        assert "..." not in block, block


@pytest.fixture(scope="module")
def quickstart():
    for path in OUTPUTS:
        shutil.rmtree(path, ignore_errors=True) if os.path.isdir(path) else None
        if os.path.isfile(path):
            os.remove(path)
    install, _run_tests = _blocks("bash")[0].strip().splitlines()  # CI runs the second line
    pip, command = install.split(" && ")
    assert pip == "pip install -c constraints.txt -e ."
    out = _run(command, timeout=1800)
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


def test_inspect_and_plan_commands(quickstart):
    out = _run(_blocks("bash")[1], timeout=1200)
    assert out.stdout.count("train step per device") == 2  # inspect on CPU, then on v5e:4x4
    assert "TPU v5 lite" in out.stdout
    # Summaries first, judged as a v5p chip (the first) and a v5e (the topology's).
    assert out.stdout.count("  verdict: ") == 2 and " on TPU v5: " in out.stdout
    assert "[16/16]" in out.stderr and ": compiling..." in out.stderr  # plan's progress
    assert "best: " in out.stdout


def test_eval_and_infer_commands(quickstart):
    _run(_blocks("bash")[2], timeout=1200)
    records = [
        json.loads(s) for s in Path("/tmp/t5lite_predictions.jsonl").read_text().splitlines()
    ]
    assert len(records) == 64
    assert set(records[0]) == {"task", "inputs", "targets", "prediction"}


def test_convert_and_finetune_commands(quickstart):
    for path in ("/tmp/t5lite_hf", "/tmp/t5lite_imported", "/tmp/t5lite_finetune"):
        shutil.rmtree(path, ignore_errors=True)
    _run(_blocks("bash")[5], timeout=1200)
    assert (Path("/tmp/t5lite_hf") / "model.safetensors").is_file()
    assert (Path("/tmp/t5lite_finetune") / "checkpoint_20" / "COMMIT").is_file()


def test_tensorstore_snippet(quickstart):
    scope: dict = {}
    exec(_blocks("python")[0], scope)
    assert scope["w"].shape == tuple(scope["meta"]["shape"])


def test_multi_process_command(quickstart):
    shutil.rmtree("/tmp/t5lite_2proc", ignore_errors=True)  # as on a fresh machine, right here
    _run(_blocks("bash")[6], timeout=1200)
    assert (Path("/tmp/t5lite_2proc") / "checkpoint_60" / "COMMIT").is_file()


def test_own_data_commands():
    """'Train on your own data': a JSONL file the block writes, a task in gin, train, eval,
    then the cache job and training from the cache."""
    shutil.rmtree("/tmp/t5lite_mydata", ignore_errors=True)
    out = _run(_blocks("bash")[3], timeout=1200)
    model = Path("/tmp/t5lite_mydata/model")
    result = json.loads((model / "eval" / "step_400.json").read_text())
    metrics = result["metrics"]["my_qa"]
    assert metrics["exact_match"] > 50 and 1.0 <= metrics["perplexity"] < 2.0, metrics
    assert (model / "checkpoint_400" / "COMMIT").is_file()
    assert "my_qa/exact_match" in out.stderr  # printed by train's evaluation and by eval
    _run(_blocks("bash")[4], timeout=1200)
    cache = Path("/tmp/t5lite_mydata/cache/my_qa")
    assert (cache / "COMPLETED").is_file() and list(cache.glob("train.array_record-*"))
    assert (Path("/tmp/t5lite_mydata/model_cached") / "checkpoint_20" / "COMMIT").is_file()
