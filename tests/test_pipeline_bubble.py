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
    net = bubble["step_s"] - bubble["transfers_s"]
    assert bubble["ratio"] == pytest.approx(net / bubble["busy_work_s"], rel=1e-2)
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
    """The bubble is 1 - W / (t - t_x): W the stage's program alone (a stage axis of one
    device), t_x the layer-free twin's pipelined step less its stage alone."""
    raw = {
        "times": {
            "reference": [1.6, 1.5, 1.7],  # data=2, gloo all-reduces: not the busy work
            "gpipe_m4": [1.45, 1.5, 1.4],  # median 1.45 = 5/4 W + 0.2 of transfers
            "alone_gpipe_m4": [1.0, 0.9, 1.1],
            "twin_gpipe_m4": [0.4, 0.4, 0.4],  # transfers 0.4 - 0.2
            "alone_twin_gpipe_m4": [0.2, 0.2, 0.2],
            "1f1b_m4": [2.0, 2.0, 2.0],  # W 1.2, transfers 0.2: 1 - 1.2 / 1.8 = 1/3
            "alone_1f1b_m4": [1.2, 1.2, 1.2],
            "twin_1f1b_m4": [0.45, 0.45, 0.45],
            "alone_twin_1f1b_m4": [0.25, 0.25, 0.25],
        },
        "losses": {"reference": [2.0, 1.5], "gpipe_m4": [2.0, 1.5], "1f1b_m4": [2.0, 1.5003]},
        # Process CPU time: GPipe's user time (CPU less kernel) 1.25 = 5/4 its stage's alone;
        # off the CPU 6.4% (median of 0.084/1.45, 0.12/1.5, 0.09/1.4) and 30% of the steps.
        "cpu": {
            "gpipe_m4": [1.366, 1.38, 1.31],
            "alone_gpipe_m4": [1.0, 0.9, 1.1],
            "1f1b_m4": [1.4, 1.4, 1.4],
        },
        # Of it in the kernel: 8% (median of 0.116/1.45, 0.13/1.5, 0.06/1.4).
        "kernel": {
            "gpipe_m4": [0.116, 0.13, 0.06],
            "alone_gpipe_m4": [0.0, 0.0, 0.0],
            "1f1b_m4": [0.2, 0.2, 0.2],
        },
    }
    figures, rows = pipeline_bubble._figures(raw)
    gpipe, onefb, loss = figures
    assert gpipe["name"] == "gpipe_idle_share_stage2_m4"
    assert gpipe["value"] == pytest.approx(0.2) and gpipe["reference"] == 0.2 and gpipe["met"]
    assert gpipe["transfers_s"] == pytest.approx(0.2) and gpipe["busy_work_s"] == 1.0
    assert gpipe["idle_share_with_transfers"] == pytest.approx(1 - 1 / 1.45, abs=1e-4)
    assert onefb["busy_work_s"] == pytest.approx(1.2)
    assert gpipe["bubble_in_user_cpu_time"] == pytest.approx(0.2)
    assert onefb["bubble_in_user_cpu_time"] is None  # 1F1B idles off the CPU
    assert (
        gpipe["waiting_share"] == pytest.approx(0.09 / 1.4, abs=1e-4)
        and onefb["waiting_share"] == 0.3
    )
    assert gpipe["kernel_share"] == pytest.approx(0.08) and onefb["kernel_share"] == 0.1
    assert onefb["value"] == pytest.approx(1 / 3, abs=1e-4) and not onefb["met"]
    assert loss["value"] == pytest.approx(2e-4) and not loss["met"]
    assert [r[0] for r in rows] == ["gpipe", "1f1b"]
