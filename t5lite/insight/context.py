"""Context parallelism's collectives per attention layer: the all-gather form and the ring.

Both split the queries' `length` over the context axes (n devices). Per attention layer, with
B' examples per device, S key positions, G key/value heads of width K in the compute dtype:

- all-gather (`context_parallel`, `context_parallel.context_parallel_attention`): keys and values
  all-gathered forward (2 all-gathers, results [B', S, G, K]); their gradients reduce-scattered
  backward (2 reduce-scatters, results [B', S/n, G, K]).
- ring (`context_parallel_ring`, `model/ring_attention.py`): forward, keys and values make
  n - 1 hops each (2(n - 1) permutes of [B', S/n, G, K]); backward, stacked, they go around
  the other way (n - 1 permutes of [2, B', S/n, G, K]) and their fp32 gradients, stacked, make
  n hops home (n permutes). A load-balanced (zigzag) layer reorders queries, keys, values and
  the output forward (and the bias's rows [1, H, L/n, S] where there is one) and their
  gradients backward, half a chunk per permute: two permutes per tensor, one for n = 2 (whose
  first halves stay where they are).
- the ring's mask features (one int32 per position, the same in every layer of a stack): keys'
  features go around the ring forward and backward (2(n - 1) permutes of [B', S/n]; for n = 2
  XLA reuses the forward's, the backward ring's direction being the same), and a zigzag mask
  reorders the queries' and keys' features, once per distinct mask (a stack's self-attention,
  the decoder's cross-attention): XLA computes them once for all layers of a stack.

Under remat (`remat_policy` minimal or full) each layer's ring forward runs again in the
backward pass, to rebuild what its custom_vjp keeps (`minimal` saves the projections only):
the forward's key/value permutes and a balanced layer's zigzag sends (queries, keys, values,
the bias's rows in, the output back) are sent again; the mask features are not (computed once
outside the layers). Exact for scanned layers and unscanned `full` on a decoder-only model;
elsewhere (unscanned `minimal`, T5) XLA:CPU may reuse some of the forward's sends where the
recomputed values equal them, and the model is an upper bound.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import numpy as np

from t5lite.insight.memory import rule_of
from t5lite.partitioning import mesh_axes_of
from t5lite.trainer import Trainer

PERMUTE = "collective-permute"


@dataclasses.dataclass(frozen=True)
class AttentionLayer:
    """One kind of attention layer of the model, as context parallelism sees it."""

    name: str  # e.g. 'decoder self-attention'
    layers: int  # how many such layers
    length_q: int
    length_kv: int
    balanced: bool  # ring only: zigzag load balancing
    bias: bool  # an additive bias [1, H, L, S] (relative positions)
    mask: str  # the mask's name: layers sharing it share its features' permutes


@dataclasses.dataclass(frozen=True)
class LayerCollectives:
    """One attention layer's collectives on the context axes: count and result bytes."""

    layer: AttentionLayer
    kind: str
    count: int
    bytes: int
    why: str


def context_axes(trainer: Trainer) -> tuple[tuple[str, ...], bool] | None:
    """(the context axes, ring?) when the rules split `length` for attention, else None."""
    part = trainer.partitioner
    shape = dict(part.mesh.shape)
    cp = tuple(t for t in mesh_axes_of(rule_of(part, "length")) if shape.get(t, 1) > 1)
    if not cp or any(set(cp) & set(mesh_axes_of(rule_of(part, n))) for n in ("heads", "mlp")):
        return None  # sequence parallelism's `length` (heads / mlp take the axis first)
    kv = tuple(t for t in mesh_axes_of(rule_of(part, "kv_length")) if shape.get(t, 1) > 1)
    return cp, kv == cp


def attention_layers(trainer: Trainer, n: int) -> list[AttentionLayer]:
    """The model's attention layers, by kind."""
    cfg, lengths = trainer.model.network_config, trainer.lengths
    if hasattr(cfg, "num_encoder_layers"):
        li, lt = lengths["inputs"], lengths["targets"]
        return [
            AttentionLayer(
                "encoder self-attention", cfg.num_encoder_layers, li, li, False, True, "enc"
            ),
            AttentionLayer(
                "decoder self-attention",
                cfg.num_decoder_layers,
                lt,
                lt,
                lt % (2 * n) == 0,
                True,
                "dec",
            ),
            AttentionLayer(
                "cross-attention", cfg.num_decoder_layers, lt, li, False, False, "cross"
            ),
        ]
    length = lengths["targets"] + lengths.get("inputs", 0)
    prefix = getattr(trainer.model, "feature_converter", "lm") == "prefix_lm" and getattr(
        trainer.model, "inputs_bidirectional_attention", True
    )
    balanced = not prefix and length % (2 * n) == 0
    bias = getattr(cfg, "position_embedding", "rope") == "relative"
    return [
        AttentionLayer("self-attention", cfg.num_layers, length, length, balanced, bias, "self")
    ]


def _sizes(trainer: Trainer, cp: tuple[str, ...]) -> tuple[int, int, int, int, int, int]:
    """(n, B', H local, G local, K, compute itemsize)."""
    part, cfg = trainer.partitioner, trainer.model.network_config
    shape = dict(part.mesh.shape)
    n = math.prod(shape[t] for t in cp)
    b = trainer.batch_size // part.data_parallel_size

    def split(name: str) -> int:
        return math.prod(shape.get(t, 1) for t in mesh_axes_of(rule_of(part, name)))

    h = cfg.num_heads // split("heads")
    g_name = "heads" if not getattr(cfg, "num_kv_heads", None) else "kv_heads"
    g = (getattr(cfg, "num_kv_heads", None) or cfg.num_heads) // split(g_name)
    return n, b, h, g, cfg.head_dim, np.dtype(cfg.policy.compute).itemsize


def context_layer_collectives(trainer: Trainer) -> list[LayerCollectives]:
    """Each attention layer's collectives on the context axes (per layer; masks per mask)."""
    found = context_axes(trainer)
    if found is None:
        return []
    cp, ring = found
    n, b, h, g, k, it = _sizes(trainer, cp)
    remat = trainer.model.network_config.remat_policy != "none"
    out = []
    for layer in attention_layers(trainer, n):
        kv = b * (layer.length_kv // n) * g * k  # elements of one device's keys (or values)
        if not ring:
            out += [
                LayerCollectives(layer, "all-gather", 2, 2 * kv * n * it, "keys, values gathered"),
                LayerCollectives(
                    layer, "reduce-scatter", 2, 2 * kv * it, "their gradients scattered back"
                ),
            ]
            continue
        hops = n - 1
        halves = 2 if n > 2 else 1  # n = 2 keeps its first halves where they are
        out += [
            LayerCollectives(layer, PERMUTE, 2 * hops, 2 * hops * kv * it,
                             "keys, values around the ring (forward)"),
            LayerCollectives(layer, PERMUTE, hops, 2 * hops * kv * it,
                             "keys and values stacked, around the other way (backward)"),
            LayerCollectives(layer, PERMUTE, n, 2 * n * kv * 4,
                             "key/value gradients (fp32, stacked) home with their chunk"),
        ]  # fmt: skip
        if layer.balanced:
            q = b * (layer.length_q // n) * h * k
            # q, k, v, out forward; their gradients backward; `halves` halves of each
            moved = 2 * (2 * q + 2 * kv) * it * halves // 2
            count = 8 * halves
            if layer.bias:
                moved += 2 * h * (layer.length_q // n) * layer.length_kv * 4 * halves // 2
                count += 2 * halves
            out.append(
                LayerCollectives(layer, PERMUTE, count, moved,
                                 "zigzag: queries, keys, values, output (and bias rows) reordered")
            )  # fmt: skip
        if remat:
            out.append(_rematerialised(layer, n, b, h, kv, k, it))
    return out


def _rematerialised(
    layer: AttentionLayer, n: int, b: int, h: int, kv: int, k: int, it: int
) -> LayerCollectives:
    """The forward ring sent again by a rematerialised layer in the backward pass: keys and
    values around the ring and, balanced, the zigzag's forward half (q, k, v in, the output
    back, the bias's rows in)."""
    count, size = 2 * (n - 1), 2 * (n - 1) * kv * it
    if layer.balanced:
        halves = 2 if n > 2 else 1
        q = b * (layer.length_q // n) * h * k
        count += 4 * halves
        size += (2 * q + 2 * kv) * it * halves // 2
        if layer.bias:
            count += halves
            size += h * (layer.length_q // n) * layer.length_kv * 4 * halves // 2
    why = "remat: the forward ring (and zigzag) sent again in the backward pass"
    return LayerCollectives(layer, PERMUTE, count, size, why)


def mask_collectives(trainer: Trainer) -> list[LayerCollectives]:
    """The ring's mask features: permuted once per distinct mask (see the module docstring)."""
    found = context_axes(trainer)
    if found is None or not found[1]:
        return []
    n, b = _sizes(trainer, found[0])[:2]
    out, seen = [], set()
    for layer in attention_layers(trainer, n):
        if layer.mask in seen:
            continue
        seen.add(layer.mask)
        # Forward and backward; for n = 2 the backward ring's direction is the forward's and
        # XLA reuses the forward's sends of these (the same values).
        trips = 2 if n > 2 else 1
        count, size = trips * (n - 1), trips * (n - 1) * b * (layer.length_kv // n) * 4
        if layer.balanced:
            halves = 2 if n > 2 else 1
            count, size = (
                count + 2 * halves,
                size + 2 * halves * b * (layer.length_q // (2 * n)) * 4,
            )
        out.append(LayerCollectives(layer, PERMUTE, count, size, "mask features (int32)"))
    return out


def format_context(rows: list[LayerCollectives], masks: list[LayerCollectives]) -> list[str]:
    """Lines for a report: per attention layer, its collectives on the context axes."""
    if not rows:
        return []
    lines = ["    context parallelism, per attention layer (per device, one step):"]
    for r in rows:
        lines.append(
            f"      {r.layer.name:<24}{r.kind:<20}{r.count:>4} x{r.layer.layers:<3}"
            f"{r.bytes:>14,} B  {r.why}"
        )
    for r in masks:
        lines.append(
            f"      {r.layer.name:<24}{r.kind:<20}{r.count:>4} x1  {r.bytes:>14,} B  {r.why}"
        )
    return lines


def summary(rows: list[LayerCollectives], masks: list[LayerCollectives]) -> dict[str, Any]:
    """Totals per kind over the whole step: {kind: (count, bytes)}."""
    total: dict[str, list[int]] = {}
    for r in rows:
        t = total.setdefault(r.kind, [0, 0])
        t[0] += r.count * r.layer.layers
        t[1] += r.bytes * r.layer.layers
    for r in masks:
        t = total.setdefault(r.kind, [0, 0])
        t[0] += r.count
        t[1] += r.bytes
    return {k: tuple(v) for k, v in total.items()}
