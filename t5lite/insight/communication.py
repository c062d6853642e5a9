"""Communication of the train step: compiled collectives grouped per kind and mesh axis, their
ring-algorithm link bytes, and Mesh-TensorFlow's analytic volume for the layout, compared.
ZeRO-3's per-layer figures are in zero3.py, 2D tensor parallelism's per-layer ones in
tensor_2d.py.
"""

from __future__ import annotations

import collections
import dataclasses
import math
from collections.abc import Sequence
from typing import Any

import numpy as np

from t5lite.insight.context import (
    context_layer_collectives,
    format_context,
    mask_collectives,
)
from t5lite.insight.experts import ExpertAllToAll, expert_all_to_all
from t5lite.insight.hlo import KINDS, Collective, CollectiveRow
from t5lite.insight.memory import rule_of
from t5lite.insight.pipeline import pipeline_collectives
from t5lite.insight.sharding import ShardingReport
from t5lite.insight.tensor_2d import format_tensor_2d, tensor_2d_mlp_figures
from t5lite.insight.zero3 import Zero3Figures, zero3_figures
from t5lite.model.moe import DISPATCHED_AXES
from t5lite.partitioning import mesh_axes_of, resolve_logical_axes
from t5lite.trainer import Trainer


def link_bytes(c: Collective) -> float:
    """Bytes one device sends for `c` with ring algorithms (results sized per device)."""
    n = c.group_size
    if n <= 1:
        return 0.0
    if c.kind == "all-reduce":
        return 2 * (n - 1) / n * c.bytes
    if c.kind == "reduce-scatter":  # the result is the 1/n shard of the reduced input
        return (n - 1) * c.bytes
    if c.kind in ("all-gather", "all-to-all"):
        return (n - 1) / n * c.bytes
    return float(c.bytes)  # collective-permute: each device sends its buffer once


def collective_rows(collectives: Sequence[Collective]) -> list[CollectiveRow]:
    """Collectives grouped by (kind, mesh axes), kinds in `KINDS` order."""
    groups: dict[tuple[str, Any], list[Collective]] = collections.defaultdict(list)
    for c in collectives:
        groups[(c.kind, c.axes)].append(c)
    rows = [
        CollectiveRow(k, a, len(cs), sum(c.bytes for c in cs), sum(map(link_bytes, cs)))
        for (k, a), cs in groups.items()
    ]
    return sorted(rows, key=lambda r: (KINDS.index(r.kind), str(r.axes)))


@dataclasses.dataclass(frozen=True)
class ExpectedCollective:
    """Collectives the layout implies, before any compiler gets to them (per device, per step)."""

    kind: str
    axes: tuple[str, ...]
    count: int
    bytes: int  # sum of their result sizes, as `CollectiveRow.bytes`
    group_size: int
    why: str

    @property
    def link_bytes(self) -> float:
        """Ring-algorithm bytes each device sends (as `CollectiveRow.link_bytes`)."""
        per = Collective(self.kind, self.bytes, self.axes, (tuple(range(self.group_size)),))
        return link_bytes(per)


@dataclasses.dataclass(frozen=True)
class CompilerChoice:
    """A legitimate departure of a compiler from the analytic schedule, and what it costs."""

    name: str
    axes: tuple[str, ...]
    link_bytes: float  # change of the bytes each device sends when the compiler makes it
    # change of (count, result bytes) per kind: (kind, count, bytes), to explain each kind
    kinds: tuple[tuple[str, int, int], ...] = ()


@dataclasses.dataclass(frozen=True)
class AnalyticCommunication:
    """The layout's communication per device per training step, by mesh axis.

    Parameters (Mesh-TensorFlow Table 1, ZeRO-3): 1D parameters' gradients are all-reduced over
    the batch axes (≈ the parameter bytes of one model shard); 2D parameters (FSDP) are
    all-gathered over their batch axis forward and again backward, and their gradients
    reduce-scattered. Activations (Megatron): a block split over `model` (attention, MLP, and
    the vocab-parallel embedding lookup and logits) all-reduces its [B/data, L, D] output once
    forward and once backward; when activations themselves are split over `model` (2D
    activations, sequence parallelism) each all-reduce becomes an all-gather + reduce-scatter.

    data_axes_bytes / model_axis_bytes: result bytes over the batch axes and over the other
      (model) axes, comparable with the compiled rows' `bytes`.
    """

    data_axes: tuple[str, ...]
    data_axes_bytes: int
    model_axis_bytes: int
    expected: tuple[ExpectedCollective, ...] = ()
    choices: tuple[CompilerChoice, ...] = ()
    layer_formulas: tuple[str, ...] = ()  # 2D tensor parallelism: one MLP layer vs the papers
    zero3: Zero3Figures | None = None  # FSDP: the kernels' gradient reduce-scatters
    experts: ExpertAllToAll | None = None  # mixture of experts: GShard's all-to-alls

    def link_bytes_over(self, axes: Sequence[str]) -> float:
        return sum(e.link_bytes for e in self.expected if set(e.axes) == set(axes))

    def to_json(self) -> dict[str, Any]:
        return {
            "data_axes": list(self.data_axes),
            "data_axes_bytes": self.data_axes_bytes,
            "model_axis_bytes": self.model_axis_bytes,
            "expected": [dataclasses.asdict(e) for e in self.expected],
            "compiler_choices": [dataclasses.asdict(c) for c in self.choices],
            "zero3": dataclasses.asdict(self.zero3) if self.zero3 else None,
            "experts": dataclasses.asdict(self.experts) if self.experts else None,
        }


def _split(mesh_shape: dict[str, int], axes: Sequence[str]) -> int:
    return math.prod(mesh_shape[t] for t in axes)


def _expert_kernel_axes(
    p: Any,
    mesh_shape: dict[str, int],
    batch_axes: tuple[str, ...],
    used: list[str],
    dispatched_spec: Any,
) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """An expert kernel's (batch axes its experts are split on, axes its gradient is reduced
    over). Over the first (expert parallelism, GShard) the tokens come to the kernel by
    all-to-all (`experts.py`): nothing is gathered and its gradient is whole where it lives.
    The second are the other axes its tokens' groups and slots are split on (`expert_parallel`:
    capacity over model), where the gradient's partial sums are all-reduced."""
    names = tuple(p.logical_axes)
    mine = tuple(t for t in mesh_axes_of(p.spec[names.index("expert")]) if t in batch_axes)
    tokens = [t for e in dispatched_spec[1:3] for t in mesh_axes_of(e)]
    over = tuple(t for t in tokens if mesh_shape.get(t, 1) > 1 and t not in [*used, *batch_axes])
    return mine, over


def _parameter_collectives(
    trainer: Trainer,
    report: ShardingReport,
    mesh_shape: dict[str, int],
    batch_axes: tuple[str, ...],
) -> tuple[list[ExpectedCollective], list[CompilerChoice]]:
    """Gradient reductions (1D parameters), ZeRO-3 gathers and scatters (2D parameters), the
    token lookup of an embedding split over the batch axes and the relative-position bias's
    gradient."""
    reduce: dict[tuple[str, ...], list[int]] = collections.defaultdict(lambda: [0, 0])
    # Parameters split over batch axes, per kind: dense kernels (gathered inside the layer by
    # t5lite/collectives.py) and the rest (norm scales), which the partitioner gathers.
    fsdp: dict[tuple[str, tuple[str, ...]], list[int]] = collections.defaultdict(lambda: [0, 0])
    cfg = trainer.model.network_config
    relative = not getattr(cfg, "use_rope", True)
    lookup_axes: tuple[str, ...] = ()  # batch axes splitting a looked-up (untied) table
    # The lookup's all-to-all needs full-width activations: with 2D activations (embed split
    # too) the partitioner gathers the table instead (as the other 2D parameters).
    act_spec, _ = resolve_logical_axes(("batch", "length", "embed"), trainer.partitioner.rules)
    dispatched_spec, _ = resolve_logical_axes(DISPATCHED_AXES, trainer.partitioner.rules)
    expert_reduce: dict[tuple[str, ...], list[int]] = collections.defaultdict(lambda: [0, 0])
    wide = not [t for t in mesh_axes_of(act_spec[2]) if mesh_shape.get(t, 1) > 1]
    for p in report.placements:
        used = [t for e in p.spec for t in mesh_axes_of(e) if mesh_shape.get(t, 1) > 1]
        gathered = p.bytes_total // _split(mesh_shape, [t for t in used if t not in batch_axes])
        split_over = tuple(t for t in batch_axes if t in used)
        names = tuple(p.logical_axes or ())
        if "expert" in names and "expert_mlp" in names:
            mine, over = _expert_kernel_axes(p, mesh_shape, batch_axes, used, dispatched_spec)
            split_over = tuple(t for t in split_over if t not in mine)
            gathered //= _split(mesh_shape, mine)
            if over:
                expert_reduce[over][0] += p.shape[names.index("layers")] if "layers" in names else 1
                expert_reduce[over][1] += gathered // _split(mesh_shape, split_over)
        rest = tuple(t for t in batch_axes if t not in used)
        if relative and "relpos_bias" in p.path.split("/"):
            continue  # its gradient is reduced at the bias's size: `_relpos_collectives`
        looked_up = "vocab" in (p.logical_axes or ()) and not p.path.endswith("/kernel")
        looked_up = looked_up and wide and not getattr(cfg, "one_hot_embedding", False)
        if split_over and looked_up and not cfg.logits_via_embedding:
            lookup_axes = split_over  # `_lookup_collectives`: nothing gathered or reduced
            continue
        # A scanned stack's parameter holds every layer's ([layers, ...]); the loop body
        # gathers and reduces one layer's slice per iteration: one collective per layer.
        axes = tuple(p.logical_axes or ())
        per_layer = p.shape[axes.index("layers")] if "layers" in axes else 1
        if split_over:  # gathered over split_over, gradients reduce-scattered back over it
            kernel = p.path.endswith("/kernel") and len(p.shape) >= 2 + (per_layer > 1)
            kind = "kernel" if kernel else "other"
            fsdp[(kind, split_over)][0] += per_layer
            fsdp[(kind, split_over)][1] += gathered
            gathered //= _split(mesh_shape, split_over)
        if rest:
            reduce[rest][0] += per_layer
            reduce[rest][1] += gathered
    out, choices = _fsdp_collectives(fsdp, mesh_shape)
    for axes, (n, b) in reduce.items():
        out.append(
            ExpectedCollective(
                "all-reduce",
                axes,
                n,
                b,
                _split(mesh_shape, axes),
                "gradients summed over the batch",
            )
        )
    for axes, (n, b) in expert_reduce.items():
        why = "expert kernels' gradients summed over the axes their tokens are split on"
        out.append(ExpectedCollective("all-reduce", axes, n, b, _split(mesh_shape, axes), why))
    choices += _per_microbatch_choices(trainer.num_microbatches, mesh_shape, fsdp, reduce)
    if relative:
        out += _relpos_collectives(trainer, mesh_shape, batch_axes)
    if lookup_axes:
        more, more_choices = _lookup_collectives(trainer, mesh_shape, lookup_axes)
        out, choices = out + more, choices + more_choices
    return out, choices


# The `why` endings of ZeRO-3's per-step rows (`_fsdp_collectives`), which pipelines repeat.
_FSDP_GATHERS, _FSDP_SCATTERS = "gathered forward and backward", "gradients scattered back"


def fsdp_link_bytes(expected: Sequence[ExpectedCollective]) -> tuple[float, float]:
    """Bytes each device sends in ZeRO-3's weight gathers (forward and backward) and in its
    gradient scatters, once a step each."""
    gathers = sum(e.link_bytes for e in expected if e.why.endswith(_FSDP_GATHERS))
    return gathers, sum(e.link_bytes for e in expected if e.why.endswith(_FSDP_SCATTERS))


def _fsdp_collectives(
    fsdp: dict[tuple[str, tuple[str, ...]], list[int]], mesh_shape: dict[str, int]
) -> tuple[list[ExpectedCollective], list[CompilerChoice]]:
    """ZeRO-3's gathers and gradient scatters per kind of parameter split over the batch axes,
    and what the compiler may choose instead."""
    out, choices = [], []
    for (kind, axes), (n, b) in fsdp.items():
        size = _split(mesh_shape, axes)
        link = (size - 1) / size * b  # an all-gather of b, and the all-reduce's extra over RS
        what, whose = (
            ("2D parameters", "2D parameters'")
            if kind == "kernel"
            else ("1D parameters split over the batch (norm scales)", "the norm scales'")
        )
        choices.append(
            CompilerChoice(
                f"{whose} gradients all-reduced instead of reduce-scattered (each device then "
                "keeps its slice)",
                axes,
                link,
                (("reduce-scatter", -n, -(b // size)), ("all-reduce", n, b)),
            )
        )
        if kind == "kernel":
            choices.append(
                CompilerChoice(
                    f"{what} gathered once and kept for the backward pass (memory traded for "
                    "communication)",
                    axes,
                    -link,
                    (("all-gather", -n, -b),),
                )
            )
        out.append(
            ExpectedCollective("all-gather", axes, 2 * n, 2 * b, size, f"{what} {_FSDP_GATHERS}")
        )
        out.append(
            ExpectedCollective(
                "reduce-scatter", axes, n, b // size, size, f"{whose} {_FSDP_SCATTERS}"
            )
        )
    return out, choices


def _per_microbatch_choices(
    k: int,
    mesh_shape: dict[str, int],
    fsdp: dict[tuple[str, tuple[str, ...]], list[int]],
    reduce: dict[tuple[str, ...], list[int]],
) -> list[CompilerChoice]:
    """With k microbatches the gradients need reducing once, after the accumulation loop; XLA:TPU
    moves the reductions there, XLA:CPU leaves them in the loop body: each runs k times (and an
    FSDP kernel's backward gather with its reduce-scatter), k - 1 times more than analytic."""
    if k <= 1:
        return []
    out = []
    name = (
        f"gradients reduced in each of the {k} microbatches, not once after accumulating "
        "(XLA:CPU keeps the reduction in the loop; XLA:TPU moves it out)"
    )
    for axes in dict.fromkeys([a for _, a in fsdp] + list(reduce)):
        size, kinds, link = _split(mesh_shape, axes), [], 0.0
        n, b = fsdp.get(("kernel", axes), [0, 0])
        if n:
            kinds += [
                ("all-gather", (k - 1) * n, (k - 1) * b),
                ("reduce-scatter", (k - 1) * n, (k - 1) * (b // size)),
            ]
            link += (k - 1) * 2 * (size - 1) / size * b
        n, b = reduce.get(axes, [0, 0])
        if n:
            kinds.append(("all-reduce", (k - 1) * n, (k - 1) * b))
            link += (k - 1) * 2 * (size - 1) / size * b
        if kinds:
            out.append(CompilerChoice(name, axes, link, tuple(kinds)))
    return out


def _stack_lengths(trainer: Trainer) -> list[tuple[int, int]]:
    """(layers, length) of each stack: the encoder's and decoder's, or a decoder-only one's."""
    cfg = trainer.model.network_config
    if hasattr(cfg, "num_encoder_layers"):
        return [
            (cfg.num_encoder_layers, trainer.lengths["inputs"]),
            (cfg.num_decoder_layers, trainer.lengths["targets"]),
        ]
    return [(cfg.num_layers, trainer.lengths["targets"] + trainer.lengths.get("inputs", 0))]


def _relpos_collectives(
    trainer: Trainer, mesh_shape: dict[str, int], batch_axes: tuple[str, ...]
) -> list[ExpectedCollective]:
    """T5's relative-position bias [1, H, L, L] is computed once per stack and broadcast over
    the batch in each layer's self-attention; the transpose of that broadcast sums its gradient
    over the batch in each layer, so each layer all-reduces [H / heads' split, L, L] (fp32, the
    bias's dtype) over the batch axes before the table's [N, H] gradient is scattered from it:
    sum over stacks of layers x H/m x L^2 x 4 bytes (the table itself is never reduced)."""
    cfg = trainer.model.network_config
    heads = cfg.num_heads // _split(
        mesh_shape,
        [
            t
            for t in mesh_axes_of(rule_of(trainer.partitioner, "heads"))
            if mesh_shape.get(t, 1) > 1 and t not in batch_axes
        ],
    )
    stacks = _stack_lengths(trainer)
    return [
        ExpectedCollective(
            "all-reduce",
            batch_axes,
            sum(n for n, _ in stacks),
            sum(n * heads * length * length * 4 for n, length in stacks),
            _split(mesh_shape, batch_axes),
            "relative-position bias: its gradient summed over the batch in each layer",
        )
    ]


def _lookup_collectives(
    trainer: Trainer, mesh_shape: dict[str, int], axes: tuple[str, ...]
) -> tuple[list[ExpectedCollective], list[CompilerChoice]]:
    """A token embedding split over the batch axes `axes` (FSDP's embed -> data) is not
    gathered: each device looks up its slice of `embed` for the whole batch's tokens, and one
    all-to-all per lookup trades that for its own examples at full width, [B/d, L, D] in the
    compute dtype; backward, the cotangent goes back by the same all-to-all and is scattered
    into the local table slice, so its gradient needs no reduction. For that each device needs
    every token id (B x L int32): an all-gather over `axes`, which XLA writes in parts when the
    vocabulary is also split over `model` (m dividing d): a permute regrouping devices over
    data+model, an all-gather over d/m of data, then one over model (measured with JAX 0.10.2,
    data=4 x model=2)."""
    part, cfg = trainer.partitioner, trainer.model.network_config
    d = _split(mesh_shape, axes)
    b = trainer.batch_size // part.data_parallel_size
    itemsize = np.dtype(cfg.policy.compute).itemsize
    lengths = [length for _, length in _stack_lengths(trainer)]  # one lookup per stack
    n = len(lengths)
    a2a = sum(2 * b * length * cfg.emb_dim * itemsize for length in lengths)
    why = "token lookup of an embedding split over the batch: its embed slice traded back"
    out = [ExpectedCollective("all-to-all", axes, 2 * n, a2a, d, why)]
    ids = sum(b * length * 4 for length in lengths)  # one device's token ids, all lookups
    vocab = [t for t in mesh_axes_of(rule_of(part, "vocab")) if mesh_shape.get(t, 1) > 1]
    m = _split(mesh_shape, [t for t in vocab if t not in axes])
    choices = []
    if len(axes) == 1 and len(vocab) == 1 and 1 < m < d and d % m == 0:
        choices += [
            CompilerChoice(
                "token ids regrouped for the lookup (one permute per lookup)",
                (axes[0], vocab[0]),
                ids,
                (("collective-permute", n, ids),),
            ),
            CompilerChoice(
                "token ids gathered for the lookup over part of the batch axis",
                (f"{axes[0]}/{d // m}",),
                (d // m - 1) * ids,
                (("all-gather", n, ids * (d // m)),),
            ),
        ]
    else:
        choices.append(
            CompilerChoice(
                "token ids gathered for the lookup",
                axes,
                (d - 1) * ids,
                (("all-gather", n, d * ids),),
            )
        )
    return out, choices


def _activation_collectives(
    trainer: Trainer, mesh_shape: dict[str, int], model_axes: tuple[str, ...]
) -> tuple[list[ExpectedCollective], list[CompilerChoice]]:
    """Megatron's all-reduce per split block, forward and backward (or AG + RS pairs)."""
    part, cfg = trainer.partitioner, trainer.model.network_config
    b = trainer.batch_size // part.data_parallel_size
    x_bytes = np.dtype(cfg.policy.compute).itemsize * cfg.emb_dim * b
    gated = len(cfg.mlp_activations) - 1
    if hasattr(cfg, "num_encoder_layers"):
        li, lt = trainer.lengths["inputs"], trainer.lengths["targets"]
        n_enc, n_dec = cfg.num_encoder_layers, cfg.num_decoder_layers
        # Per stack: (blocks of all its layers, length). The decoder's cross-attention adds,
        # backward, the gradient of the encoder output its keys and values read.
        stacks = [(2 * n_enc, li), (3 * n_dec, lt), (n_dec / 2, li)]
        lookups = [li, lt]  # one vocab-parallel embedding lookup per stack
        # extra reductions if unfused: q, k, v (2), a gated MLP (1), cross-attention k, v (1)
        extra_tokens = n_enc * (2 + gated) * li + n_dec * ((2 + gated) * lt + li)
    else:
        lt = trainer.lengths["targets"] + trainer.lengths.get("inputs", 0)
        stacks, lookups = [(2 * cfg.num_layers, lt)], [lt]
        extra_tokens = cfg.num_layers * (2 + gated) * lt
    size = _split(mesh_shape, model_axes)
    act_spec, _ = resolve_logical_axes(("batch", "length", "embed"), part.rules)
    split_acts = bool(set(model_axes) & {t for e in act_spec for t in mesh_axes_of(e)})
    vocab_split = bool(set(model_axes) & set(mesh_axes_of(rule_of(part, "vocab"))))
    # Blocks' outputs forward and backward; the embedding lookup forward and the logits'
    # input gradient backward when the vocabulary is split.
    fwd_bwd = int(sum(2 * n * length * x_bytes for n, length in stacks))
    count = int(sum(2 * n for n, _ in stacks))
    if vocab_split:
        fwd_bwd += sum(length * x_bytes for length in lookups) + lt * x_bytes
        count += len(lookups) + 1
    if cfg.remat_policy == "full":  # the backward pass recomputes each block's forward
        fwd_bwd, count = fwd_bwd * 3 // 2, count * 3 // 2
    # q, k, v and a gated MLP's inputs read one tensor: Megatron sums their input gradients
    # before one reduction; a compiler may reduce each (link bytes of an all-reduce).
    unfused = CompilerChoice(
        "the input gradients of q, k, v (and of a gated MLP's inputs) reduced one by one "
        "instead of summed first",
        model_axes,
        extra_tokens * x_bytes * 2 * (size - 1) / size,
    )
    if split_acts:
        why = "activations split over model: all-gather before, reduce-scatter after a block"
        if set(model_axes) & set(mesh_axes_of(act_spec[1])):
            why = (
                "sequence parallelism: each block's all-reduce as an all-gather before and a "
                "reduce-scatter after it, Megatron's volume"
            )
        ag = ExpectedCollective("all-gather", model_axes, count, fwd_bwd, size, why)
        rs = ExpectedCollective("reduce-scatter", model_axes, count, fwd_bwd // size, size, why)
        return [ag, rs], [
            unfused,
            CompilerChoice(
                "block outputs all-reduced and sliced instead of reduce-scattered",
                model_axes,
                rs.link_bytes,
            ),
            CompilerChoice(
                "activations gathered again for the backward pass", model_axes, ag.link_bytes
            ),
        ]
    why = "Megatron: one all-reduce per split block forward and one backward"
    if cfg.remat_policy == "full":
        why += ", and again where the backward pass recomputes the forward (remat)"
    return [ExpectedCollective("all-reduce", model_axes, count, fwd_bwd, size, why)], [unfused]


def analytic_communication(trainer: Trainer, report: ShardingReport) -> AnalyticCommunication:
    """Per-device communication the layout implies, before any compiler gets to it."""
    part = trainer.partitioner
    mesh_shape = dict(part.mesh.shape)
    batch_axes = tuple(t for t in part.batch_axes if mesh_shape[t] > 1)
    expected, choices = [], []
    if batch_axes:
        expected, choices = _parameter_collectives(trainer, report, mesh_shape, batch_axes)
    split_names = ("heads", "mlp", "vocab")
    model_axes = tuple(
        dict.fromkeys(
            t
            for n in split_names
            for t in mesh_axes_of(rule_of(part, n))
            if mesh_shape.get(t, 1) > 1 and t not in batch_axes
        )
    )
    if model_axes:
        more, more_choices = _activation_collectives(trainer, mesh_shape, model_axes)
        expected, choices = expected + more, choices + more_choices
    experts = expert_all_to_all(trainer, batch_axes)
    if experts is not None:
        why = "GShard: each MoE layer's dispatch and combine, forward and backward, and the "
        why += "router's combine-weight gradient"
        a2a = ExpectedCollective(
            "all-to-all", experts.axes, experts.count, experts.bytes, experts.group_size, why
        )
        expected.append(a2a)
        n, gathered = experts.gathers
        size = experts.group_size
        choices.append(
            CompilerChoice(
                "each MoE layer's tokens [G, S, D] and routing weights [G, S, E] all-gathered "
                "beside GShard's all-to-alls",
                experts.axes,
                (size - 1) / size * gathered,
                (("all-gather", n, gathered),),
            )
        )
    context_rows, context_masks = context_layer_collectives(trainer), mask_collectives(trainer)
    expected += _context_collectives(trainer, context_rows + context_masks)
    staged, lookup = pipeline_collectives(trainer)  # GPipe's, over the stage axes
    expected += [ExpectedCollective(*e) for e in staged]
    choices += [CompilerChoice(*c) for c in lookup]
    data_bytes = sum(e.bytes for e in expected if set(e.axes) <= set(batch_axes))
    model_bytes = sum(e.bytes for e in expected if set(e.axes) == set(model_axes) and model_axes)
    figures = tensor_2d_mlp_figures(trainer)
    return AnalyticCommunication(
        batch_axes,
        data_bytes,
        model_bytes,
        tuple(expected),
        tuple(choices),
        (tuple(format_tensor_2d(figures)) if figures else ())
        + tuple(format_context(context_rows, context_masks)),
        zero3_figures(report, mesh_shape, batch_axes),
        experts,
    )


def _context_collectives(trainer: Trainer, rows: Sequence[Any]) -> list[ExpectedCollective]:
    """Context parallelism's collectives (`context.py`), summed over layers per reason."""
    if not rows:
        return []
    part = trainer.partitioner
    shape = dict(part.mesh.shape)
    cp = tuple(t for t in mesh_axes_of(rule_of(part, "length")) if shape.get(t, 1) > 1)
    out = []
    for r in rows:
        layers = 1 if r.why.startswith("mask") else r.layer.layers
        why = f"context parallelism, {r.layer.name}: {r.why}"
        size = _split(shape, cp) if r.kind != "collective-permute" else 2
        out.append(ExpectedCollective(r.kind, cp, r.count * layers, r.bytes * layers, size, why))
    return out
