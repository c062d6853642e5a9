"""`t5lite plan`'s output: the ranked table of layouts and the verdict lines under it."""

from __future__ import annotations

import textwrap
from collections.abc import Sequence

from t5lite.insight.hardware import DeviceSpec
from t5lite.insight.sharding import format_bytes
from t5lite.insight.tables import format_table as _table
from t5lite.insight.types import Candidate

# The analytic memory is a model of XLA's buffer assignment, good to about this fraction: a
# layout is screened out only when its prediction exceeds the device by more.
FIT_MARGIN = 0.10


def format_ms(seconds: float | None) -> str:
    return f"{1e3 * seconds:.3g}" if seconds is not None else "-"


def format_table(ranked: Sequence[Candidate], device: DeviceSpec, width: int | None = 100) -> str:
    """The ranked table, one row per layout (analytic and compiled figures side by side), then
    the reasons of invalid or failed layouts."""
    rows = [
        (
            "#",
            "preset",
            "mesh",
            "remat",
            "predicted",
            "compiled",
            "est ms",
            "XLA ms",
            "MFU",
            "status",
        )
    ]
    notes: dict[str, list[str]] = {}  # reason -> rows
    for i, c in enumerate(ranked, 1):
        e = c.estimate
        mfu = e.mfu(device.peak_flops) if e else None
        status = c.status
        if status.startswith(("invalid:", "failed:")):
            notes.setdefault(status, []).append(str(i))
            status = status.split(":")[0]
        rows.append(
            (
                str(i),
                c.layout.preset,
                c.layout.mesh,
                c.layout.remat,
                format_bytes(c.predicted.total) if c.predicted else "-",
                format_bytes(c.memory) if c.memory is not None else "-",
                format_ms(e.step_s if e else None),
                format_ms(c.step_seconds),
                f"{100 * mfu:.0f}%" if mfu is not None else "-",
                status,
            )
        )
    lines = _table(rows, max_width=width, shrink=(9,))
    mem = format_bytes(device.memory_bytes) if device.memory_bytes else "unknown"
    hbm = f"{device.hbm_bytes_per_s / 1e9:.0f} GB/s" if device.hbm_bytes_per_s else "unknown"
    lines += [
        "predicted: analytic memory/device; compiled: XLA's; est ms: analytic step (FLOPs, HBM",
        "bytes, collectives); XLA ms: compiled FLOPs and collectives; MFU: from the analytic step;",
        f"screened: not compiled, for memory (predicted > {100 + 100 * FIT_MARGIN:.0f}% of the "
        "device)",
        "or as slower than the compiled candidates (est ms)",
        f"device: {device.device_kind}, memory {mem}, peak {device.peak_flops / 1e12:.0f} TFLOP/s,"
        f" HBM {hbm}, links {device.link_bytes_per_s / 1e9:.0f} GB/s",
    ]
    if device.slice_devices and device.dcn_bytes_per_s:
        lines.append(
            f"slices of {device.slice_devices} devices joined by DCN at "
            f"{device.dcn_bytes_per_s / 1e9:.3g} GB/s a device (mesh: replica x data x model)"
        )
    if device.source:
        src = f"figures: {device.source}"
        lines += textwrap.wrap(src, width, subsequent_indent="  ") if width else [src]
    if notes:
        lines += ["invalid or failed:"]
        for reason, rows_of in notes.items():
            note = f"  {', '.join(rows_of)}: {reason}"
            lines += textwrap.wrap(note, width, subsequent_indent="      ") if width else [note]
    return "\n".join(lines)


def pipeline_verdict(ranked: Sequence[Candidate]) -> str:
    """Whether a pipeline won, against the best layout of the other kind."""
    best = ranked[0]
    # the other kind's best: compiled and fitting, else predicted to fit (ranked after those)
    other = next(
        (
            c
            for c in ranked
            if (c.fits or c.status.startswith("screened: slow"))
            and (c.layout.stages > 1) != (best.layout.stages > 1)
        ),
        None,
    )
    if best.layout.stages > 1:
        vs = (
            f"; the best without stages: {other.layout.name}"
            if other
            else ("; no layout without stages fits")
        )
        return f"a pipeline wins: {best.layout.name}{vs}"
    vs = f"; the best pipeline: {other.layout.name}" if other else "; no pipeline fits"
    return f"no pipeline wins{vs}"


def least_memory(ranked: Sequence[Candidate]) -> str:
    """When nothing fits: the predicted memory of the smallest layout with and without stages."""
    parts = []
    for label, staged in (("with stages", True), ("without", False)):
        mine = [c for c in ranked if c.predicted and (c.layout.stages > 1) == staged]
        if mine:
            c = min(mine, key=lambda c: c.predicted.total)
            parts.append(f"{label} {c.layout.name} ({format_bytes(c.predicted.total)})")
    return "least memory predicted: " + "; ".join(parts)


def screen_line(c: Candidate) -> str:
    if c.predicted is None or c.estimate is None:
        return c.status
    return f"predicted {format_bytes(c.predicted.total)}, est {format_ms(c.estimate.step_s)} ms"
