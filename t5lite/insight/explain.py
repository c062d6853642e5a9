"""Why a layout does not fit, and what would: the largest buffers, and changes with their
predicted memory (each recomputed with `predict_memory` on the changed layout: no compile)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

from t5lite.insight.memory import predict_memory
from t5lite.insight.meshes import mesh_over
from t5lite.insight.sharding import ShardingReport, format_bytes
from t5lite.insight.summary import memory_verdict
from t5lite.insight.tables import elide, fold_indices, layer_pattern
from t5lite.insight.types import StepReport
from t5lite.model.config import REMAT_POLICIES
from t5lite.partitioning import DATA, MODEL, Partitioner, PartitioningError, preset_rules
from t5lite.trainer import Trainer


@dataclasses.dataclass(frozen=True)
class Suggestion:
    """One change to the layout and the memory per device it is predicted to need."""

    change: str
    predicted: int | None  # bytes per device; None: the change is not possible
    reason: str = ""  # why it is not possible

    def fits(self, memory_bytes: int | None) -> bool | None:
        if self.predicted is None or not memory_bytes:
            return None
        return self.predicted <= memory_bytes


def largest_arrays(report: ShardingReport, n: int = 5) -> list[tuple[str, int, str]]:
    """The `n` largest (folded) arrays per device: (path with shape and logical axes, bytes per
    device of all its layers, count)."""
    groups: dict[tuple, list] = {}
    for p in report.placements:
        pattern, index = layer_pattern(p.path)
        groups.setdefault((pattern, p.shape, p.logical_axes), []).append((index, p))
    out = []
    for (pattern, shape, axes), members in groups.items():
        indices = [i for i, _ in members if i is not None]
        path = pattern.format(fold_indices(indices)) if indices else pattern
        shape_s = "x".join(map(str, shape)) or "()"
        axes_s = ",".join(map(str, axes)) if axes is not None else "-"
        total = sum(p.bytes_per_device for _, p in members)
        out.append((f"{path} {shape_s} ({axes_s})", total, f"×{len(members)}"))
    return sorted(out, key=lambda r: -r[1])[:n]


def _variant(
    trainer: Trainer,
    *,
    mesh_shape: dict[str, int] | None = None,
    rules: tuple | None = None,
    remat: str | None = None,
    batch_size: int | None = None,
) -> Trainer:
    """`trainer`'s layout with some of its mesh shape, rules, remat policy or batch changed."""
    part = trainer.partitioner
    if mesh_shape is not None:
        mesh = mesh_over(mesh_shape, list(part.mesh.devices.flat))
    else:
        mesh = part.mesh
    new_part = Partitioner(mesh, logical_axis_rules=rules if rules is not None else part.rules)
    model = trainer.model
    if remat is not None:
        cfg = dataclasses.replace(model.network_config, remat_policy=remat)
        model = dataclasses.replace(model, network_config=cfg)
    return Trainer(
        model, new_part, batch_size=batch_size or trainer.batch_size, lengths=trainer.lengths
    )


def _try(change: str, build: Callable[[], Trainer], extra: int = 0) -> Suggestion:
    try:
        t = build()
    except (PartitioningError, ValueError, NotImplementedError) as e:
        return Suggestion(change, None, str(e).splitlines()[0][:120])
    return Suggestion(change, predict_memory(t).total + extra)


def suggestions(trainer: Trainer) -> list[Suggestion]:
    """Single changes that reduce memory per device, each with its predicted memory."""
    shape = dict(trainer.partitioner.mesh.shape)
    cfg = trainer.model.network_config
    out = []
    if shape.get(DATA, 1) % 2 == 0 and MODEL in shape:
        more = {**shape, DATA: shape[DATA] // 2, MODEL: shape[MODEL] * 2}
        out.append(
            _try(
                f"model={more[MODEL]} (data={more[DATA]})",
                lambda: _variant(trainer, mesh_shape=more),
            )
        )
    for preset in ("fsdp", "fully_sharded"):
        if tuple(trainer.partitioner.rules) != tuple(preset_rules(preset)):
            out.append(
                _try(
                    f"{preset} rules (2D parameters)",
                    lambda p=preset: _variant(trainer, rules=preset_rules(p)),
                )
            )
            break
    current = REMAT_POLICIES.index(cfg.remat_policy)
    for policy in REMAT_POLICIES[current + 1 :]:
        out.append(_try(f"remat_policy='{policy}'", lambda r=policy: _variant(trainer, remat=r)))
    base = predict_memory(trainer)
    for k in (2, 4, 8):
        # One microbatch's activations, plus an accumulator the size of the gradients; the
        # whole batch stays in memory.
        def micro(k: int = k) -> Trainer:
            if trainer.batch_size % (k * trainer.partitioner.data_parallel_size):
                raise ValueError(f"batch {trainer.batch_size} does not split into {k} per group")
            return _variant(trainer, batch_size=trainer.batch_size // k)

        s = _try(f"num_microbatches={k}", micro, extra=base.gradients)
        if s.predicted is not None:
            s = dataclasses.replace(s, predicted=s.predicted + base.batch - base.batch // k)
        out.append(s)
    return out


def explain_oom(
    trainer: Trainer,
    step: StepReport,
    params: ShardingReport,
    opt_state: ShardingReport,
    width: int | None = 100,
) -> str:
    """What fills a device that is too small, and what would make the layout fit."""
    _, total, source = memory_verdict(step)
    cap = step.device.memory_bytes
    p = step.predicted
    lines = [
        f"why it does not fit: {format_bytes(total)} ({source}) > {format_bytes(cap)} per device",
        "  largest parameters per device (path, shape, logical axes):",
    ]
    for name, n_bytes, count in largest_arrays(params):
        lines.append(f"    {format_bytes(n_bytes):>10} {count:>4}  {name}")
    lines.append("  largest optimizer state per device:")
    for name, n_bytes, count in largest_arrays(opt_state, 3):
        lines.append(f"    {format_bytes(n_bytes):>10} {count:>4}  {name}")
    remat = trainer.model.network_config.remat_policy
    lines += [
        "  predicted by category: "
        + ", ".join(
            f"{k} {format_bytes(v)}"
            for k, v in (
                ("state", p.state),
                ("gradients", p.gradients),
                ("update", p.update),
                (f"activations (remat={remat})", p.activations),
                ("batch", p.batch),
            )
        ),
        f"what would fit (predicted memory per device; this layout: {format_bytes(p.total)}"
        " predicted):",
    ]
    for s in suggestions(trainer):
        if s.predicted is None:
            lines.append(f"  {s.change}: not possible: {s.reason}")
            continue
        verdict = {True: "fits", False: "does not fit", None: ""}[s.fits(cap)]
        lines.append(f"  {s.change}: {format_bytes(s.predicted)} {verdict}".rstrip())
    return "\n".join(elide(line, width) if width else line for line in lines)
