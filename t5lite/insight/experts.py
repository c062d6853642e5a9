"""GShard's all-to-all volume of the mixture-of-experts layers (model/moe.py), per layer.

With capacity dispatch and `expert` on a mesh axis the batch is split on (GShard; the
`expert_parallel` preset, and t5x's MoE rules in the other presets), one MoE layer of a
training step moves, per device:

  forward   dispatch  [G, S, D] -> [E, G, C, D]: one all-to-all, result = one device's
            dispatched activations, E·G·C·D / (the mesh axes of `expert`, `expert_group`,
            `expert_capacity`, `embed`), in the compute dtype;
            combine   [E, G, C, D] -> [G, S, D]: one all-to-all of the same size;
  backward  the transpose of each: two more of the same size;
            the combine weights' gradient (the router's gradient path, d combine[G, S, E, C] =
            y[E, G, C, D] · dy[G, S, D] summed over D): one all-to-all of E·G·C·S per device
            (the dispatched array's split, S in place of D).

So 5 all-to-alls per MoE layer over the axes `expert` shares with the batch: 4 of the
dispatched size (Lepikhin et al. 2020, section 3.2: "dispatch and combine", forward and
backward) and the router's one. G is the global batch (a group is one sequence), S its length,
C = `moe.expert_capacity(S, E, k, moe_capacity_factor)`; a dimension that does not divide its
mesh axes is padded up, as GSPMD pads it. Dropless dispatch sorts tokens globally: GSPMD gathers
instead (no all-to-all; see docs/moe.md).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

import numpy as np

from t5lite.insight.hlo import CollectiveRow
from t5lite.insight.sharding import format_bytes
from t5lite.model.config import is_moe_layer
from t5lite.model.moe import DISPATCHED_AXES, expert_capacity
from t5lite.partitioning import mesh_axes_of, resolve_logical_axes
from t5lite.trainer import Trainer


@dataclasses.dataclass(frozen=True)
class MoeStack:
    """The MoE layers of one stack (encoder or decoder) and their per-device all-to-alls."""

    name: str
    layers: int
    length: int  # S, tokens per group (sequence)
    capacity: int  # C, slots per expert and group
    dispatched_bytes: int  # one device's [E, G, C, D] after the dispatch
    weights_grad_bytes: int  # one device's combine-weight gradient [G, S, E, C]
    gathered_bytes: int = 0  # GSPMD's extra all-gathers: tokens [G, S, D] + routing [G, S, E]

    @property
    def layer_bytes(self) -> int:
        """Result bytes of one layer's 5 all-to-alls (4 dispatched + the router's)."""
        return 4 * self.dispatched_bytes + self.weights_grad_bytes


@dataclasses.dataclass(frozen=True)
class ExpertAllToAll:
    """The step's MoE all-to-alls over `axes` (per device), stack by stack."""

    axes: tuple[str, ...]
    group_size: int
    stacks: tuple[MoeStack, ...]
    microbatches: int = 1

    PER_LAYER = 5

    @property
    def count(self) -> int:
        return self.PER_LAYER * self.microbatches * sum(s.layers for s in self.stacks)

    @property
    def bytes(self) -> int:
        return self.microbatches * sum(s.layers * s.layer_bytes for s in self.stacks)

    @property
    def gathers(self) -> tuple[int, int]:
        """(count, result bytes) of the all-gathers GSPMD adds over `axes`: per MoE layer, the
        whole batch's tokens [G, S, D] and routing weights [G, S, E] (not GShard's schedule;
        `communication.py` names them as a compiler choice)."""
        layers = self.microbatches * sum(s.layers for s in self.stacks)
        return 2 * layers, self.microbatches * sum(s.layers * s.gathered_bytes for s in self.stacks)


def _per_device(shape: Sequence[int], axes: Sequence[str], trainer: Trainer) -> int:
    """Elements of one device's shard of an array with these logical axes (padded up)."""
    spec, _ = resolve_logical_axes(axes, trainer.partitioner.rules)
    mesh_shape = dict(trainer.partitioner.mesh.shape)
    n = 1
    for dim, entry in zip(shape, spec):
        n *= math.ceil(dim / math.prod(mesh_shape[t] for t in mesh_axes_of(entry)))
    return n


def expert_all_to_all(trainer: Trainer, batch_axes: Sequence[str]) -> ExpertAllToAll | None:
    """GShard's all-to-alls of `trainer`'s train step, or None (no MoE layer, dropless
    dispatch, or experts on no axis the batch is split on)."""
    cfg = trainer.model.network_config
    if not getattr(cfg, "num_experts", 0) or cfg.moe_dispatch != "capacity":
        return None
    part = trainer.partitioner
    mesh_shape = dict(part.mesh.shape)
    spec, _ = resolve_logical_axes(DISPATCHED_AXES, part.rules)
    axes = tuple(t for t in mesh_axes_of(spec[0]) if t in batch_axes and mesh_shape[t] > 1)
    if not axes:
        return None
    micro = getattr(trainer, "num_microbatches", 1)
    g = trainer.batch_size // micro
    e, d, k = cfg.num_experts, cfg.emb_dim, cfg.moe_top_k
    item = np.dtype(cfg.policy.compute).itemsize
    if hasattr(cfg, "num_encoder_layers"):
        stacks = [
            ("encoder", cfg.num_encoder_layers, trainer.lengths["inputs"]),
            ("decoder", cfg.num_decoder_layers, trainer.lengths["targets"]),
        ]
    else:
        length = trainer.lengths["targets"] + trainer.lengths.get("inputs", 0)
        stacks = [("decoder", cfg.num_layers, length)]
    out = []
    for name, num_layers, s in stacks:
        layers = sum(is_moe_layer(cfg, i) for i in range(num_layers))
        if not layers:
            continue
        c = expert_capacity(s, e, k, cfg.moe_capacity_factor)
        dispatched = _per_device((e, g, c, d), DISPATCHED_AXES, trainer)
        without_d = _per_device((e, g, c), DISPATCHED_AXES[:3], trainer)
        gathered = g * s * d * item + g * s * e * 4  # the routing weights stay fp32
        out.append(MoeStack(name, layers, s, c, dispatched * item, without_d * s * item, gathered))
    return ExpertAllToAll(axes, math.prod(mesh_shape[t] for t in axes), tuple(out), micro)


def format_expert_all_to_all(a: ExpertAllToAll, rows: Sequence[CollectiveRow] | None) -> list[str]:
    """Lines for a report: GShard's per-layer all-to-alls and, compiled, the step's all-to-alls
    over the same axes per MoE layer beside them."""
    axes = "+".join(a.axes)
    lines = [f"mixture of experts: GShard's all-to-alls over {axes} ({a.group_size} devices):"]
    for s in a.stacks:
        lines.append(
            f"  {s.name} MoE layer (x{s.layers}, S={s.length}, C={s.capacity}): "
            f"dispatch + combine, forward and backward 4 x {format_bytes(s.dispatched_bytes)}"
            f" + the router's combine-weight gradient {format_bytes(s.weights_grad_bytes)}"
            f" = {ExpertAllToAll.PER_LAYER} all-to-alls, {format_bytes(s.layer_bytes)}"
        )
    lines.append(f"  analytic: {a.count} all-to-alls, {format_bytes(a.bytes)} per step")
    if rows is not None:
        mine = [r for r in rows if r.kind == "all-to-all" and set(r.axes or ()) == set(a.axes)]
        n, got = sum(r.count for r in mine), sum(r.bytes for r in mine)
        verdict = "agrees" if (n, got) == (a.count, a.bytes) else "differs"
        lines.append(f"  compiled: {n} all-to-alls, {format_bytes(got)}: {verdict}")
    return lines
