"""An analytic step time and MFU for one layout on one device kind, without compiling.

A roofline without overlap: the step takes the longer of its compute (FLOPs over peak FLOP/s)
and its memory traffic (bytes over HBM bandwidth), plus its communication (collective bytes
over link bandwidth). Compilers overlap some communication with compute, so this errs slow; it
is meant to rank layouts and to say "hours or days", not to replace a profile.
"""

from __future__ import annotations

import dataclasses

from t5lite.insight.communication import AnalyticCommunication
from t5lite.insight.flops import transformer_train_flops
from t5lite.insight.hardware import DeviceSpec
from t5lite.insight.memory import PredictedMemory
from t5lite.insight.sharding import ShardingReport
from t5lite.insight.slices import dcn_axes, expected_dcn_bytes, link_seconds, mesh_slices
from t5lite.trainer import Trainer

# Full remat runs each layer's forward twice: 4 forward-equivalents instead of 3.
_REMAT_RECOMPUTE = {"none": 1.0, "minimal": 1.0, "full": 4 / 3}


@dataclasses.dataclass(frozen=True)
class StepEstimate:
    """Per-device figures of one train step, analytic."""

    model_flops: float  # what MFU counts: the model's matmul FLOPs, no recompute
    hardware_flops: float  # what the chip runs: with the remat policy's recompute
    hbm_bytes: float  # state, gradients and saved activations, each written and read once
    link_bytes: float  # sent per device, ring algorithms
    compute_s: float | None
    hbm_s: float | None
    communication_s: float | None
    dcn_bytes: float = 0.0  # the part of `link_bytes` that crosses slices (slices.py)

    @property
    def step_s(self) -> float | None:
        if self.compute_s is None or self.hbm_s is None or self.communication_s is None:
            return None
        return max(self.compute_s, self.hbm_s) + self.communication_s

    def mfu(self, peak_flops: float | None) -> float | None:
        """Model FLOPs per second over the device's peak (None when either is unknown)."""
        if not peak_flops or not self.step_s:
            return None
        return self.model_flops / self.step_s / peak_flops


def estimate_step(
    trainer: Trainer,
    predicted: PredictedMemory,
    analytic: AnalyticCommunication,
    report: ShardingReport,
    device: DeviceSpec,
) -> StepEstimate:
    """The analytic step of `trainer` on `device` (times None where the device's figure is)."""
    cfg = trainer.model.network_config
    lengths = trainer.lengths
    per_example = transformer_train_flops(cfg, lengths.get("inputs", 0), lengths["targets"])
    num_devices = trainer.partitioner.mesh.devices.size
    model_flops = trainer.batch_size * per_example / num_devices
    hardware_flops = model_flops * _REMAT_RECOMPUTE.get(cfg.remat_policy, 1.0)
    hbm = 2.0 * (predicted.state + predicted.gradients + predicted.update + predicted.activations)
    # Ring-algorithm bytes of every collective the layout implies (communication.py's model).
    link = sum(e.link_bytes for e in analytic.expected)
    mesh = trainer.partitioner.mesh
    dcn = expected_dcn_bytes(analytic.expected, dcn_axes(mesh, mesh_slices(mesh, device)))

    def over(x: float, rate: float | None) -> float | None:
        return x / rate if rate else None

    return StepEstimate(
        model_flops=model_flops,
        hardware_flops=hardware_flops,
        hbm_bytes=hbm,
        link_bytes=link,
        compute_s=over(hardware_flops, device.peak_flops),
        hbm_s=over(hbm, device.hbm_bytes_per_s),
        communication_s=link_seconds(link, dcn, device),
        dcn_bytes=dcn,
    )
