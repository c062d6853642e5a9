"""ZeRO-3's gradient volume over the batch axes, per layer, beside the compiled step's
reduce-scatters (printed by `inspect` under FSDP rules)."""

from __future__ import annotations

import collections
import dataclasses
import math
import re
from collections.abc import Sequence

from t5lite.insight.hlo import CollectiveRow
from t5lite.insight.sharding import ShardingReport, format_bytes
from t5lite.partitioning import mesh_axes_of


def _split(mesh_shape: dict[str, int], axes) -> int:
    return math.prod(mesh_shape[t] for t in axes)


@dataclasses.dataclass(frozen=True)
class Zero3Figures:
    """ZeRO-3's gradient volume over the batch axes: the dense layers' kernels split over them
    are gathered per use inside each layer (t5lite/collectives.py), so each kernel's gradient
    leaves through one reduce-scatter to this device's shard. Bytes are results per device, in
    the parameters' dtype (a ring reduce-scatter sends (n-1) times its result)."""

    axes: tuple[str, ...]
    group_size: int
    count: int  # kernels (one reduce-scatter each per step; a scanned stack counts per layer)
    bytes: int  # their results per device, all layers
    layers: tuple[tuple[str, int, int], ...]  # (layer, how many alike, bytes of one)


_LAYER_RE = re.compile(r"^layers(_\d+)?$")


def zero3_figures(
    report: ShardingReport, mesh_shape: dict[str, int], batch_axes: tuple[str, ...]
) -> Zero3Figures | None:
    """The figures when dense kernels are split over the batch axes (FSDP tables); else None.
    Other parameters split so (norm scales, embeddings) are not gathered per use by a layer."""
    per_layer: dict[str, int] = collections.defaultdict(int)
    count, total = 0, 0
    for p in report.placements:
        used = {t for e in p.spec for t in mesh_axes_of(e) if mesh_shape.get(t, 1) > 1}
        if not p.path.endswith("/kernel") or len(p.shape) < 2 or not used & set(batch_axes):
            continue
        parts = p.path.split("/")
        cut = next((i for i, x in enumerate(parts) if _LAYER_RE.match(x)), len(parts) - 2)
        n = 1
        if p.logical_axes and "layers" in p.logical_axes:  # a scanned stack: one per layer
            n = p.shape[p.logical_axes.index("layers")]
        count += n
        total += p.bytes_per_device
        for i in range(n):
            layer = "/".join(parts[: cut + 1]) + (f"[{i}]" if n > 1 else "")
            per_layer[layer] += p.bytes_per_device // n
    if not count:
        return None
    alike: dict[tuple[str, int], int] = collections.Counter(
        (re.sub(r"layers_\d+|\[\d+\]", "layers_N", k), v) for k, v in per_layer.items()
    )
    layers = tuple((name, n, b) for (name, b), n in alike.items())
    return Zero3Figures(batch_axes, _split(mesh_shape, batch_axes), count, total, layers)


def format_zero3(z: Zero3Figures, rows: Sequence[CollectiveRow] | None) -> list[str]:
    """Lines for a report: the per-layer ZeRO-3 volume and, compiled, the step's reduce-scatters
    over the same axes beside it."""
    axes, sent = "+".join(z.axes), (z.group_size - 1)
    lines = [
        f"ZeRO-3 over {axes} ({z.group_size} devices), each dense kernel's gradient "
        "reduce-scattered; results per device:",
        *(
            f"  {name:<32}{format_bytes(b):>11}" + (f"  per layer, x{n}" if n > 1 else "")
            for name, n, b in z.layers
        ),
        f"  analytic: {z.count} reduce-scatters, {format_bytes(z.bytes)} "
        f"({format_bytes(sent * z.bytes)} sent)",
    ]
    if rows is not None:
        mine = [r for r in rows if r.kind == "reduce-scatter" and set(r.axes or ()) == set(z.axes)]
        n, got = sum(r.count for r in mine), sum(r.bytes for r in mine)
        ratio = got / z.bytes
        verdict = "agrees" if abs(ratio - 1) <= 0.10 else "differs"
        lines.append(
            f"  compiled: {n} reduce-scatters, {format_bytes(got)} "
            f"({format_bytes(sum(r.link_bytes for r in mine))} sent): ratio {ratio:.2f}, {verdict}"
        )
    return lines
