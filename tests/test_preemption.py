"""SIGTERM to every process of a 2-process run, or to one of them: one committed checkpoint at a
step all processes agree on, and every process exits 0 (through the CLI, as on a cluster)."""

from __future__ import annotations

import json
import signal
import time
from pathlib import Path

import pytest
from test_multihost import _start_multi

pytestmark = pytest.mark.slow  # two processes training for a while


def _latest_logged_step(model_dir: Path) -> int:
    path = model_dir / "metrics.jsonl"
    if not path.exists():
        return 0
    steps = [json.loads(line)["step"] for line in path.read_text().splitlines() if line]
    return max(steps, default=0)


@pytest.mark.parametrize("who", ["all", "one"])
def test_sigterm_saves_one_agreed_checkpoint_and_exits_0(tmp_path, who):
    d = tmp_path / "run"
    procs = _start_multi(d, 100000, "--gin.CheckpointConfig.period=0")
    try:
        deadline = time.time() + 300
        while _latest_logged_step(d) < 3:  # training, past compilation
            assert time.time() < deadline and all(p.poll() is None for p in procs)
            time.sleep(0.5)
        targets = procs if who == "all" else procs[1:]  # one: the process that does not log
        for p in targets:
            p.send_signal(signal.SIGTERM)
        outs = [p.communicate(timeout=300) for p in procs]
    finally:
        for p in procs:
            p.kill()
    for p, (_, err) in zip(procs, outs):
        assert p.returncode == 0, err[-3000:]
    steps = sorted(q.name for q in d.glob("checkpoint_*"))
    assert len(steps) == 1 and not steps[0].endswith(".tmp"), steps
    step = int(steps[0].split("_")[1])
    assert (d / steps[0] / "COMMIT").is_file() and step >= 3
    assert f"stopped at step {step}; checkpoint committed" in outs[0][1]
