"""A GPipe step's compiled work: its layers' dot FLOPs are `(m + p - 1) / m` times the
unpipelined step's, counted from the compiled HLO (loop bodies times trip counts) and
independently from the model's shapes, and no layer runs in a loop nested in the tick loop
(docs/pipeline.md: a nested layer scan stacked each tick's residuals twice)."""

from test_pipeline import BATCH, LENGTHS, LM, _trainer

from t5lite.insight.hlo import dot_flops


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
