"""The per-parameter sharding report: where every array lives and what it costs per device."""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
from jax.sharding import Mesh

from t5lite.insight.tables import elide, fold_indices, format_table, layer_pattern, natural_key
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

    def format(self, width: int | None = None, fold: bool = False) -> str:
        """A plain-text table, one row per array in natural order (layers_2 before layers_10),
        flagged rows marked with `!`.

        Args:
          width: at most this many columns (long paths and axes are cut in their middle);
            None: no limit.
          fold: arrays of identical layers share one row, `layers_0..23` with a count `×24`.
        """
        groups: dict[tuple, list[tuple[int | None, Placement]]] = {}
        for p in self.placements:
            pattern, index = layer_pattern(p.path) if fold else (p.path, None)
            key = (
                pattern,
                p.shape,
                str(p.dtype),
                p.logical_axes,
                p.spec,
                p.shard_shape,
                bool(p.replicated_despite_rule),
            )
            groups.setdefault(key, []).append((index, p))
        dtypes = {str(p.dtype) for p in self.placements}
        flags = any(p.replicated_despite_rule for p in self.placements)
        # Columns that say nothing here are left out when the width is limited.
        show_dtype, show_flag = width is None or len(dtypes) > 1, width is None or flags
        # Limited width: one "logical:mesh" column instead of logical axes and PartitionSpec.
        joined = width is not None
        header = (
            "",
            "path",
            "n",
            "shape",
            "dtype",
            "logical axes",
            "PartitionSpec",
            "logical:mesh axes",
            "shard",
            "bytes/dev",
        )
        rows = [_row(key[0], members) for key, members in groups.items()]
        rows.sort(key=lambda r: natural_key(r[1]))
        shown = (
            show_flag,
            True,
            fold,
            True,
            show_dtype,
            not joined,
            not joined,
            joined,
            True,
            True,
        )
        keep = [i for i, k in enumerate(shown) if k]
        table = [tuple(r[i] for i in keep) for r in [header, *rows]]
        shrink = tuple(keep.index(i) for i in (1, 5, 6, 7) if i in keep)
        lines = format_table(table, max_width=width, shrink=shrink, paths=(keep.index(1),))
        if not show_dtype:
            lines.insert(0, f"parameters (every one {dtypes.pop()}):")
        mesh = " x ".join(f"{k}={v}" for k, v in self.mesh_shape.items())
        lines += [
            "",
            f"mesh: {mesh}   arrays: {len(self.placements)}   parameters: {self.num_parameters:,}",
            f"bytes in all: {format_bytes(self.bytes_total)}   "
            f"bytes per device: {format_bytes(self.bytes_per_device)}",
        ]
        if fold and len(rows) < len(self.placements):
            lines.append("n: arrays sharing the row (identical layers); bytes/dev: of all n")
        if self.flagged:
            lines.append(
                f"! {len(self.flagged)} array(s) left replicated in a dimension despite a "
                "sharding rule (its mesh axis was taken by another dimension):"
            )
            for p in self.flagged[: 5 if width else None]:
                line = f"    {p.path}: {', '.join(p.replicated_despite_rule)} -> {p.spec}"
                lines.append(elide(line, width) if width else line)
            if width and len(self.flagged) > 5:
                lines.append(f"    ... and {len(self.flagged) - 5} more (--wide lists them)")
        return "\n".join(lines)


def sharding_report(partitioner: Partitioner, abstract_tree: Any, axes_tree: Any) -> ShardingReport:
    """Builds the report for arrays (or `ShapeDtypeStruct`s) described by logical axes."""
    placements = jax.tree_util.tree_leaves(
        partitioner.placements(abstract_tree, axes_tree),
        is_leaf=lambda x: isinstance(x, Placement),
    )
    mesh: Mesh = partitioner.mesh
    return ShardingReport(dict(mesh.shape), partitioner.rules, tuple(placements))


def _row(pattern: str, members: list[tuple[int | None, Placement]]) -> tuple[str, ...]:
    """One table row for identical arrays (the layers folded into `pattern`)."""
    p = members[0][1]
    indices = [i for i, _ in members if i is not None]
    path = pattern.format(fold_indices(indices)) if indices else pattern
    axes = "-" if p.logical_axes is None else ",".join(str(a) for a in p.logical_axes)
    parts = ["+".join(e) if isinstance(e, tuple) else str(e) for e in p.spec]
    names = p.logical_axes or ("?",) * len(parts)
    mapping = ",".join(f"{a}:{m}" if m != "None" else str(a) for a, m in zip(names, parts))
    return (
        "!" if p.replicated_despite_rule else "",
        path,
        f"×{len(members)}",
        "x".join(map(str, p.shape)) or "()",
        str(p.dtype),
        axes,
        f"({','.join(parts)})",
        mapping or "-",
        "x".join(map(str, p.shard_shape)) or "()",
        format_bytes(p.bytes_per_device * len(members)),
    )
