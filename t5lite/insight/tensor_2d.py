"""2D tensor parallelism's communication for one MLP layer: the layout the rules give against
SUMMA / Optimus and 1D Megatron (the analytic communication's notes under the `model` row)."""

from __future__ import annotations

import dataclasses
import math

from t5lite.partitioning import mesh_axes_of, resolve_logical_axes
from t5lite.trainer import Trainer


def _split(mesh_shape: dict[str, int], axes) -> int:
    return math.prod(mesh_shape[t] for t in axes)


@dataclasses.dataclass(frozen=True)
class Tensor2DFigures:
    """One MLP layer's forward, per device, in elements: this 2D layout, SUMMA, 1D Megatron.

    For `[T, D] x [D, F]` then `[T, F] x [F, D]` (a gated MLP has `n_in` input matrices) on a
    `data = d` x `model = m` mesh. `received_*`: elements each device receives (ring
    collectives: (n-1)/n of the gathered or reduced array). `weights_*` / `activations_*`:
    weight and residual-stream elements each device holds.
    """

    d: int
    m: int
    tokens: int  # T: tokens of the global batch through the layer
    emb: int  # D
    mlp: int  # F
    n_in: int
    received_2d: float  # rules-only 2D (GSPMD): weights gathered over data, x over model
    received_summa: float | None  # SUMMA on a q x q grid (None unless d == m)
    received_megatron: float  # 1D: one all-reduce of [T/d, D] over model
    weights_2d: int
    weights_megatron: int
    activations_2d: int
    activations_megatron: int


def tensor_2d_mlp_figures(trainer: Trainer) -> Tensor2DFigures | None:
    """The figures when both the weights' `embed` and the activations' `embed` are split (the
    `tensor_2d` / `fully_sharded` table) over mesh axes of size > 1; None otherwise."""
    part, cfg = trainer.partitioner, trainer.model.network_config
    shape = dict(part.mesh.shape)
    w_spec, _ = resolve_logical_axes(("embed", "mlp"), part.rules)
    x_spec, _ = resolve_logical_axes(("batch", "length", "embed"), part.rules)
    w_axes, x_axes = mesh_axes_of(w_spec[0]), mesh_axes_of(x_spec[2])
    f_axes = mesh_axes_of(w_spec[1])
    if not (w_axes and x_axes and f_axes == x_axes) or set(w_axes) & set(x_axes):
        return None
    d, m = _split(shape, w_axes), _split(shape, x_axes)
    if d == 1 or m == 1:
        return None
    length = trainer.lengths.get("inputs") or trainer.lengths["targets"]
    t, emb, f = trainer.batch_size * length, cfg.emb_dim, cfg.mlp_dim
    n_in = len(cfg.mlp_activations)
    weights = (n_in + 1) * emb * f
    received_2d = (d - 1) / d * weights / m + 2 * (m - 1) / m * t * emb / d
    summa = None
    if d == m:
        q = d
        summa = (q - 1) / q**2 * (n_in * (t * emb + emb * f) + (t * f + emb * f))
    return Tensor2DFigures(
        d,
        m,
        t,
        emb,
        f,
        n_in,
        received_2d,
        summa,
        2 * (m - 1) / m * t * emb / d,
        weights // (d * m),
        weights // m,
        t * emb // (d * m),
        t * emb // d,
    )


def format_tensor_2d(x: Tensor2DFigures) -> list[str]:
    """Lines for a report: one MLP layer forward, this layout against the papers' formulas."""

    def row(name: str, received: float | None, weights: int, acts: int) -> str:
        got = "-" if received is None else f"{received:,.0f}"
        return f"      {name:<30}{got:>12}{weights:>12,}{acts:>12,}"

    summa = "SUMMA / Optimus q x q" if x.received_summa is not None else "SUMMA (data = model only)"
    return [
        f"    2D TP, one MLP layer forward (T={x.tokens}, D={x.emb}, F={x.mlp}), per device:",
        f"      {'layout':<30}{'received':>12}{'weights':>12}{'residual':>12}",
        row(f"this (2D by rules) {x.d}x{x.m}", x.received_2d, x.weights_2d, x.activations_2d),
        row(summa, x.received_summa, x.weights_2d, x.activations_2d),
        row(
            f"1D Megatron, model={x.m}",
            x.received_megatron,
            x.weights_megatron,
            x.activations_megatron,
        ),
    ]
