"""Where an accelerator's step time goes: a `jax.profiler` trace of a few steps, read back.

`profile_steps` traces `steps` calls of a compiled step and sums the device's kernel time by
kind (matmul, fused attention, copies, the rest), by HLO op and by kernel, per step, beside the
wall time of a step: the part of the wall time no kernel covered is time the device waited for
the host (launches, loop predicates, synchronisation). Used by `accelerator.py --profile`.
"""

from __future__ import annotations

import collections
import glob
import tempfile
import time
from collections.abc import Callable
from typing import Any

# Substrings of a kernel's name that say what it is (cuDNN's fused attention, cuBLAS/CUTLASS/
# nvJet matmul kernels, the copy engine), first match wins: attention kernels are named after the
# wgmma instructions they use too. Everything else is an XLA fusion or a small kernel.
_KINDS = (
    ("attention", ("cudnn", "fmha", "flash", "sdpa")),
    ("matmul", ("gemm", "nvjet", "cutlass", "xmma", "wgmma", "cublas", "triton_gemm")),
    ("copy", ("memcpy", "memset", "copy")),
)


def kind_of(kernel: str, hlo_op: str) -> str:
    """The kind of a kernel, from its name and the HLO op that launched it."""
    text = f"{kernel} {hlo_op}".lower()
    for kind, marks in _KINDS:
        if any(m in text for m in marks):
            return kind
    return "other"


def _union_ns(spans: list[tuple[int, int]]) -> int:
    """Total time covered by possibly overlapping (start, end) spans."""
    total, end = 0, None
    for s, e in sorted(spans):
        if end is None or s > end:
            total += e - s
            end = e
        elif e > end:
            total += e - end
            end = e
    return total


def profile_steps(step: Callable[[], Any], steps: int = 3, top: int = 20) -> dict:
    """Traces `steps` synced calls of `step` and sums the device time they took.

    Returns per-step milliseconds: wall time, device busy time (the union of kernel spans),
    time by kind, and the `top` HLO ops and kernels by time.
    """
    import jax

    with tempfile.TemporaryDirectory() as d:
        with jax.profiler.trace(d):
            start = time.perf_counter()
            for _ in range(steps):
                jax.block_until_ready(step())
            wall = (time.perf_counter() - start) / steps
        path = glob.glob(f"{d}/**/*.xplane.pb", recursive=True)[0]
        data = jax.profiler.ProfileData.from_file(path)
        by_kind: dict[str, float] = collections.defaultdict(float)
        by_op: dict[str, float] = collections.defaultdict(float)
        by_kernel: dict[str, float] = collections.defaultdict(float)
        spans: list[tuple[int, int]] = []
        # An accelerator's kernels are on its device plane; XLA:CPU's run on the host's threads.
        planes = [
            p for p in data.planes if p.name.startswith("/device:") and "CUSTOM" not in p.name
        ]
        planes = planes or [p for p in data.planes if p.name == "/host:CPU"]
        for plane in planes:
            for line in plane.lines:
                for ev in line.events:
                    stats = dict(ev.stats)
                    op = str(stats.get("hlo_op", ""))
                    if not op and "kernel_details" not in stats:
                        continue  # a step or module marker, not a kernel
                    ns = float(ev.duration_ns)
                    spans.append((int(ev.start_ns), int(ev.end_ns)))
                    by_kind[kind_of(ev.name, op)] += ns
                    by_op[op or ev.name] += ns
                    by_kernel[ev.name[:120]] += ns

    def ms(table: dict[str, float], n: int | None = None) -> dict[str, float]:
        rows = sorted(table.items(), key=lambda kv: -kv[1])[:n]
        return {k: round(v / 1e6 / steps, 3) for k, v in rows}

    return {
        "wall_ms": round(1e3 * wall, 3),
        "busy_ms": round(_union_ns(spans) / 1e6 / steps, 3),
        "kinds_ms": ms(by_kind),
        "ops_ms": ms(by_op, top),
        "kernels_ms": ms(by_kernel, top),
    }


def print_profile(label: str, p: dict) -> None:
    """The profile as a few readable lines."""
    busy = p["busy_ms"]
    print(
        f"  profile {label}: wall {p['wall_ms']:.1f} ms/step, kernels busy {busy:.1f} ms "
        f"({100 * busy / max(p['wall_ms'], 1e-9):.1f}%)",
        flush=True,
    )
    print("    by kind: " + ", ".join(f"{k} {v:.1f}" for k, v in p["kinds_ms"].items()))
    for title, key in (("HLO ops", "ops_ms"), ("kernels", "kernels_ms")):
        print(f"    top {title} (ms/step):")
        for name, v in p[key].items():
            print(f"      {v:8.2f}  {name}")
