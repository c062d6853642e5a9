"""The first lines of `t5lite inspect`: does it fit, how fast, what dominates the traffic."""

from __future__ import annotations

import textwrap

from t5lite.insight.sharding import format_bytes
from t5lite.insight.types import StepReport


def memory_verdict(step: StepReport) -> tuple[bool | None, int, str]:
    """(fits or None when the device's memory is unknown, bytes per device, which figure):
    the compiled figure where there is one, else the analytic prediction."""
    if step.memory is not None:
        total, source = step.memory.total, "compiled"
    else:
        total, source = step.predicted.total, "predicted"
    cap = step.device.memory_bytes
    return (None if not cap else total <= cap), total, source


def largest_collectives(step: StepReport, n: int = 3) -> list[str]:
    """The `n` collectives (kind × mesh axes) sending the most bytes per device; analytic
    volumes when nothing was compiled."""
    if step.memory is not None:
        rows = sorted(step.collectives, key=lambda r: -r.link_bytes)[:n]
        return [
            f"{r.kind} over {r.axes_str}: {format_bytes(r.link_bytes)} sent in {r.count} ops"
            for r in rows
            if r.link_bytes > 0
        ]
    a = step.analytic
    rows_a = [
        (f"gradients over {'+'.join(a.data_axes) or '-'}", a.data_axes_bytes),
        ("activations over model", a.model_axis_bytes),
    ]
    return [f"{name}: {format_bytes(b)} (analytic)" for name, b in rows_a if b > 0][:n]


def _ms(seconds: float | None) -> str:
    return "?" if seconds is None else f"{1e3 * seconds:,.3g} ms"


def format_summary(step: StepReport, width: int | None = 100) -> str:
    """Verdict, memory per device against the device, step-time estimate and MFU, and the three
    largest collectives, in a few lines."""
    fits, total, source = memory_verdict(step)
    dev, cap = step.device.device_kind, step.device.memory_bytes
    mesh = " x ".join(f"{k}={v}" for k, v in step.mesh_shape.items())
    if fits is None:
        verdict = (
            f"fit unknown: {dev} has no memory figure ({format_bytes(total)} {source} per "
            "device); name a device: --device=v5p"
        )
    else:
        word = "FITS" if fits else "DOES NOT FIT"
        verdict = (
            f"{word} on {dev}: {format_bytes(total)} per device ({source}) of "
            f"{format_bytes(cap)} HBM, {100 * total / cap:.0f}%"
        )
    lines = [f"summary (mesh {mesh}):", f"  verdict: {verdict}"]
    if step.memory is not None:
        lines.append(f"  predicted (analytic): {format_bytes(step.predicted.total)} per device")
    e = step.estimate
    if e is not None and e.step_s is not None:
        mfu = e.mfu(step.device.peak_flops)
        lines.append(
            f"  step estimate: {_ms(e.step_s)} = max(compute {_ms(e.compute_s)}, HBM "
            f"{_ms(e.hbm_s)}) + links {_ms(e.communication_s)}"
            + (f"; MFU ≈ {100 * mfu:.0f}%" if mfu is not None else "")
        )
    elif e is not None:
        lines.append(f"  step estimate: n/a ({dev}: no peak FLOP/s figure; try --device=v5p)")
    if step.step_seconds is not None:
        lines.append(f"  compiled FLOPs and collectives: {_ms(step.step_seconds)} per step")
    top = largest_collectives(step)
    lines.append("  largest collectives: " + ("; ".join(top) if top else "none"))
    if step.device.source:
        lines.append(f"  {dev} figures: {step.device.source}")
    if width:
        lines = [w for line in lines for w in _wrap(line, width)]
    return "\n".join(lines)


def _wrap(line: str, width: int) -> list[str]:
    indent = " " * (len(line) - len(line.lstrip()) + 2)
    return textwrap.wrap(line, width, subsequent_indent=indent, break_on_hyphens=False) or [""]
