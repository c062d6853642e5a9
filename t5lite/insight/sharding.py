"""The per-parameter sharding report: where every array lives and what it costs per device."""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
from jax.sharding import Mesh

from t5lite.partitioning import Partitioner, Placement


def format_bytes(n: float) -> str:
    """1536 -> '1.50 KiB'."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    raise AssertionError


_fmt_bytes = format_bytes  # older name, still used by insight modules


@dataclasses.dataclass(frozen=True)
class ShardingReport:
    """Placements of a tree of arrays plus totals; `format()` renders the table."""

    mesh_shape: dict[str, int]
    rules: tuple[tuple[str, Any], ...]
    placements: tuple[Placement, ...]

    @property
    def bytes_total(self) -> int:
        return sum(p.bytes_total for p in self.placements)

    @property
    def bytes_per_device(self) -> int:
        return sum(p.bytes_per_device for p in self.placements)

    @property
    def flagged(self) -> tuple[Placement, ...]:
        """Parameters left replicated in some dimension despite a sharding rule."""
        return tuple(p for p in self.placements if p.replicated_despite_rule)

    @property
    def num_parameters(self) -> int:
        return sum(int(p.bytes_total // p.dtype.itemsize) for p in self.placements)

    def to_json(self) -> dict[str, Any]:
        return {
            "mesh": self.mesh_shape,
            "rules": [list(r) for r in self.rules],
            "parameters": [
                {
                    "path": p.path,
                    "shape": list(p.shape),
                    "dtype": str(p.dtype),
                    "logical_axes": list(p.logical_axes) if p.logical_axes is not None else None,
                    "partition_spec": [list(e) if isinstance(e, tuple) else e for e in p.spec],
                    "shard_shape": list(p.shard_shape),
                    "bytes_per_device": p.bytes_per_device,
                    "replicated_despite_rule": list(p.replicated_despite_rule),
                }
                for p in self.placements
            ],
            "bytes_total": self.bytes_total,
            "bytes_per_device": self.bytes_per_device,
        }

    def format(self) -> str:
        """A plain-text table, one row per array, flagged rows marked with `!`."""
        header = (
            "",
            "path",
            "shape",
            "dtype",
            "logical axes",
            "PartitionSpec",
            "shard",
            "bytes/dev",
        )
        rows = [header]
        for p in self.placements:
            axes = "-" if p.logical_axes is None else ",".join(str(a) for a in p.logical_axes)
            spec = ",".join("+".join(e) if isinstance(e, tuple) else str(e) for e in p.spec)
            rows.append(
                (
                    "!" if p.replicated_despite_rule else "",
                    p.path,
                    "x".join(map(str, p.shape)) or "()",
                    str(p.dtype),
                    axes,
                    f"({spec})",
                    "x".join(map(str, p.shard_shape)) or "()",
                    format_bytes(p.bytes_per_device),
                )
            )
        widths = [max(len(r[i]) for r in rows) for i in range(len(header))]
        lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows]
        lines.insert(1, "-" * len(lines[0]))
        mesh = " x ".join(f"{k}={v}" for k, v in self.mesh_shape.items())
        lines += [
            "",
            f"mesh: {mesh}   arrays: {len(self.placements)}   parameters: {self.num_parameters:,}",
            f"bytes in all: {format_bytes(self.bytes_total)}   "
            f"bytes per device: {format_bytes(self.bytes_per_device)}",
        ]
        if self.flagged:
            lines.append(
                f"! {len(self.flagged)} array(s) left replicated in a dimension despite a "
                "sharding rule (its mesh axis was taken by another dimension):"
            )
            for p in self.flagged:
                lines.append(f"    {p.path}: {', '.join(p.replicated_despite_rule)} -> {p.spec}")
        return "\n".join(lines)


def sharding_report(partitioner: Partitioner, abstract_tree: Any, axes_tree: Any) -> ShardingReport:
    """Builds the report for arrays (or `ShapeDtypeStruct`s) described by logical axes."""
    placements = jax.tree_util.tree_leaves(
        partitioner.placements(abstract_tree, axes_tree),
        is_leaf=lambda x: isinstance(x, Placement),
    )
    mesh: Mesh = partitioner.mesh
    return ShardingReport(dict(mesh.shape), partitioner.rules, tuple(placements))
