"""Communication of the train step: compiled collectives grouped per kind and mesh axis, their
ring-algorithm link bytes, and Mesh-TensorFlow's analytic volume for the layout.
"""

from __future__ import annotations

import collections
import dataclasses
import math
from collections.abc import Sequence
from typing import Any

import numpy as np

from t5lite.insight.hlo import KINDS, Collective
from t5lite.insight.memory import rule_of
from t5lite.insight.sharding import ShardingReport
from t5lite.partitioning import mesh_axes_of
from t5lite.trainer import Trainer


@dataclasses.dataclass(frozen=True)
class CollectiveRow:
    """All collectives of one kind over the same mesh axes."""

    kind: str
    axes: tuple[str, ...] | None
    count: int
    bytes: int  # sum of their result sizes per device
    link_bytes: float  # bytes each device sends over its links (ring algorithms)

    @property
    def axes_str(self) -> str:
        return "?" if self.axes is None else ("+".join(self.axes) or "-")


def _link_bytes(c: Collective) -> float:
    """Bytes one device sends for `c` with ring algorithms (results sized per device)."""
    n = c.group_size
    if n <= 1:
        return 0.0
    if c.kind == "all-reduce":
        return 2 * (n - 1) / n * c.bytes
    if c.kind == "reduce-scatter":  # the result is the 1/n shard of the reduced input
        return (n - 1) * c.bytes
    if c.kind in ("all-gather", "all-to-all"):
        return (n - 1) / n * c.bytes
    return float(c.bytes)  # collective-permute: each device sends its buffer once


def collective_rows(collectives: Sequence[Collective]) -> list[CollectiveRow]:
    """Collectives grouped by (kind, mesh axes), kinds in `KINDS` order."""
    groups: dict[tuple[str, Any], list[Collective]] = collections.defaultdict(list)
    for c in collectives:
        groups[(c.kind, c.axes)].append(c)
    rows = [
        CollectiveRow(k, a, len(cs), sum(c.bytes for c in cs), sum(map(_link_bytes, cs)))
        for (k, a), cs in groups.items()
    ]
    return sorted(rows, key=lambda r: (KINDS.index(r.kind), str(r.axes)))


def communication_seconds(collectives: Sequence[Collective], link_bytes_per_s: float) -> float:
    """Time to run every collective one after another at `link_bytes_per_s` per device."""
    return sum(map(_link_bytes, collectives)) / link_bytes_per_s


@dataclasses.dataclass(frozen=True)
class AnalyticCommunication:
    """Mesh-TensorFlow Table 1 for one layout: bytes per device per training step.

    data_axes_bytes: gradients reduced over the batch's mesh axes, i.e. the parameter bytes of
      one model-parallel shard (plus, for 2D parameters, the weights gathered back forward and
      backward).
    model_axis_bytes: activations [B/data, L, D] of every split block, all-reduced over `model`
      once forward and once backward (Megatron: one per attention or MLP block).
    """

    data_axes: tuple[str, ...]
    data_axes_bytes: int
    model_axis_bytes: int

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def analytic_communication(trainer: Trainer, report: ShardingReport) -> AnalyticCommunication:
    """Per-device communication the layout implies, before any compiler gets to it."""
    part = trainer.partitioner
    mesh_shape = dict(part.mesh.shape)
    batch_axes = tuple(t for t in mesh_axes_of(part.data_partition_spec[0]) if mesh_shape[t] > 1)
    data_bytes = 0
    if batch_axes:
        for p in report.placements:
            used = {t for e in p.spec for t in mesh_axes_of(e)}
            # The gradient of the part of p one batch group shares: sharded over model axes only.
            model_split = math.prod(mesh_shape[t] for t in used if t not in batch_axes)
            grad = p.bytes_total // model_split
            data_bytes += grad
            if used & set(batch_axes):  # 2D parameters: gathered for forward and backward
                data_bytes += 2 * grad
    model_axes = tuple(
        t for t in mesh_axes_of(rule_of(part, "mlp")) if mesh_shape[t] > 1 and t not in batch_axes
    )
    model_bytes = 0
    if model_axes:
        cfg = trainer.model.network_config
        b = trainer.batch_size // part.data_parallel_size
        act = np.dtype(cfg.policy.compute).itemsize * cfg.emb_dim * b
        if hasattr(cfg, "num_encoder_layers"):
            blocks = cfg.num_encoder_layers * 2 * trainer.lengths["inputs"]
            blocks += cfg.num_decoder_layers * 3 * trainer.lengths["targets"]
        else:
            blocks = cfg.num_layers * 2 * trainer.lengths["targets"]
        model_bytes = 2 * blocks * act  # forward and backward
    return AnalyticCommunication(batch_axes, data_bytes, model_bytes)
