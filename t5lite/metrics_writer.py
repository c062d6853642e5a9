"""Training logs: progress bar or plain lines, metrics.jsonl, TensorBoard events, and MFU.

Only process 0 writes; other processes get a writer that does nothing.
"""

from __future__ import annotations

import json
import math
import os
import sys
import time
from collections.abc import Mapping
from typing import Any

# Dense bf16 peak FLOP/s per device, from the vendors' data sheets (no sparsity). MFU is
# reported as unavailable for devices not listed here (CPUs among them).
PEAK_FLOPS_PER_DEVICE: Mapping[str, float] = {
    "TPU v4": 275e12,
    "TPU v5 lite": 197e12,  # v5e
    "TPU v5": 459e12,  # v5p
    "TPU v6 lite": 918e12,  # v6e (Trillium)
    "NVIDIA A100-SXM4-40GB": 312e12,
    "NVIDIA A100-SXM4-80GB": 312e12,
    "NVIDIA H100 80GB HBM3": 989e12,
    "NVIDIA H200": 989e12,
}


def peak_flops(device_kind: str) -> float | None:
    """The table's peak for a `jax.Device.device_kind`, or None if unknown."""
    return PEAK_FLOPS_PER_DEVICE.get(device_kind)


def transformer_train_flops(config: Any, input_len: int, target_len: int) -> float:
    """Analytic FLOPs of one training example (forward + backward = 3 × forward).

    Counts every matmul (2 FLOPs per multiply-add) including attention scores and values and
    the output logits; ignores norms, softmax and element-wise work.
    """
    d, h, k, f, v = (
        config.emb_dim,
        config.num_heads,
        config.head_dim,
        config.mlp_dim,
        config.vocab_size,
    )
    n_mlp_in = len(config.mlp_activations)
    kv_heads = getattr(config, "num_kv_heads", h) or h
    mlp = 2 * (n_mlp_in * d * f + f * d)
    attn_proj = 2 * (d * h * k + 2 * d * kv_heads * k + h * k * d)

    def attn_scores(q_len: int, kv_len: int) -> float:
        return 2 * 2 * q_len * kv_len * h * k  # QK^T and AV

    if hasattr(config, "num_encoder_layers"):
        s, t = input_len, target_len
        enc = config.num_encoder_layers * (s * (mlp + attn_proj) + attn_scores(s, s))
        cross_q_o = 2 * (2 * d * h * k)
        cross_kv = 2 * (2 * d * h * k)
        dec = config.num_decoder_layers * (
            t * (mlp + attn_proj + cross_q_o) + s * cross_kv + attn_scores(t, t) + attn_scores(t, s)
        )
        logits = 2 * t * d * v
        fwd = enc + dec + logits
    else:
        t = input_len + target_len
        fwd = config.num_layers * (t * (mlp + attn_proj) + attn_scores(t, t)) + 2 * t * d * v
    return 3.0 * fwd


class MetricsWriter:
    """Writes step metrics to the terminal, `metrics.jsonl` and TensorBoard (process 0 only)."""

    def __init__(
        self,
        model_dir: str,
        *,
        total_steps: int,
        enabled: bool = True,
        log_period: int = 10,
        stream: Any = None,
    ):
        self.enabled = enabled
        self.total_steps = total_steps
        self.log_period = max(1, log_period)
        self.stream = stream or sys.stderr
        self.tty = hasattr(self.stream, "isatty") and self.stream.isatty()
        self._start = time.time()
        self._jsonl = None
        self._tb = None
        if not enabled:
            return
        os.makedirs(model_dir, exist_ok=True)
        self._jsonl = open(os.path.join(model_dir, "metrics.jsonl"), "a")  # noqa: SIM115
        try:
            from tensorboardX import SummaryWriter

            self._tb = SummaryWriter(os.path.join(model_dir, "tensorboard"))
        except ImportError:  # optional: JSONL is always written
            self._tb = None

    def write(self, step: int, metrics: Mapping[str, float], prefix: str = "train") -> None:
        """Records one step's (or one eval's) metrics."""
        if not self.enabled:
            return
        record = {"step": step, "split": prefix, **{k: _num(v) for k, v in metrics.items()}}
        assert self._jsonl is not None
        self._jsonl.write(json.dumps(record) + "\n")
        self._jsonl.flush()
        if self._tb is not None:
            for k, v in metrics.items():
                if isinstance(v, int | float) and math.isfinite(v):
                    self._tb.add_scalar(f"{prefix}/{k}", v, step)
        if prefix != "train" or step % self.log_period == 0 or step == self.total_steps:
            self._print(step, metrics, prefix)

    def _print(self, step: int, metrics: Mapping[str, float], prefix: str) -> None:
        shown = " ".join(
            f"{k}={_fmt(v)}"
            for k, v in metrics.items()
            if k in ("loss", "accuracy", "learning_rate", "tokens_per_s", "seqs_per_s",
                     "step_time_s", "mfu") or prefix != "train"
        )  # fmt: skip
        if prefix == "train" and self.tty:
            done = step / max(self.total_steps, 1)
            elapsed = time.time() - self._start
            eta = elapsed / max(done, 1e-9) * (1 - done)
            bar = "#" * int(30 * done) + "." * (30 - int(30 * done))
            self.stream.write(f"\r[{bar}] {step}/{self.total_steps} ETA {eta:5.0f}s {shown}")
            if step == self.total_steps:
                self.stream.write("\n")
        else:
            self.stream.write(f"{prefix} step {step}/{self.total_steps}: {shown}\n")
        self.stream.flush()

    def info(self, text: str) -> None:
        if self.enabled:
            if self.tty:
                self.stream.write("\n")
            self.stream.write(text + "\n")
            self.stream.flush()

    def close(self) -> None:
        if self._jsonl is not None:
            self._jsonl.close()
        if self._tb is not None:
            self._tb.close()


def _num(v: Any) -> Any:
    if isinstance(v, int | float | str) or v is None:
        return v
    return float(v)


def _fmt(v: Any) -> str:
    if isinstance(v, str) or v is None:
        return str(v)
    v = float(v)
    if v == 0 or 1e-3 <= abs(v) < 1e5:
        return f"{v:.4g}"
    return f"{v:.3e}"
