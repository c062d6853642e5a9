"""Adafactor's `beta1` (momentum) against optax's reference `adafactor(momentum=...)`."""

import jax
import numpy as np
import optax
import pytest
from conftest import require_devices
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from tiny_networks import TINY_T5

from t5lite import partitioning
from t5lite.model import optimizers
from t5lite.model.models import EncoderDecoderModel
from t5lite.trainer import Trainer


def _run(tx, params, steps):
    state = tx.init(params)
    for i in range(steps):
        grads = jax.tree.map(
            lambda p, i=i: jax.random.normal(jax.random.PRNGKey(100 + i), p.shape), params
        )
        updates, state = tx.update(grads, state, params)
        params = optax.apply_updates(params, updates)
    return params, state


@pytest.mark.parametrize("beta1", [0.9, 0.5])
def test_momentum_matches_optax(beta1):
    # A factored matrix (embed = ROW, mlp = COLUMN; optax factors the same two dims), an
    # unfactored vector and a matrix too small to factor.
    keys = jax.random.split(jax.random.PRNGKey(0), 3)
    params = {
        "w": jax.random.normal(keys[0], (4, 6)),
        "b": jax.random.normal(keys[1], (6,)),
        "small": jax.random.normal(keys[2], (2, 3)),
    }
    axes = {"w": P("embed", "mlp"), "b": P("mlp"), "small": P("embed", "mlp")}
    ours = optimizers.Adafactor(learning_rate=0.1, min_dim_size_to_factor=4, beta1=beta1)
    ref = optax.adafactor(0.1, min_dim_size_to_factor=4, momentum=beta1)
    p1, s1 = _run(ours.create(axes), params, 6)
    p2, _ = _run(ref, params, 6)
    for k in params:
        np.testing.assert_allclose(p1[k], p2[k], rtol=1e-6, atol=1e-6, err_msg=k)
    assert s1.v_row["w"].shape == (4,) and s1.m["w"].shape == (4, 6)
    # Momentum changes the trajectory (the comparison above is not vacuous).
    p0, _ = _run(optimizers.Adafactor(0.1, min_dim_size_to_factor=4).create(axes), params, 6)
    assert not np.allclose(p0["w"], p1["w"], atol=1e-4)


def test_no_beta1_keeps_the_state_as_it_was():
    params = {"w": np.ones((4, 6), np.float32)}
    state = (
        optimizers.Adafactor(min_dim_size_to_factor=4).create({"w": P("embed", "mlp")}).init(params)
    )
    assert state.m is None
    assert len(jax.tree.leaves(state)) == 4  # count, v_row, v_col, v placeholder


def test_momentum_is_sharded_like_its_parameter():
    require_devices(8)
    model = EncoderDecoderModel(TINY_T5, optimizer=optimizers.Adafactor(beta1=0.9))
    tr = Trainer(model, partitioning.Partitioner(num_partitions=2), batch_size=16,
                 lengths={"inputs": 8, "targets": 8})  # fmt: skip
    state = tr.init_state()
    wi = state.params["encoder"]["layers_0"]["mlp"]["wi_0"]["kernel"]
    m = state.opt_state.m["encoder"]["layers_0"]["mlp"]["wi_0"]["kernel"]
    assert m.shape == wi.shape and m.dtype == np.float32
    assert m.sharding == wi.sharding == NamedSharding(tr.partitioner.mesh, P(None, "model"))
