"""Benchmarks keep running: `--smoke` mode of each benchmark script, in a subprocess."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow  # minutes on 2 cores; the README test command runs it

ROOT = Path(__file__).resolve().parent.parent
RECORD_KEYS = {"benchmark", "date", "machine", "versions", "figures"}
FIGURE_KEYS = {"name", "value", "unit", "reference", "ratio", "goal", "met"}


def test_train_throughput_smoke(tmp_path):
    # Runs on one real CPU device: drop the fake-device flag conftest sets for this process.
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    env["JAX_PLATFORMS"] = "cpu"
    out = tmp_path / "train_throughput.json"
    # Without torch the smoke mode runs the two JAX sides only (PyTorch figures left out).
    proc = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "train_throughput.py"), "--smoke",
         "--out", str(out)],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    record = json.loads(out.read_text())
    assert set(record) >= RECORD_KEYS
    assert record["benchmark"] == "train_throughput"
    names = {f["name"] for f in record["figures"]}
    assert {"t5lite_train_tokens_per_s", "t5lite_step_s_vs_bare_jit"} <= names
    for fig in record["figures"]:
        assert set(fig) >= FIGURE_KEYS, fig
        assert fig["value"] > 0


def test_train_loop_quick(tmp_path):
    out = tmp_path / "train_loop.json"
    proc = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "train_loop.py"), "--quick", "--out", str(out)],
        cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)}, capture_output=True, text=True,
        timeout=900,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    record = json.loads(out.read_text())
    assert set(record) >= RECORD_KEYS and record["benchmark"] == "train_loop"
    loop = next(f for f in record["figures"] if f["name"] == "train_loop_steps_per_s")
    assert set(loop) >= FIGURE_KEYS and loop["value"] > 0 and loop["reference"] > 0
    assert loop["goal"] == "<= 1.03"
    # --quick: 3 loop blocks, each between two bare blocks, and a ratio per loop block
    assert len(record["seconds_per_step"]["loop"]) == 3
    assert len(record["seconds_per_step"]["bare"]) == 4
    assert len(record["block_ratios"]) == 3 and all(r > 0 for r in record["block_ratios"])


def test_memory_accuracy_smoke(tmp_path):
    out = tmp_path / "memory_accuracy.json"
    proc = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "memory_accuracy.py"), "--smoke",
         "--out", str(out)],
        cwd=ROOT, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    record = json.loads(out.read_text())
    assert record["benchmark"] == "memory_accuracy" and len(record["figures"]) == 2
    for fig in record["figures"]:
        assert set(fig) >= FIGURE_KEYS and fig["met"], fig


def test_decode_smoke_against_transformers(tmp_path):
    pytest.importorskip("transformers", reason="needs the [hf] extra")
    out = tmp_path / "decode.json"
    proc = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "decode.py"), "--smoke", "--out", str(out)],
        cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)}, capture_output=True, text=True,
        timeout=600,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    record = json.loads(out.read_text())
    figures = {f["name"]: f for f in record["figures"]}
    for method in ("greedy", "beam4"):
        fig = figures[f"{method}_tokens_per_s_vs_transformers"]
        assert fig["value"] > 0 and fig["reference"] > 0 and fig["goal"] == ">= 1.5"
    assert record["settings"]["same_tokens_as_hf"]["greedy"] is True  # else the run fails
    assert {"torch", "transformers"} <= set(record["versions"])


def test_long_context_smoke_chunked_attention_needs_less_memory(tmp_path):
    # Also runs benchmarks/accelerator.py's per-implementation processes on the CPU.
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    env["JAX_PLATFORMS"] = "cpu"
    out = tmp_path / "long_context.json"
    proc = subprocess.run(
        [
            sys.executable,
            str(ROOT / "benchmarks" / "long_context.py"),
            "--smoke",
            "--out",
            str(out),
        ],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    record = json.loads(out.read_text())
    assert set(record) >= RECORD_KEYS and record["benchmark"] == "long_context"
    assert [r["length"] for r in record["rows"]] == [256, 512]
    for fig in record["figures"]:
        assert set(fig) >= FIGURE_KEYS, fig
    longest = record["rows"][-1]
    assert longest["chunked_mib"] < longest["xla_mib"], longest


def test_moe_smoke(tmp_path):
    out = tmp_path / "moe.json"
    proc = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "moe.py"), "--smoke", "--out", str(out)],
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    record = json.loads(out.read_text())
    assert set(record) >= RECORD_KEYS and record["benchmark"] == "moe"
    names = [f["name"] for f in record["figures"]]
    assert names == [
        "moe_vs_dense_same_active_step_time",
        "dropless_vs_capacity_step_time",
        "expert_parallel_vs_replicated_experts_step_time",
    ]
    for fig in record["figures"]:
        assert set(fig) >= FIGURE_KEYS and fig["value"] > 0 and fig["reference"] > 0
        assert fig["ratio"] == pytest.approx(fig["value"] / fig["reference"], rel=1e-2)
    # The dense reference has the MoE's active parameters: the same model FLOPs per token but
    # the router's 6 * D * E per MoE layer (smoke: 1 layer, D = 32, E = 8).
    flops = record["settings"]["train_flops_per_token"]
    assert flops["moe_capacity"] - flops["dense_same_active"] == 6 * 32 * 8
    assert "data=4 x model=2" in record["machine"]


def _accelerator_smoke(tmp_path, *args: str) -> tuple[subprocess.CompletedProcess, dict]:
    """benchmarks/accelerator.py --smoke with `args`: its output and its record."""
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    out = tmp_path / "accelerator.json"
    cmd = [sys.executable, str(ROOT / "benchmarks" / "accelerator.py"), "--smoke", *args,
           "--out", str(out)]  # fmt: skip
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc, json.loads(out.read_text())


@pytest.mark.skipif(
    not __import__("t5lite.insight.topology", fromlist=["x"]).libtpu_available(),
    reason='libtpu not installed (pip install -e ".[tpu]")',
)
def test_accelerator_topology_smoke_is_labelled_an_estimate(tmp_path):
    """`--topology` compiles the step for a TPU slice and reports a roofline estimate: the
    time is the larger of FLOPs / peak and bytes / HBM bandwidth of v5e (197 TFLOP/s, 819 GB/s
    in t5lite.insight.hardware), checked here from the record's own compiled figures."""
    proc, record = _accelerator_smoke(tmp_path, "--topology", "v5e:2x2")
    assert "ESTIMATE from the compiled cost analysis" in proc.stdout
    (r,) = record["results"]
    assert r["estimate"] is True and r["devices"] == 4 and "estimate" in record["machine"]
    from t5lite.insight.hardware import TPU_CHIPS

    chip = TPU_CHIPS["v5e"]
    want_s = max(
        r["compiled_flops"] / chip.peak_flops, r["compiled_bytes_accessed"] / chip.hbm_bytes_per_s
    )
    assert r["estimated_step_ms"] == pytest.approx(1e3 * want_s, rel=1e-9)
    (fig,) = record["figures"]
    assert fig["value"] == r["estimated_mfu"] and 0 < fig["value"] < 1


def test_accelerator_times_steps_synced_and_back_to_back(tmp_path):
    """Each implementation's steps are timed one by one (synced) and as a loop synced once."""
    proc, record = _accelerator_smoke(tmp_path, "--attention", "xla")
    (r,) = record["results"]
    tokens = 2 * 64  # the smoke preset's batch x length
    for prefix in ("", "loop_"):
        ms = r[f"{prefix}step_ms"]
        assert ms > 0 and r[f"{prefix}tokens_per_s"] == pytest.approx(1e3 * tokens / ms)
    assert f"(loop {r['loop_step_ms']:.1f} ms/step" in proc.stdout


def test_accelerator_refuses_an_unknown_remat_policy_in_one_line():
    cmd = [sys.executable, str(ROOT / "benchmarks" / "accelerator.py"), "--remat", "full,nope"]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    last = proc.stderr.strip().splitlines()[-1]
    assert last.endswith("--remat 'full,nope': each policy must be one of none, minimal, full")
    assert "Traceback" not in proc.stderr


def test_tensor_nd_smoke(tmp_path):
    out = tmp_path / "tensor_nd.json"
    proc = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "tensor_nd.py"), "--smoke", "--out", str(out)],
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    record = json.loads(out.read_text())
    assert set(record) >= RECORD_KEYS and record["benchmark"] == "tensor_nd"
    schemes = ["megatron", "summa_2d", "tensor_3d"]
    names = [f["name"] for f in record["figures"]]
    assert names == [f"{s} step on 8 fake CPU devices" for s in schemes]
    for fig in record["figures"]:
        assert set(fig) >= FIGURE_KEYS and fig["value"] > 0 and fig["reference"] > 0
        assert fig["ratio"] == pytest.approx(fig["value"] / fig["reference"], rel=1e-2)
    assert record["figures"][0]["value"] == record["figures"][0]["reference"]
    # The same model, seed and batch: every layout's first loss is data parallel's.
    losses = record["first_loss"]
    assert set(losses) == set(schemes)
    assert losses["summa_2d"] == pytest.approx(losses["megatron"], rel=1e-4)
    assert losses["tensor_3d"] == pytest.approx(losses["megatron"], rel=1e-4)
    # Analytic part: ≈1B and ≈7B on 8 and 64 chips, each a ranking of the three schemes, fastest
    # first, with the same compute (step - communication) for all three.
    rows = record["analytic"]
    groups = {(r["model"], r["chips"]) for r in rows}
    assert groups == {(m, c) for m in ("≈1B", "≈7B") for c in (8, 64)}
    for model, chips in groups:
        ranked = [r for r in rows if (r["model"], r["chips"]) == (model, chips)]
        assert [r["rank"] for r in ranked] == [1, 2, 3]
        assert sorted(r["scheme"] for r in ranked) == sorted(schemes)
        steps = [r["step_s"] for r in ranked]
        assert steps == sorted(steps)
        compute = {round(r["step_s"] - r["communication_s"], 9) for r in ranked}
        assert len(compute) == 1, compute
        group = {r["scheme"]: r["tensor_devices"] for r in ranked}
        assert group == {"megatron": chips, "summa_2d": 4 if chips == 8 else 64, "tensor_3d": chips}
        for r in ranked:
            assert r["params_per_device"] == pytest.approx(1 / r["tensor_devices"])
            act = 1.0 if r["scheme"] == "megatron" else 1 / r["tensor_devices"]
            assert r["activations_per_device"] == pytest.approx(act)
