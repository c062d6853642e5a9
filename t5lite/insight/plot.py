"""`--plot FILE.png|svg`: memory per device by category and communication by mesh axis, one bar
per layout (matplotlib, the `[plot]` extra; imported only when a plot is asked for)."""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import TYPE_CHECKING

from t5lite.insight.hardware import GiB

if TYPE_CHECKING:
    # Types only: the CLI checks `--plot` (`check_plot_path`) before it sets JAX's devices up, so
    # importing this module must not import JAX and the model.
    from t5lite.insight.types import Candidate, StepReport

_FORMATS = (".png", ".svg")
_CATEGORIES = ("state", "batch", "gradients", "update", "activations")


def check_plot_path(path: str) -> None:
    """Fails (ValueError, one line) on a format other than PNG or SVG or without matplotlib."""
    if os.path.splitext(path)[1].lower() not in _FORMATS:
        raise ValueError(f"--plot {path!r}: the file must end in .png or .svg")
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise ValueError(
            'plotting needs matplotlib, the [plot] extra: pip install -e ".[plot]"'
        ) from None


def _communication(step: StepReport) -> dict[str, float]:
    """Bytes sent per device per step by mesh axes: compiled where compiled, else analytic."""
    if step.memory is not None:
        out: dict[str, float] = {}
        for r in step.collectives:
            out[r.axes_str] = out.get(r.axes_str, 0.0) + r.link_bytes
        return out
    a = step.analytic
    return {"+".join(a.data_axes) or "data": a.data_axes_bytes, "model": a.model_axis_bytes}


def plot_steps(items: Sequence[tuple[str, StepReport]], path: str) -> None:
    """One bar per (label, step): predicted memory by category (compiled total marked) and
    collective bytes per mesh axis."""
    memory = [{c: getattr(s.predicted, c) for c in _CATEGORIES} for _, s in items]
    compiled = [s.memory.total if s.memory else None for _, s in items]
    comm = [_communication(s) for _, s in items]
    cap = items[0][1].device.memory_bytes if items else None
    _draw([label for label, _ in items], memory, compiled, comm, cap, path)


def plot_layouts(candidates: Sequence[Candidate], path: str) -> None:
    """`plan`'s layouts: analytic memory of each, compiled total and collectives where compiled
    (analytic volumes otherwise)."""
    labels, memory, compiled, comm = [], [], [], []
    for c in candidates:
        assert c.predicted is not None
        labels.append(f"{c.layout.preset} {c.layout.data}x{c.layout.model} {c.layout.remat}")
        memory.append({k: getattr(c.predicted, k) for k in _CATEGORIES})
        compiled.append(c.memory)
        if c.step is not None:
            comm.append(_communication(c.step))
        else:
            comm.append({"link (analytic)": c.estimate.link_bytes if c.estimate else 0.0})
    _draw(labels, memory, compiled, comm, None, path)


def _draw(
    labels: Sequence[str],
    memory: Sequence[dict[str, int]],
    compiled: Sequence[int | None],
    comm: Sequence[dict[str, float]],
    device_memory: int | None,
    path: str,
) -> None:
    check_plot_path(path)
    from matplotlib.figure import Figure  # no pyplot: no GUI backend, no global state

    height = 1.5 + 0.4 * len(labels)
    fig = Figure(figsize=(11, height), layout="constrained")
    ax_mem, ax_comm = fig.subplots(1, 2, sharey=True)
    ys = range(len(labels))
    left = [0.0] * len(labels)
    for cat in _CATEGORIES:
        widths = [m[cat] / GiB for m in memory]
        ax_mem.barh(ys, widths, left=left, label=cat)
        left = [a + b for a, b in zip(left, widths)]
    marks = [(y, c / GiB) for y, c in zip(ys, compiled) if c is not None]
    if marks:
        ax_mem.scatter(
            [x for _, x in marks],
            [y for y, _ in marks],
            marker="|",
            s=300,
            color="black",
            label="compiled total",
            zorder=3,
        )
    if device_memory:
        ax_mem.axvline(device_memory / GiB, color="red", linestyle="--", label="device memory")
    ax_mem.set_yticks(list(ys), labels)
    ax_mem.set_xlabel("GiB per device (predicted)")
    ax_mem.set_title("memory by category")
    ax_mem.legend(fontsize="small")
    axes_names = sorted({k for c in comm for k in c})
    left = [0.0] * len(labels)
    for name in axes_names:
        widths = [c.get(name, 0.0) / 2**20 for c in comm]
        ax_comm.barh(ys, widths, left=left, label=name)
        left = [a + b for a, b in zip(left, widths)]
    ax_comm.set_xlabel("MiB sent per device per step")
    ax_comm.set_title("communication by mesh axes")
    if axes_names:
        ax_comm.legend(fontsize="small")
    fig.savefig(path)
