"""2D (SUMMA) and 3D tensor parallelism per dense layer: what the layout compiles to, beside
the papers' terms and 1D Megatron's.

`layer_collectives` compiles one dense layer's forward and backward (`jax.vjp` of the
contraction, under a partitioner's mesh and rules) and reads the collectives from the HLO.
`paper_terms` gives the papers' per-layer collectives, bytes each device sends (ring
algorithms), and the fractions of parameters and activations each device holds:

- 1D Megatron (P devices): one all-reduce of the residual stream forward and one backward per
  pair of column/row-parallel layers, so one per layer: 2 (P-1)/P T min(N, K) sent;
  parameters 1/P, activations whole.
- 2D Optimus (q x q, Xu et al. 2021): SUMMA's three matmuls each move two operand blocks:
  6 collectives, 3 (q-1)/q^2 (T N + N K) sent; parameters and activations 1/q^2.
- 3D (q x q x q, Bian et al. 2021): forward all-gathers of X and A and a reduce-scatter of Y,
  backward the mirror: 6 collectives, 2 (q-1)/q^3 (T N + N K + T K) sent; 1/q^3 each.

With T = N = K = n these are the surveys' 2 (P-1)/P, 6 (q-1)/q and 6 (q-1)/q^3 (in n^2 and
n^2/q units).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding

from t5lite.insight.communication import collective_rows
from t5lite.insight.hlo import CollectiveRow, parse_collectives
from t5lite.insight.step_parts import step_parts
from t5lite.model.dense import DenseGeneral
from t5lite.partitioning import Partitioner, resolve_logical_axes
from t5lite.partitioning.tensor_mesh import SCHEMES
from t5lite.trainer import Trainer

SCHEME_DIMS = {"megatron": 1, "summa_2d": 2, "tensor_3d": 3}


@dataclasses.dataclass(frozen=True)
class PaperTerms:
    """One dense layer [T, N] x [N, K], forward and backward, per device, as a paper counts."""

    scheme: str
    devices: int
    collectives: int
    link_bytes: float
    param_fraction: float
    activation_fraction: float


def paper_terms(scheme: str, devices: int, t: int, n: int, k: int, itemsize: int) -> PaperTerms:
    """The paper's terms for `scheme` ('megatron', 'summa_2d', 'tensor_3d') on `devices`."""
    dims = SCHEME_DIMS[scheme]
    q = round(devices ** (1 / dims))
    if q**dims != devices:
        raise ValueError(f"{scheme} needs a {'square' if dims == 2 else 'cube'} device count")
    if dims == 1:  # a column-parallel layer all-reduces [T, N] backward, a row-parallel [T, K]
        sent = 2 * (q - 1) / q * t * min(n, k)
        return PaperTerms(scheme, devices, 1, sent * itemsize, 1 / q, 1.0)
    if dims == 2:
        sent = 3 * (q - 1) / q**2 * (t * n + n * k)
        return PaperTerms(scheme, devices, 6, sent * itemsize, 1 / q**2, 1 / q**2)
    sent = 2 * (q - 1) / q**3 * (t * n + n * k + t * k)
    return PaperTerms(scheme, devices, 6, sent * itemsize, 1 / q**3, 1 / q**3)


def layer_collectives(
    partitioner: Partitioner,
    x_shape: Sequence[int],
    x_axes: Sequence[str],
    kernel_shape: Sequence[int],
    kernel_axes: Sequence[str],
    n_contract: int = 1,
    dtype: jnp.dtype = jnp.float32,
) -> list[CollectiveRow]:
    """The collectives one dense layer's forward and backward compile to under `partitioner`:
    `DenseGeneral` with `input_axes` contracting x's last `n_contract` dims, the output's
    gradient given laid out as the rules say."""
    n = n_contract
    out_axes = tuple(x_axes[: len(x_axes) - n]) + tuple(kernel_axes[n:])
    out_shape = tuple(x_shape[: len(x_shape) - n]) + tuple(kernel_shape[n:])
    layer = DenseGeneral(
        tuple(kernel_shape[n:]),
        tuple(kernel_axes),
        axis=tuple(range(-n, 0)),
        input_axes=tuple(x_axes),
        dtype=dtype,
        param_dtype=dtype,
    )

    def sharding(axes, shape):
        spec, _ = resolve_logical_axes(axes, partitioner.rules, shape=shape, mesh=partitioner.mesh)
        return NamedSharding(partitioner.mesh, spec)

    def step(x, k, dy):
        y, vjp = jax.vjp(lambda x, k: layer.apply({"params": {"kernel": k}}, x), x, k)
        return (y, *vjp(dy))

    shapes = [(x_shape, x_axes), (kernel_shape, kernel_axes), (out_shape, out_axes)]
    args = [jax.ShapeDtypeStruct(tuple(s), dtype, sharding=sharding(a, s)) for s, a in shapes]
    with partitioner.context():
        hlo = jax.jit(step).lower(*args).compile().as_text()
    return collective_rows(parse_collectives(hlo, partitioner.mesh))


def format_layer(
    name: str,
    t: int,
    n: int,
    k: int,
    rows: Sequence[CollectiveRow],
    scheme: str,
    devices: int,
    itemsize: int,
) -> list[str]:
    """Report lines: the compiled collectives of one layer, the paper's terms and Megatron's."""
    count, sent = sum(r.count for r in rows), sum(r.link_bytes for r in rows)
    paper = paper_terms(scheme, devices, t, n, k, itemsize)
    mega = paper_terms("megatron", devices, t, n, k, itemsize)
    lines = [f"    {name} [{t}, {n}] x [{n}, {k}], forward + backward, per device:"]
    for r in rows:
        lines.append(f"      {r.kind:<16}{r.axes_str:<26}{r.count:>4} x  {r.link_bytes:>12,.0f} B")
    lines += [
        f"      {'compiled':<42}{count:>4}    {sent:>12,.0f} B",
        f"      {scheme + ' (paper)':<42}{paper.collectives:>4}    {paper.link_bytes:>12,.0f} B"
        f"   ratio {sent / paper.link_bytes if paper.link_bytes else 0:.2f}",
        f"      {'1D Megatron, same devices':<42}{mega.collectives:>4}    "
        f"{mega.link_bytes:>12,.0f} B   {scheme}/1D {paper.link_bytes / mega.link_bytes:.2f}",
        f"      memory per device: params 1/{1 / paper.param_fraction:.0f} "
        f"(1D 1/{1 / mega.param_fraction:.0f}), activations 1/{1 / paper.activation_fraction:.0f}"
        f" (1D 1/{1 / mega.activation_fraction:.0f})",
    ]
    return lines


def scheme_of(mesh_shape: dict[str, int]) -> tuple[str, int] | None:
    """('summa_2d' or 'tensor_3d', q) when the mesh has that scheme's tensor axes."""
    for scheme, axes in SCHEMES.items():
        if all(a in mesh_shape for a in axes):
            return scheme, mesh_shape[axes[0]]
    return None


def tensor_nd_lines(trainer: Trainer) -> list[str]:
    """Per dense layer of `trainer`'s model on a 2D/3D mesh: the collectives its forward and
    backward compile to beside the paper's terms and 1D Megatron's ([] on other meshes)."""
    part, cfg = trainer.partitioner, trainer.model.network_config
    found = scheme_of(dict(part.mesh.shape))
    if found is None:
        return []
    scheme, q = found
    dims = SCHEME_DIMS[scheme]
    length = trainer.lengths.get("targets") or trainer.lengths["inputs"]
    b, d, f = trainer.batch_size, cfg.emb_dim, cfg.mlp_dim
    h, k = cfg.num_heads, cfg.head_dim
    t = b * length // part.mesh.shape["data"]
    layers = [
        ("mlp wi", (b, length, d), ("batch", "length", "embed"), (d, f), ("embed", "mlp"), 1),
        ("mlp wo", (b, length, f), ("batch", "length", "mlp"), (f, d), ("mlp", "embed"), 1),
        (
            "attention q",
            (b, length, d),
            ("batch", "length", "embed"),
            (d, h, k),
            ("embed", "heads", "kv"),
            1,
        ),
        (
            "attention out",
            (b, length, h, k),
            ("batch", "length", "heads", "kv"),
            (h, k, d),
            ("heads", "kv", "embed"),
            2,
        ),
    ]
    lines = [f"{scheme} tensor parallelism, q={q}, per dense layer (T = {t} tokens a replica):"]
    for name, xs, xa, ks, ka, n in layers:
        rows = layer_collectives(part, xs, xa, ks, ka, n)
        rows = [
            r for r in rows if r.axes and set(r.axes) <= {a for x in SCHEMES.values() for a in x}
        ]
        n_in, n_out = math.prod(ks[:n]), math.prod(ks[n:])
        lines += format_layer(name, t, n_in, n_out, rows, scheme, q**dims, 4)
    return lines


@dataclasses.dataclass(frozen=True)
class SchemeEstimate:
    """One scheme's analytic train step for a transformer's dense layers on `chips` devices."""

    scheme: str
    tensor_devices: int  # P (1D), q^2 (2D) or q^3 (3D); `data` takes the rest
    collectives: int  # per step, the dense layers' (forward + backward)
    link_bytes: float  # each device sends per step
    compute_s: float
    communication_s: float
    param_fraction: float
    activation_fraction: float

    @property
    def step_s(self) -> float:
        """Compute plus communication, not overlapped (an upper bound)."""
        return self.compute_s + self.communication_s


def _largest_side(chips: int, dims: int) -> int:
    return max(q for q in range(1, chips + 1) if chips % q**dims == 0)


def rank_schemes(
    emb: int,
    mlp: int,
    attention: int,
    layers: int,
    tokens: int,
    chips: int,
    peak_flops: float,
    link_bytes_per_s: float,
    itemsize: int = 2,
) -> list[SchemeEstimate]:
    """1D, 2D and 3D for a decoder's dense layers on `chips` devices, fastest first: q, k, v as
    one [D, 3 H K] layer (their input gathered once), out [H K, D], a gated MLP's two input
    kernels as one [D, 2 F], wo [F, D]. Each scheme's tensor group is the largest of its shape
    that divides `chips` (`data` the rest); `tokens` are the global batch's.

    Compute is 6 x parameters x tokens / (chips x peak), the same for every scheme (the blocks
    divide the matmuls evenly); communication is `paper_terms` at `link_bytes_per_s` (1D:
    Megatron's two all-reduces of [T, D] per block, forward and backward).
    """
    shapes = [(emb, 3 * attention), (attention, emb), (emb, 2 * mlp), (mlp, emb)]
    params = layers * sum(n * k for n, k in shapes)
    compute = 6 * params * tokens / (chips * peak_flops)
    out = []
    for scheme, dims in SCHEME_DIMS.items():
        group = _largest_side(chips, dims) ** dims
        t = tokens // (chips // group)
        terms = [paper_terms(scheme, group, t, n, k, itemsize) for n, k in shapes]
        sent = layers * sum(x.link_bytes for x in terms)
        count = layers * sum(x.collectives for x in terms)
        if dims == 1:  # 2 blocks x (forward + backward) all-reduces of the residual [T, D]
            sent = layers * 4 * 2 * (group - 1) / group * t * emb * itemsize
            count = layers * 4
        out.append(
            SchemeEstimate(
                scheme,
                group,
                count,
                sent,
                compute,
                sent / link_bytes_per_s,
                terms[0].param_fraction,
                terms[0].activation_fraction,
            )
        )
    return sorted(out, key=lambda e: e.step_s)


def ranking_lines(
    network_config, lengths: dict[str, int], batch_size: int, chips: int, spec
) -> list[str]:
    """`rank_schemes` for a model's config as report lines. A T5 counts its encoder and decoder
    layers alike (cross-attention left out) at the mean of its input and target lengths."""
    cfg = network_config
    layers = getattr(cfg, "num_layers", None) or cfg.num_encoder_layers + cfg.num_decoder_layers
    length = sum(lengths.values()) / len(lengths)
    tokens = int(batch_size * length)
    ranked = rank_schemes(
        cfg.emb_dim,
        cfg.mlp_dim,
        cfg.num_heads * cfg.head_dim,
        layers,
        tokens,
        chips,
        spec.peak_flops,
        spec.link_bytes_per_s,
    )
    lines = [
        "1D / 2D / 3D tensor parallelism, the dense layers' step, analytic:",
        f"  {spec.device_kind[:30]}, {chips} chips, {tokens} tokens a step",
        f"  {'scheme':<11}{'group':>6}{'step (ms)':>11}{'comm (ms)':>11}{'collectives':>13}"
        f"{'params':>8}{'acts':>7}",
    ]
    for e in ranked:
        lines.append(
            f"  {e.scheme:<11}{e.tensor_devices:>6}{e.step_s * 1e3:>11.1f}"
            f"{e.communication_s * 1e3:>11.1f}{e.collectives:>13}"
            f"{f'1/{round(1 / e.param_fraction)}':>8}{f'1/{round(1 / e.activation_fraction)}':>7}"
        )
    lines += [
        f"  {e.scheme} cannot split this model: {why}"
        for e in ranked
        if (why := indivisible(cfg, e.scheme, e.tensor_devices))
    ]
    return lines


def indivisible(network_config, scheme: str, tensor_devices: int) -> str | None:
    """Which of a model's dimensions `scheme`'s rules split by a size that does not divide it
    (None: all divide): 1D splits heads and the MLP over P; 2D splits the features over q
    (`tensor_col`) and embed over q (`tensor_row`); 3D splits heads, the MLP and embed over
    q^2 ((`tensor_j`, `tensor_l`))."""
    cfg, dims = network_config, SCHEME_DIMS[scheme]
    q = round(tensor_devices ** (1 / dims))
    split = {1: tensor_devices, 2: q, 3: q * q}[dims]
    kv = getattr(cfg, "num_kv_heads", None) or cfg.num_heads
    sizes = {"heads": cfg.num_heads, "kv_heads": kv, "mlp": cfg.mlp_dim}
    if dims > 1:
        sizes["embed"] = cfg.emb_dim
    bad = [f"{name} {n}" for name, n in sizes.items() if n % split]
    return f"{', '.join(bad)} not divisible by {split}" if bad else None


@dataclasses.dataclass(frozen=True)
class StepTerms:
    """One scheme's train step as t5lite compiles it, analytic: bytes each device sends for the
    transformer layers and for the logits (the part the per-layer formulas leave out)."""

    scheme: str
    tensor_devices: int
    layers: float
    logits: float
    gradients: float  # the all-reduce over `data` of every parameter's gradient block
    compute_s: float

    @property
    def link_bytes(self) -> float:
        return self.layers + self.logits + self.gradients


def step_terms(
    scheme: str,
    emb: int,
    mlp: int,
    attention: int,
    vocab: int,
    layers: int,
    tokens: int,
    chips: int,
    peak_flops: float,
    itemsize: int = 2,
    q: int | None = None,
) -> StepTerms:
    """What t5lite's `scheme` sends per step for a gated decoder's layers and untied logits.

    Layers: 1D Megatron's 4 all-reduces of [T, D] per layer; 2D t5lite's (no backward
    re-broadcast: 2 (q-1)/q^2 of the two operands each layer gathers, the input for q, k, v,
    wi, the output for `out` and `wo`, stored [F -> col, D -> row]); 3D the paper's. Logits
    [T, D] x [D, V], computed in float32: 1D all-reduces the input's gradient [T, D] once
    (at `itemsize`: the compilers reduce it after its cast back); 2D gathers x and the kernel
    and reduce-scatters their gradients; 3D also reduce-scatters the [T, V] logits over
    `tensor_l` and gathers their gradient back, the term that makes it the largest for a
    vocabulary much wider than D. 2D and 3D gather at `itemsize` and reduce inside the
    float32 contraction, at 4 bytes. Gradients: with `data` = d > 1, each device's block
    of every parameter (the embedding's included) all-reduced over d, 2 (d-1)/d of it.
    """
    dims = SCHEME_DIMS[scheme]
    group = _largest_side(chips, dims) ** dims
    q = round(group ** (1 / dims))
    t = tokens // (chips // group)
    wide = itemsize + 4  # a gathered block at itemsize, its gradient reduced at 4 bytes
    if dims == 1:
        ring = 2 * (group - 1) / group * t * emb
        sent_layers, sent_logits = layers * 4 * ring * itemsize, ring * itemsize
    elif dims == 2:
        f = 2 * (q - 1) / q**2
        gathered = [t * emb + emb * 3 * attention, attention * emb + t * emb]
        gathered += [t * emb + emb * 2 * mlp, mlp * emb + t * emb]
        sent_layers = layers * f * sum(gathered) * itemsize
        sent_logits = (q - 1) / q**2 * (t * emb + emb * vocab) * wide
    else:
        shapes = [(emb, 3 * attention), (attention, emb), (emb, 2 * mlp), (mlp, emb)]
        terms = [paper_terms(scheme, group, t, n, k, itemsize) for n, k in shapes]
        sent_layers = layers * sum(x.link_bytes for x in terms)
        sent_logits = (q - 1) / q**3 * (t * emb + emb * vocab + t * vocab) * wide
    params = layers * (emb * 3 * attention + attention * emb + 3 * emb * mlp) + emb * vocab
    compute = 6 * params * tokens / (chips * peak_flops)
    d = chips // group
    grads = 2 * (d - 1) / d * (params + emb * vocab) / group * itemsize
    return StepTerms(scheme, group, sent_layers, sent_logits, grads, compute)


def _model_dims(network_config, lengths: dict[str, int], batch_size: int) -> tuple:
    """(emb, mlp, attention, vocab, layers, tokens) of a model as the rankings count it."""
    cfg = network_config
    layers = getattr(cfg, "num_layers", None) or cfg.num_encoder_layers + cfg.num_decoder_layers
    tokens = int(batch_size * sum(lengths.values()) / len(lengths))
    attention = cfg.num_heads * cfg.head_dim
    return cfg.emb_dim, cfg.mlp_dim, attention, cfg.vocab_size, layers, tokens


def whole_step_lines(
    network_config, lengths: dict[str, int], batch_size: int, chips: int, spec, itemsize: int = 2
) -> list[str]:
    """`step_terms` of the three schemes, fastest first, as report lines: the ranking of what
    t5lite compiles (its 2D, the logits included) beside the survey's per-layer one."""
    emb, mlp, att, vocab, layers, tokens = _model_dims(network_config, lengths, batch_size)
    rows = [
        step_terms(s, emb, mlp, att, vocab, layers, tokens, chips, spec.peak_flops, itemsize)
        for s in SCHEME_DIMS
    ]
    rows.sort(key=lambda r: r.compute_s + r.link_bytes / spec.link_bytes_per_s)
    lines = [
        "the same, whole step as t5lite compiles it (its 2D, the logits included), analytic:",
        f"  {'scheme':<11}{'group':>6}{'step (ms)':>11}{'comm (ms)':>11}{'layers (MB)':>13}"
        f"{'logits (MB)':>13}{'grads (MB)':>12}",
    ]
    for r in rows:
        comm = r.link_bytes / spec.link_bytes_per_s
        lines.append(
            f"  {r.scheme:<11}{r.tensor_devices:>6}{(r.compute_s + comm) * 1e3:>11.1f}"
            f"{comm * 1e3:>11.1f}{r.layers / 1e6:>13.1f}{r.logits / 1e6:>13.1f}"
            f"{r.gradients / 1e6:>12.1f}"
        )
    return lines


def step_part_lines(trainer: Trainer, hlo_text: str) -> list[str]:
    """The compiled step's collectives per part (`step_parts`) beside `step_terms` where a
    formula covers the part (the layers and logits of a decoder-only model)."""
    part, cfg = trainer.partitioner, trainer.model.network_config
    found = scheme_of(dict(part.mesh.shape))
    if found is None:
        return []
    parts = step_parts(hlo_text, part.mesh)
    formula = {}
    if getattr(cfg, "num_layers", None) and not getattr(cfg, "logits_via_embedding", True):
        emb, mlp, att, vocab, layers, tokens = _model_dims(cfg, trainer.lengths, trainer.batch_size)
        chips = part.mesh.devices.size
        itemsize = jnp.dtype(cfg.policy.compute).itemsize
        terms = step_terms(
            found[0], emb, mlp, att, vocab, layers, tokens, chips, 1.0, itemsize, q=found[1]
        )
        formula = {"layers": terms.layers, "logits": terms.logits}
    total = sum(r.link_bytes for r in parts.values())
    what = f"{found[0]} formula" if formula else "formulas for decoder-only, untied logits"
    lines = [f"whole train step, compiled, by part (bytes sent per device; {what}):"]
    for name, r in parts.items():
        want = formula.get(name)
        tail = f"{want:>14,.0f} B   ratio {r.link_bytes / want:.2f}" if want else ""
        lines.append(f"    {name:<11}{r.count:>5} x {r.link_bytes:>14,.0f} B {tail}".rstrip())
    lines.append(f"    {'step':<11}{sum(r.count for r in parts.values()):>5} x {total:>14,.0f} B")
    return lines
