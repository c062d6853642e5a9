"""A GPipe step's compiled work: its layers' dot FLOPs are `(m + p - 1) / m` times the
unpipelined step's, counted from the compiled HLO (loop bodies times trip counts) and
independently from the model's shapes, and no layer runs in a loop nested in the tick loop
(docs/pipeline.md: a nested layer scan stacked each tick's residuals twice); beyond the
schedule's work, each backward tick adds the stage's layer gradients to the step's, as
`inspect` says."""

import collections
import math
import re

import jax
from test_pipeline import BATCH, LENGTHS, LM, _trainer

from t5lite.insight import pipeline as insight_pipeline
from t5lite.insight.hlo import _COMPUTATION_RE, dot_flops, executions


def _layer_flops_per_token() -> int:
    """One layer's forward and backward (2 products of each forward's) dot FLOPs per token of
    the test LM, whole (no model split): q, k, v, o projections; scores and values over the
    whole length (the causal mask computes all of them); the gated MLP's wi_0, wi_1, wo."""
    d, f, length = LM["emb_dim"], LM["mlp_dim"], LENGTHS["targets"]
    inner = LM["num_heads"] * LM["head_dim"]
    forward = 2 * (4 * d * inner + 2 * length * inner + 3 * d * f)
    return 3 * forward


def _compiled(tr) -> str:
    with tr.partitioner.context():
        return tr.train_step.lower(tr.abstract_state(), tr.batch_abstract).compile().as_text()


def test_gpipe_layer_dot_flops_are_the_schedules():
    """stage=2 x data=2 x model=2, m=4 (T = 5 ticks) against data=4 x model=2: a device runs its
    2 layers on a microbatch's 2 rows at each of the T ticks (the bubble's ticks on stale
    data), so its layer dots are T/m = 1.25 times the unpipelined device's 4 layers on 4 rows,
    exactly; and each runs T times a step, in the tick loop itself."""
    p, m, model = 2, 4, 2
    t = m + p - 1
    pp, ref = _trainer("megatron", p, model), _trainer("megatron", 1, model)
    per_token = _layer_flops_per_token() // model  # heads and MLP split over `model`
    tokens = LENGTHS["targets"]
    ref_rows = BATCH // (8 // model)
    mb_rows = BATCH // m // (8 // model // p)
    want_ref = LM["num_layers"] * ref_rows * tokens * per_token
    want_pp = t * LM["num_layers"] // p * mb_rows * tokens * per_token
    assert want_pp * m == want_ref * t
    ref_hlo, pp_hlo = _compiled(ref), _compiled(pp)
    assert dot_flops(ref_hlo, min_runs=2) == want_ref
    assert dot_flops(pp_hlo, min_runs=2) == want_pp
    # Every layer dot sits in a loop of exactly T trips: none in a loop nested in the ticks.
    assert dot_flops(pp_hlo, min_runs=t) == want_pp
    assert dot_flops(pp_hlo, min_runs=t + 1) == 0


_FUSION_RE = re.compile(r"^\s*(?:ROOT )?%[\w.\-]+ = f32\[([\d,]*)\]\S* fusion\(")


def test_gpipe_accumulates_the_stage_layer_gradients_each_tick():
    """stage=2 x data=2 x model=2, m=4: in each of the T = 5 backward ticks the stage's 2
    layers' fp32 gradients (q, k, v, o, wi_0, wi_1, wo and two norm scales, heads and MLP split
    over `model`) are added to the step's: one add fusion per stacked parameter, shaped as its
    shard, in the tick loop. `inspect`'s figure counts it: read, add, write, 3 x T x 10.25 KiB."""
    p, m, model = 2, 4, 2
    t = m + p - 1
    tr = _trainer("megatron", p, model, m)
    hlo = _compiled(tr)
    d, f, inner = LM["emb_dim"], LM["mlp_dim"], LM["num_heads"] * LM["head_dim"]
    per_layer = (4 * d * inner + 3 * d * f) // model + 2 * d
    want = LM["num_layers"] // p * per_layer * 4
    figures = insight_pipeline.pipeline_figures(tr, hlo)
    assert figures.tick_gradient_bytes == want == 10496
    assert figures.accumulation_bytes == 3 * t * want
    assert (
        "\n  beyond the schedule's (m+p-1)/m work: each backward tick adds the stage's layer "
        "gradients to the step's, 3 x 5 x 10.25 KiB = 153.75 KiB moved\n" in figures.format()
    )
    # The compiled tick loop: its gradient adds shaped as the stacked layer parameters' shards.
    shards = collections.Counter(
        tuple(s.shard_shape(x.shape))
        for (path, x), s in zip(
            jax.tree_util.tree_leaves_with_path(tr.state_abstract.params),
            jax.tree_util.tree_leaves(tr.state_shardings.params),
        )
        if "layers" in jax.tree_util.keystr(path)
    )
    runs, comp, adds = executions(hlo), None, collections.Counter()
    for line in hlo.splitlines():
        if header := _COMPUTATION_RE.match(line):
            comp = header.group("name")
            continue
        fusion = _FUSION_RE.match(line)
        if fusion and runs.get(comp, 1) == t and "transpose(jvp" in line and 'add_any"' in line:
            shape = tuple(int(n) for n in fusion.group(1).split(",") if n)
            adds[shape] += shape in shards
    assert +adds == shards
    assert sum(4 * math.prod(s) * n for s, n in adds.items()) == want


def _dense_operand_ranks(stages: int, data: int) -> list[int]:
    """The ranks of the dot operands `constraints.dense` traces inside a shard_map manual over
    `stage` of a (stage, data, model=1) mesh: a pipeline stage's dense layer."""
    import numpy as np
    from jax.sharding import Mesh
    from jax.sharding import PartitionSpec as P

    from t5lite import constraints

    mesh = Mesh(
        np.array(jax.devices()[: stages * data]).reshape(stages, data, 1),
        ("stage", "data", "model"),
    )
    body = jax.shard_map(
        lambda x, k: constraints.dense(x, k, 1),
        mesh=mesh,
        in_specs=(P("stage"), P()),
        out_specs=P("stage"),
        axis_names={"stage"},
    )
    x, kernel = (
        jax.ShapeDtypeStruct((8, 4, 16), "float32"),
        jax.ShapeDtypeStruct((16, 32), "float32"),
    )
    jaxpr = jax.make_jaxpr(body)(x, kernel)
    dots = [e for e in jaxpr.eqns[0].params["jaxpr"].eqns if e.primitive.name == "dot_general"]
    return [v.aval.ndim for e in dots for v in e.invars]


def test_a_one_device_stage_merges_a_dense_layers_batch_and_length():
    """Inside a stage whose other axes are one device the dense layer is one [b L, D] x [D, F]
    dot, as in a one-device program: kept 3-D, XLA:CPU copied each weight gradient's
    activation gradient transposed first (a fifth of the benchmark's GPipe step,
    docs/pipeline.md). With the batch split over `data` it stays 3-D for the partitioner."""
    assert _dense_operand_ranks(2, 1) == [2, 2]
    assert _dense_operand_ranks(2, 2) == [3, 2]
