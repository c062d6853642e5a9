"""t5x's logical axis names partition under t5lite's standard tables; unknown names still fail."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import require_devices
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from t5lite import partitioning
from t5lite.partitioning import Partitioner, PartitioningError

_init = nn.initializers.normal(0.02)


def _param(mod, name, shape, axes):
    return mod.param(name, nn.with_logical_partitioning(_init, axes), shape)


class T5xStyle(nn.Module):
    """Parameters and activations named as t5x and its MoE/flaxformer modules name them."""

    @nn.compact
    def __call__(self, tokens_BL):
        b, length = tokens_BL.shape
        emb = _param(self, "token_embedder", (32, 16), ("vocab", "embed"))
        pos = _param(self, "position_embedder", (length, 16), ("abspos_buckets", "embed"))
        x = emb[tokens_BL] + pos[None]
        x = nn.with_logical_constraint(x, ("batch", "length", "embed"))
        # Gated MLP with a stacked activation axis, in two stacked (unscanned) layers.
        wi = _param(self, "wi", (2, 16, 2, 32), ("stack", "embed", "mlp_activations", "mlp"))
        wo = _param(self, "wo", (2, 32, 16), ("stack", "mlp", "embed"))
        for i in range(2):
            h = jnp.einsum("bld,dam->blam", x, wi[i])
            h = nn.with_logical_constraint(h, ("batch", "length", "mlp_activations", "mlp"))
            x = x + jnp.einsum("blm,md->bld", jax.nn.gelu(h[:, :, 0]) * h[:, :, 1], wo[i])
        # A mixture of experts: experts split over data, each expert's MLP over model.
        e_wi = _param(self, "expert_wi", (4, 16, 32), ("expert", "embed", "expert_mlp"))
        e_wo = _param(self, "expert_wo", (4, 32, 16), ("expert", "expert_mlp", "embed"))
        router = _param(self, "router", (16, 4), ("embed", "unmodeled"))
        gates = jax.nn.softmax(jnp.einsum("bld,de->ble", x, router), axis=-1)
        groups = x.reshape(1, b * length, 16)  # [expert_group, tokens, embed]
        groups = nn.with_logical_constraint(groups, ("expert_group", "expert_replicas", "embed"))
        h = jnp.einsum("gtd,edm->etm", groups, e_wi)
        h = nn.with_logical_constraint(h, ("expert", "length", "expert_mlp"))
        out_ETD = jnp.einsum("etm,emd->etd", jax.nn.relu(h), e_wo)
        x = x + jnp.einsum("etd,ble->bld", out_ETD.reshape(4, b, length, 16)[:, 0, 0:1], gates)
        return jnp.mean(x**2)


# Parameter -> its PartitionSpec under each (activation, parameter) partitioning table. Rule
# order decides: `embed`'s rules come before the expert rules, as in t5x's MoE table (which
# calls 2D parameters with MoE unsupported), so with 2D parameters `embed` may take `data` first.
WANT = {
    (1, 1): {
        "token_embedder": P("model", None),
        "position_embedder": P(None, None),
        "wi": P(None, None, None, "model"),
        "wo": P(None, "model", None),
        "expert_wi": P("data", None, "model"),
        "expert_wo": P("data", "model", None),
        "router": P(None, None),
    },
    (1, 2): {
        "token_embedder": P("model", "data"),
        "position_embedder": P(None, "data"),
        "wi": P(None, "data", None, "model"),
        "wo": P(None, "model", "data"),
        "expert_wi": P(None, "data", "model"),
        "expert_wo": P(None, "model", "data"),
        "router": P("data", None),
    },
    (2, 2): {
        "token_embedder": P("model", "data"),
        "position_embedder": P(None, "model"),
        "wi": P(None, "data", None, "model"),
        "wo": P(None, "model", "data"),
        "expert_wi": P("data", "model", None),
        "expert_wo": P("data", None, "model"),
        "router": P("model", None),
    },
}


@pytest.mark.parametrize("dims", [(1, 1), (1, 2), (2, 2)])
def test_a_t5x_style_module_partitions_and_runs(dims):
    require_devices(8)
    rules = partitioning.standard_logical_axis_rules(*dims)
    part = Partitioner(partitioning.create_mesh(num_partitions=2), logical_axis_rules=rules)
    module = T5xStyle()
    tokens = jnp.asarray(np.arange(32).reshape(4, 8) % 32, jnp.int32)
    variables, axes = part.initialize(module.init, jax.random.PRNGKey(0), tokens)
    got = {k: v.sharding for k, v in variables["params"].items()}
    want = {k: NamedSharding(part.mesh, s) for k, s in WANT[dims].items()}
    assert got == want
    step = part.partition(
        jax.value_and_grad(lambda p, t: module.apply({"params": p}, t)),
        in_shardings=(part.shardings(variables["params"], axes["params"]), None),
        out_shardings=None,
    )
    loss, _ = step(variables["params"], tokens)
    ref = module.apply({"params": jax.device_get(variables["params"])}, tokens)
    np.testing.assert_allclose(loss, ref, rtol=1e-5)


def test_t5x_names_replicate_or_shard_as_in_t5x():
    rules = dict(partitioning.standard_logical_axis_rules())
    for name in ("abspos_buckets", "length", "layers", "stack", "mlp_activations", "kv",
                 "relpos_buckets", "expert_group", "unmodeled", "expert_replicas"):  # fmt: skip
        assert name in rules and rules[name] is None, name
    assert rules["expert"] == "data" and rules["expert_mlp"] == "model"
    dp = dict(partitioning.preset_rules("data_parallel"))
    assert dp["expert"] == "data" and dp["expert_replicas"] == "model" and dp["expert_mlp"] is None
    # multi-slice: experts follow the batch's data axes
    assert dict(partitioning.standard_logical_axis_rules(data_axis=("replica", "data")))[
        "expert"
    ] == ("replica", "data")


def test_a_made_up_name_is_still_an_error():
    require_devices(8)
    part = Partitioner(partitioning.create_mesh(num_partitions=2))
    x = {"w": jax.ShapeDtypeStruct((4, 16), jnp.float32)}
    with pytest.raises(PartitioningError, match="logical axis 'experts_v2' has no rule"):
        part.placements(x, {"w": P("experts_v2", "embed")})
