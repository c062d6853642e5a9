"""docs/moe.md's quickstart command: the tiny MoE LM (4 experts, top-2, capacity dispatch,
expert parallelism on 8 fake devices) learns `synthetic_copy` with balanced experts, and its
MoE metrics reach metrics.jsonl and TensorBoard."""

from __future__ import annotations

import json
import shutil
import struct
from pathlib import Path

import numpy as np
import pytest
from readme_blocks import block, run

MODEL_DIR = Path("/tmp/t5lite_moe_quickstart")  # as configs/moe_quickstart.gin says

# Balanced routing gives max/mean load 1; top-2 of 4 experts collapsed onto two gives E/k = 2
# (an expert is chosen at most once per token, so 2 is the ceiling). The load-balancing loss,
# weighted by moe_aux_loss_coef = 0.01, is E * sum_e f_e P_e; with P following f it exceeds
# its balanced value k by at least k (r - 1)^2 / (E - 1) at max/mean r, i.e. 0.01 * 2/3 = 0.0067
# nats at collapse: a nudge the size of a trained model's last gains in token loss (0.1 nats),
# enough to keep routing away from collapse, not to make it uniform. We ask for the busiest
# expert to carry at most 1.5x its share: halfway from balance to collapse, and the point past
# which the train-time capacity (1.25x a share) drops a sixth of that expert's choices.
MAX_OVER_MEAN = 1.5


def _tb_tags(log_dir: Path) -> set[str]:
    """Scalar tags of the TensorBoard files under `log_dir` (TFRecord framing)."""
    from tensorboardX.proto.event_pb2 import Event

    tags = set()
    for path in sorted(log_dir.glob("events.*")):
        data, at = path.read_bytes(), 0
        while at < len(data):
            (n,) = struct.unpack("<Q", data[at : at + 8])
            event = Event.FromString(data[at + 12 : at + 12 + n])
            tags.update(v.tag for v in event.summary.value)
            at += 12 + n + 4
    return tags


def test_tiny_moe_learns_copy_with_balanced_experts():
    shutil.rmtree(MODEL_DIR, ignore_errors=True)
    out = run(block("docs/moe.md", "moe-quickstart"), timeout=1500)
    records = [json.loads(s) for s in (MODEL_DIR / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in records if r["split"] == "train"]
    evals = [r for r in records if r["split"] == "eval"]
    assert evals and evals[-1]["synthetic_copy/exact_match"] >= 90, evals[-1:]
    layers = [f"moe/decoder/layers_{i}" for i in range(2)]
    # The last tenth of training, per layer: the busiest expert within the bound, and each
    # layer's loads a distribution over the 4 experts.
    tail = train[-len(train) // 10 :]
    for layer in layers:
        ratio = np.mean([r[f"{layer}/load_max_over_mean"] for r in tail])
        assert 1.0 <= ratio < MAX_OVER_MEAN, (layer, ratio)
        loads = [sum(r[f"{layer}/load_e{e}"] for e in range(4)) for r in tail]
        np.testing.assert_allclose(loads, 1.0, rtol=1e-5)
    assert all(0.0 <= r["moe_dropped"] < 0.25 for r in tail)
    pytest.importorskip("tensorboardX")
    tags = _tb_tags(MODEL_DIR / "tensorboard")
    want = {"train/moe_aux_loss", "train/moe_z_loss", "train/moe_dropped"}
    want |= {f"train/{layer}/load_e{e}" for layer in layers for e in range(4)}
    want |= {f"train/{layer}/load_max_over_mean" for layer in layers}
    assert want <= tags, sorted(want - tags)
    assert "predictions:" in out.stderr + out.stdout
