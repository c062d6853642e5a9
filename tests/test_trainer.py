"""Trainer: loss goes down, gradient accumulation equals one big batch, optimizers."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from conftest import require_devices, reverse_batch
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from tiny_networks import TINY_T5

from t5lite import partitioning
from t5lite.insight import communication, comparison
from t5lite.insight.hlo import collective_ops, parse_collectives
from t5lite.insight.sharding import sharding_report
from t5lite.model import optimizers
from t5lite.model.models import EncoderDecoderModel
from t5lite.trainer import Trainer, summarize

LENGTHS = {"inputs": 8, "targets": 8}


def _trainer(k=1, num_partitions=2, optimizer=None, batch_size=16):
    require_devices(8)
    part = partitioning.Partitioner(num_partitions=num_partitions)
    model = EncoderDecoderModel(TINY_T5, optimizer=optimizer or optimizers.AdamW(1e-2))
    return Trainer(model, part, batch_size=batch_size, lengths=LENGTHS, num_microbatches=k)


def test_loss_goes_down_and_state_is_sharded():
    tr = _trainer()
    state = tr.init_state()
    wi = state.params["encoder"]["layers_0"]["mlp"]["wi_0"]["kernel"]
    assert wi.sharding == NamedSharding(tr.partitioner.mesh, P(None, "model"))
    mu = state.opt_state[1][0].mu["encoder"]["layers_0"]["mlp"]["wi_0"]["kernel"]
    assert mu.sharding == wi.sharding  # optimizer state sharded like its parameter
    batch = tr.global_batch(reverse_batch(16))
    losses = []
    for _ in range(30):
        state, metrics = tr.train_step(state, batch)
        losses.append(summarize(metrics)["loss"])
    assert int(state.step) == 30
    assert losses[-1] < 0.5 * losses[0]


@pytest.mark.parametrize("normalization", ["sum", "per_real_token", "per_sequence"])
def test_gradient_accumulation_equals_big_batch(normalization):
    import dataclasses

    batch = reverse_batch(16, seed=3)
    grads = {}
    for k in (1, 4):
        tr = _trainer(k=k)
        tr.model = dataclasses.replace(tr.model, loss_normalization=normalization)
        state = tr.init_state()
        g, m = jax.jit(tr._grads)(state.params, tr.global_batch(batch), jax.random.PRNGKey(0))
        grads[k] = (g, float(m["loss_denominator"]))
    assert grads[1][1] == grads[4][1]
    for a, b in zip(jax.tree_util.tree_leaves(grads[1][0]), jax.tree_util.tree_leaves(grads[4][0])):
        np.testing.assert_allclose(a, b, atol=1e-5 * max(1.0, float(np.max(np.abs(a)))))


def test_train_step_with_microbatches_matches_single_batch():
    batch = reverse_batch(16, seed=5)
    out = {}
    for k in (1, 2):
        tr = _trainer(k=k)
        state = tr.init_state()
        for _ in range(3):
            state, _ = tr.train_step(state, tr.global_batch(batch))
        out[k] = state.params
    for a, b in zip(jax.tree_util.tree_leaves(out[1]), jax.tree_util.tree_leaves(out[2])):
        np.testing.assert_allclose(a, b, atol=1e-5)


def test_microbatches_are_split_without_moving_rows_between_devices():
    """Each device's block of the batch holds its share of every microbatch (rows i, i+k, ...),
    so a microbatched data-parallel step has the plain step's collectives: the gradients'
    all-reduce over `data`, nothing to shuffle rows (t5x's contiguous microbatches compiled to
    all-gathers of batch rows here, collective-permutes on other meshes). XLA:CPU runs that
    all-reduce in each microbatch of the accumulation loop (XLA:TPU moves it after the loop):
    a step sends the gradients k times, which the communication comparison names."""
    require_devices(8)

    def collectives(k):
        part = partitioning.Partitioner(
            num_partitions=1, logical_axis_rules=partitioning.preset_rules("data_parallel")
        )
        model = EncoderDecoderModel(TINY_T5, optimizer=optimizers.AdamW(1e-2))
        tr = Trainer(model, part, batch_size=16, lengths=LENGTHS, num_microbatches=k)
        batch = {n: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=tr.batch_shardings[n])
                 for n, v in tr.batch_abstract.items()}  # fmt: skip
        hlo = tr.train_step.lower(tr.abstract_state(), batch).compile().as_text()
        ops = collective_ops(hlo, part.mesh)
        report = sharding_report(part, tr.abstract_state().params, tr.params_axes)
        rows = communication.collective_rows(parse_collectives(hlo, part.mesh))
        (cmp,) = comparison.compare_communication(
            rows, communication.analytic_communication(tr, report)
        )
        grads = max(ops, key=lambda o: o.collective.bytes)
        kinds = {(o.collective.kind, o.collective.axes) for o in ops}
        params = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(tr.state_abstract.params))
        # The gradients' all-reduce: every parameter's, with the relative-position bias's per
        # layer and some metrics' scalars combined in.
        assert params <= grads.collective.bytes
        return kinds, sum(o.collective.bytes for o in ops), grads, cmp

    (kinds2, bytes2, grads2, cmp2), (kinds1, bytes1, grads1, cmp1) = collectives(2), collectives(1)
    assert kinds2 == kinds1 == {("all-reduce", ("data",))}
    # Not one byte more per instruction (XLA groups the metrics' scalar all-reduces
    # differently in the two), the gradients' run once per microbatch.
    assert bytes2 <= bytes1
    assert (grads1.runs, grads2.runs) == (1, 2)
    assert cmp1.agrees and cmp1.differences == ()
    assert cmp2.agrees and cmp2.differences == (
        "gradients reduced in each of the 2 microbatches, not once after accumulating "
        "(XLA:CPU keeps the reduction in the loop; XLA:TPU moves it out)",
    )


def _step_cost(tr):
    compiled = tr.train_step.lower(tr.abstract_state(), tr.batch_abstract).compile()
    cost = compiled.cost_analysis()
    cost = cost[0] if isinstance(cost, list) else cost
    return cost["flops"], cost["bytes accessed"]


def _with_optimizer(opt, log_grad_norm):
    require_devices(8)
    model = EncoderDecoderModel(TINY_T5, optimizer=opt)
    part = partitioning.Partitioner(num_partitions=2)
    return Trainer(model, part, batch_size=16, lengths=LENGTHS, log_grad_norm=log_grad_norm)


def test_grad_norm_is_logged_when_clipping_and_costs_nothing_there():
    batch = reverse_batch(16, seed=7)
    clipped = _with_optimizer(optimizers.AdamW(1e-2, clip_norm=1.0), None)
    assert clipped.log_grad_norm  # default: logged when the optimizer clips
    state = clipped.init_state()
    rng = jax.random.PRNGKey(0)
    g, _ = jax.jit(clipped._grads)(state.params, clipped.global_batch(batch), rng)
    want = float(np.sqrt(sum(np.sum(np.square(np.asarray(x))) for x in jax.tree.leaves(g))))
    _, metrics = clipped.train_step(state, clipped.global_batch(batch))
    np.testing.assert_allclose(float(metrics["grad_norm"]), want, rtol=1e-5)
    clipped_cost = _step_cost(clipped)
    unlogged_cost = _step_cost(_with_optimizer(optimizers.AdamW(1e-2, clip_norm=1.0), False))

    plain = _with_optimizer(optimizers.AdamW(1e-2, clip_norm=None), None)
    assert not plain.log_grad_norm  # without clipping it would be a pass of its own
    _, metrics = plain.train_step(plain.init_state(), plain.global_batch(batch))
    assert "grad_norm" not in metrics and "grad_norm" not in summarize(metrics)
    forced = _with_optimizer(optimizers.AdamW(1e-2, clip_norm=None), True)
    _, metrics = forced.train_step(forced.init_state(), forced.global_batch(batch))
    np.testing.assert_allclose(float(metrics["grad_norm"]), want, rtol=1e-5)
    # Without clipping the metric is a pass over every gradient; next to the clip, XLA shares
    # the clip's norm, so the metric adds only its scalar epilogue (measured: 50 flops, 352
    # bytes here; on one device exactly nothing).
    extra = _step_cost(forced)[1] - _step_cost(plain)[1]
    grad_bytes = sum(x.size * 4 for x in jax.tree.leaves(plain.state_abstract.params))  # fp32
    assert extra >= grad_bytes / 2  # sharded over 2: each device reads its half at least
    assert 0 <= clipped_cost[1] - unlogged_cost[1] <= 0.05 * extra
    assert 0 <= clipped_cost[0] - unlogged_cost[0] <= 100


def test_adafactor_matches_optax_for_a_factored_matrix():
    # embed (ROW) x mlp (COLUMN) with mlp the larger dim: optax factors the same way.
    params = {"w": jax.random.normal(jax.random.PRNGKey(0), (4, 6))}
    axes = {"w": P("embed", "mlp")}
    ours = optimizers.Adafactor(learning_rate=0.1, min_dim_size_to_factor=1).create(axes)
    ref = optax.adafactor(0.1, min_dim_size_to_factor=1)
    s1, s2 = ours.init(params), ref.init(params)
    p1 = p2 = params
    for i in range(3):
        g = {"w": jax.random.normal(jax.random.PRNGKey(i + 1), (4, 6))}
        u1, s1 = ours.update(g, s1, p1)
        u2, s2 = ref.update(g, s2, p2)
        p1, p2 = optax.apply_updates(p1, u1), optax.apply_updates(p2, u2)
    np.testing.assert_allclose(p1["w"], p2["w"], rtol=1e-5, atol=1e-6)


def test_adafactor_state_is_factored_and_sharded_by_logical_axes():
    tr = _trainer(optimizer=optimizers.Adafactor(min_dim_size_to_factor=8), num_partitions=2)
    state = tr.init_state()
    st = state.opt_state
    wi = state.params["encoder"]["layers_0"]["mlp"]["wi_0"]["kernel"]  # [embed 16, mlp 32]
    v_row = st.v_row["encoder"]["layers_0"]["mlp"]["wi_0"]["kernel"]
    v_col = st.v_col["encoder"]["layers_0"]["mlp"]["wi_0"]["kernel"]
    assert wi.shape == (16, 32) and v_row.shape == (16,) and v_col.shape == (32,)
    assert v_col.sharding == NamedSharding(tr.partitioner.mesh, P("model"))
    assert v_row.sharding == NamedSharding(tr.partitioner.mesh, P(None))


def test_adafactor_replicate_factored_lays_v_row_and_v_col_out_as_t5x():
    # t5x's derive_logical_axes: v_row=None, v_col=None; v and m keep the parameter's axes.
    opt = optimizers.Adafactor(min_dim_size_to_factor=8, replicate_factored=True, beta1=0.9)
    tr = _trainer(optimizer=opt, num_partitions=2)
    state = tr.init_state()
    st, mesh = state.opt_state, tr.partitioner.mesh
    path = ("encoder", "layers_0", "mlp", "wi_0", "kernel")

    def at(tree):
        for k in path:
            tree = tree[k]
        return tree

    assert at(st.v_col).sharding == NamedSharding(mesh, P(None))
    assert at(st.v_row).sharding == NamedSharding(mesh, P(None))
    assert at(st.m).sharding == at(state.params).sharding == NamedSharding(mesh, P(None, "model"))


def test_label_smoothing_matches_optax_minus_entropy():
    from t5lite.model import losses

    logits = jax.random.normal(jax.random.PRNGKey(0), (2, 3, 11)) * 3
    targets = jnp.array([[1, 4, 0], [7, 2, 10]])
    ls = 0.1
    loss, m = losses.weighted_cross_entropy(
        logits, targets, z_loss=0.0, label_smoothing=ls, normalization="sum"
    )
    confidence, low = 1 - ls, ls / 10
    soft = jax.nn.one_hot(targets, 11) * (confidence - low) + low
    ref = optax.softmax_cross_entropy(logits, soft)
    entropy = -(confidence * np.log(confidence) + 10 * low * np.log(low))
    weights = (targets > 0).astype(jnp.float32)
    np.testing.assert_allclose(loss, jnp.sum((ref - entropy) * weights), rtol=1e-5)
    assert float(m["weight_sum"]) == 5.0


def test_model_that_does_not_fit_reports_memory(monkeypatch):
    from t5lite.insight.sharding import format_bytes

    tr = _trainer()

    class SmallDevice:
        device_kind = "FakeAccelerator"

        def memory_stats(self):
            return {"bytes_limit": 1024}

    mem = tr.partitioner.compile(tr.train_step, tr.abstract_state(), tr.batch_abstract)
    mem = mem.memory_analysis()
    need = (mem.argument_size_in_bytes + mem.output_size_in_bytes + mem.temp_size_in_bytes
            - mem.alias_size_in_bytes)  # fmt: skip
    import t5lite.programs.train as train_program

    monkeypatch.setattr(train_program.jax, "local_devices", lambda: [SmallDevice()])
    with pytest.raises(train_program.TrainingError) as e:
        train_program._check_fits(tr, tr.abstract_state())
    assert str(e.value) == (
        f"the train step needs {format_bytes(need)} per device but FakeAccelerator has 1.00 KiB: "
        "shard more (see `t5lite plan`) or use smaller batches"
    )


def test_unpacked_batch_means_one_example_per_row():
    tr = _trainer()
    b = reverse_batch(16)
    b.pop("decoder_loss_weights")
    packed_like = dict(
        b,
        encoder_segment_ids=(b["encoder_input_tokens"] > 0).astype(np.int32),
        decoder_segment_ids=(b["decoder_target_tokens"] > 0).astype(np.int32),
        encoder_positions=np.tile(np.arange(8, dtype=np.int32), (16, 1)),
        decoder_positions=np.where(b["decoder_target_tokens"] > 0, np.arange(8), 0),
        decoder_loss_weights=(b["decoder_target_tokens"] > 0).astype(np.int32),
    )
    state = tr.init_state()
    m1 = tr.eval_step(state.params, tr.global_batch(b))
    m2 = tr.eval_step(state.params, tr.global_batch(packed_like))
    assert float(m1["num_sequences"]) == 16.0
    for k in m1:
        np.testing.assert_allclose(m1[k], m2[k], rtol=1e-6)
