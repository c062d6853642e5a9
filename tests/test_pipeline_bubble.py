"""benchmarks/pipeline_bubble.py: 2 pinned processes, stage=2, idle share against the analytic
bubble; its smoke mode in a subprocess, and its arithmetic on given times."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow  # 2 processes that each compile 2 steps: ~20 s on a quiet host

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "benchmarks" / "pipeline_bubble.py"
sys.path.insert(0, str(ROOT / "benchmarks"))

import pipeline_bubble  # noqa: E402


def _run(tmp_path: Path, *args: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    env["PYTHONPATH"] = str(ROOT)
    return subprocess.run(
        [sys.executable, str(SCRIPT), *args],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip


def test_smoke_two_processes_equal_losses_and_record(tmp_path):
    out = tmp_path / "bubble.json"
    proc = _run(tmp_path, "--smoke", "--out", str(out))
    assert proc.returncode == 0, proc.stderr[-3000:]
    record = json.loads(out.read_text())
    assert set(record) >= {"benchmark", "date", "machine", "versions", "figures"}
    assert record["benchmark"] == "pipeline_bubble"
    assert "2 processes x 1 CPU device" in record["machine"]
    names = [f["name"] for f in record["figures"]]
    assert names == ["gpipe_idle_share_stage2_m2", "loss_max_relative_difference"]
    bubble, losses = record["figures"]
    # GPipe, p = 2, m = 2: (p - 1) / (m + p - 1) = 1/3.
    assert bubble["reference"] == round(1 / 3, 4)
    staged = bubble["pipelined_layers_s"]
    assert bubble["ratio"] == pytest.approx(staged / bubble["busy_work_s"], rel=1e-2)
    # The pipelined steps' losses (step 1, then one a repetition) equal the unpipelined ones.
    ref, pipe = record["losses"]["reference"], record["losses"]["gpipe_m2"]
    assert len(ref) == len(pipe) == 1 + record["settings"]["reps"]
    assert pipe == pytest.approx(ref, rel=pipeline_bubble.LOSS_RTOL)
    assert losses["met"] and losses["value"] <= pipeline_bubble.LOSS_RTOL
    assert len(record["seconds"]["reference"]) == record["settings"]["reps"]
    for key in ("alone_gpipe_m2", "twin_gpipe_m2", "alone_twin_gpipe_m2"):
        assert len(record["seconds"][key]) == record["settings"]["reps"]
    assert 0 <= bubble["kernel_share"] < 1
    # The workers' glibc keeps freed memory in one arena (each step's buffers not re-faulted).
    assert record["settings"]["malloc"] == pipeline_bubble.HOST_MALLOC


def test_too_few_microbatches_is_one_line_before_launching(tmp_path):
    proc = _run(tmp_path, "--microbatches", "4", "1")
    assert proc.returncode != 0
    assert proc.stderr.strip().splitlines() == [
        "pipeline_bubble.py: error: --microbatches 1: need microbatches >= 2 that divide"
        " --batch 32, a batch even, reps >= 1"
    ]


def test_idle_shares_from_given_times():
    """The bubble is 1 - W / S: W the stage's layers alone (its program on a stage axis of one
    device less the layer-free twin's), S the same pipelined (the step less the twin's step);
    1F1B's W adds the forward its program alone drops."""
    raw = {
        "times": {
            "reference": [1.6, 1.5, 1.7],  # data=2, gloo all-reduces: not the busy work
            "gpipe_m4": [1.45, 1.5, 1.4],  # S = 1.45 - 0.2 = 1.25 = 5/4 W: the analytic 1/5
            "alone_gpipe_m4": [1.1, 1.0, 1.2],  # W = 1.1 - 0.1 = 1.0
            "twin_gpipe_m4": [0.2, 0.2, 0.2],  # transfers 0.2 - 0.1
            "alone_twin_gpipe_m4": [0.1, 0.1, 0.1],
            "1f1b_m4": [2.0, 2.0, 2.0],  # S = 1.8; W = 1.0 + 0.2 (the forward): 1 - 1.2 / 1.8
            "alone_1f1b_m4": [1.1, 1.1, 1.1],
            "twin_1f1b_m4": [0.2, 0.2, 0.2],
            "alone_twin_1f1b_m4": [0.1, 0.1, 0.1],
            "forward_alone_1f1b_m4": [0.3, 0.3, 0.3],
            "forward_alone_twin_1f1b_m4": [0.1, 0.1, 0.1],
        },
        "losses": {"reference": [2.0, 1.5], "gpipe_m4": [2.0, 1.5], "1f1b_m4": [2.0, 1.5003]},
        # Process CPU time less kernel time (user): GPipe's layers 1.25 (1.366 - 0.116, less the
        # twin's 0.05 - 0.05) = 5/4 its stage's alone (1.1 - 0.1); off the CPU 6.4% (median of
        # 0.084/1.45, 0.12/1.5, 0.09/1.4) and 30% of the steps.
        "cpu": {
            "gpipe_m4": [1.366, 1.38, 1.31],
            "twin_gpipe_m4": [0.05, 0.05, 0.05],
            "alone_gpipe_m4": [1.1, 1.0, 1.2],
            "alone_twin_gpipe_m4": [0.1, 0.1, 0.1],
            "1f1b_m4": [1.4, 1.4, 1.4],
        },
        # Of it in the kernel: 8% (median of 0.116/1.45, 0.13/1.5, 0.06/1.4).
        "kernel": {
            "gpipe_m4": [0.116, 0.13, 0.06],
            "twin_gpipe_m4": [0.05, 0.05, 0.05],
            "alone_gpipe_m4": [0.0, 0.0, 0.0],
            "alone_twin_gpipe_m4": [0.0, 0.0, 0.0],
            "1f1b_m4": [0.2, 0.2, 0.2],
        },
    }
    figures, rows = pipeline_bubble._figures(raw)
    gpipe, onefb, loss = figures
    assert gpipe["name"] == "gpipe_idle_share_stage2_m4"
    assert gpipe["value"] == pytest.approx(0.2) and gpipe["reference"] == 0.2 and gpipe["met"]
    assert gpipe["transfers_s"] == pytest.approx(0.1) and gpipe["busy_work_s"] == 1.0
    assert gpipe["pipelined_layers_s"] == pytest.approx(1.25)
    assert gpipe["idle_share_with_transfers"] == pytest.approx(1 - 1.1 / 1.45, abs=1e-4)
    assert onefb["busy_work_s"] == pytest.approx(1.2)
    assert gpipe["bubble_in_user_cpu_time"] == pytest.approx(0.2)
    assert onefb["bubble_in_user_cpu_time"] is None  # 1F1B idles off the CPU
    assert gpipe["waiting_share"] == pytest.approx(0.09 / 1.4, abs=1e-4)
    assert onefb["waiting_share"] == 0.3
    assert gpipe["kernel_share"] == pytest.approx(0.08) and onefb["kernel_share"] == 0.1
    assert onefb["value"] == pytest.approx(1 / 3, abs=1e-4) and not onefb["met"]
    # 1F1B at p = 2: its last stage drops its schedule's F, so the stage takes 5/4 W - 2 F / 4.
    assert onefb["reference"] == pytest.approx(1 - 1.2 / (1.5 - 0.1), abs=1e-4)
    assert onefb["textbook_reference"] == gpipe["textbook_reference"] == 0.2
    assert loss["value"] == pytest.approx(2e-4) and not loss["met"]
    assert [r[0] for r in rows] == ["gpipe", "1f1b"]
