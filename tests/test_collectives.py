"""Which strategy `collectives.select_strategy` picks for each dense layer of a block, per preset.

The table in `t5lite/collectives.py`'s docstring, checked: a T5 block's input projections
(q/k/v, wi_0/wi_1: [B, L, D] x [D, F]), its output projections (wo: [B, L, F] x [F, D];
out: [B, L, H, K] x [H, K, D]) and the attention core, on 8 fake devices (data=2 x model=4).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import require_devices
from flax import linen as nn

from t5lite import collectives, context_parallel
from t5lite.model import layers
from t5lite.partitioning import create_mesh, preset_rules

S = collectives.Strategy
B, L, D, F, H, K = 8, 8, 16, 32, 4, 4
BLD, BLF = ("batch", "length", "embed"), ("batch", "length", "mlp")
BLHK = ("batch", "length", "heads", "kv")


def _picks() -> dict[str, collectives.Strategy]:
    x_BLD, x_BLF, x_BLHK = jnp.zeros((B, L, D)), jnp.zeros((B, L, F)), jnp.zeros((B, L, H, K))
    wi, wo = (jnp.zeros((D, F)), ("embed", "mlp")), (jnp.zeros((F, D)), ("mlp", "embed"))
    out = (jnp.zeros((H, K, D)), ("heads", "kv", "embed"))
    mask = jnp.ones((B, 1, L, L), bool)
    return {
        "wi": collectives.select_strategy(x_BLD, BLD, [wi, wi], 1).strategy,
        "wo": collectives.select_strategy(x_BLF, BLF, [wo], 1).strategy,
        "out": collectives.select_strategy(x_BLHK, BLHK, [out], 2).strategy,
        "attention": context_parallel.select_attention_strategy(
            x_BLHK, x_BLHK, None, mask, "heads"
        ).strategy,
    }


@pytest.mark.parametrize(
    "preset, wi, wo, out, core",
    [
        ("data_parallel", S.PARTITIONER, S.PARTITIONER, S.PARTITIONER, S.PARTITIONER),
        ("megatron", S.PARTITIONER, S.PARTITIONER, S.PARTITIONER, S.PARTITIONER),
        ("activations_2d", S.PARTITIONER, S.PARTITIONER, S.PARTITIONER, S.PARTITIONER),
        ("fsdp", S.ZERO3, S.ZERO3, S.ZERO3, S.PARTITIONER),
        ("fully_sharded", S.ZERO3, S.ZERO3, S.ZERO3, S.PARTITIONER),
        (
            "sequence_parallel",
            S.SEQUENCE_PARALLEL_GATHER,
            S.SEQUENCE_PARALLEL_SCATTER,
            S.SEQUENCE_PARALLEL_SCATTER,
            S.PARTITIONER,
        ),
        ("context_parallel", S.PARTITIONER, S.PARTITIONER, S.PARTITIONER, S.CONTEXT_PARALLEL),
    ],
)
def test_each_preset_selects_its_strategy(preset, wi, wo, out, core):
    require_devices(8)
    with jax.set_mesh(create_mesh(4)), nn.logical_axis_rules(preset_rules(preset)):
        assert _picks() == {"wi": wi, "wo": wo, "out": out, "attention": core}


def test_no_mesh_is_plain_and_a_split_that_does_not_divide_is_the_partitioners():
    with nn.logical_axis_rules(preset_rules("sequence_parallel")):
        assert set(_picks().values()) == {S.PLAIN}
    require_devices(8)
    x = jnp.zeros((B, 6, D))  # 6 positions do not split over model=4
    wi = (jnp.zeros((D, F)), ("embed", "mlp"))
    with jax.set_mesh(create_mesh(4)), nn.logical_axis_rules(preset_rules("sequence_parallel")):
        assert collectives.select_strategy(x, BLD, [wi], 1).strategy is S.PARTITIONER
        # Unknown input axes: nothing to plan with.
        assert collectives.select_strategy(x, None, [wi], 1).strategy is S.PARTITIONER


def test_a_dense_group_keeps_the_parameter_tree_and_computes_each_output():
    x = jax.random.normal(jax.random.PRNGKey(0), (2, 3, D))
    mlp = layers.MlpBlock(intermediate_dim=F, activations=("gelu", "linear"))
    params = mlp.init(jax.random.PRNGKey(1), x)["params"]
    assert sorted(params) == ["wi_0", "wi_1", "wo"]
    names = [params[n]["kernel"].names for n in ("wi_0", "wo")]
    assert names == [("embed", "mlp"), ("mlp", "embed")]
    a = layers.Projection("a", F, ("embed", "mlp"))
    b = layers.Projection("b", (H, K), ("embed", "heads", "kv"))
    group = layers.DenseGroup((a, b), input_axes=BLD)
    p = nn.meta.unbox(group.init(jax.random.PRNGKey(2), x)["params"])
    assert {n: v["kernel"].shape for n, v in p.items()} == {"a": (D, F), "b": (D, H, K)}
    a, b = group.apply({"params": p}, x)
    np.testing.assert_allclose(a, x @ p["a"]["kernel"], rtol=1e-6)
    np.testing.assert_allclose(b, jnp.einsum("bld,dhk->blhk", x, p["b"]["kernel"]), rtol=1e-6)
