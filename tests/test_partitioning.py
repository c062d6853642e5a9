"""Partitioning front-end: meshes, rules tables, exact shardings, numerics, HLO, errors."""

import re
from types import SimpleNamespace

import flax.linen as nn
import gin
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import require_devices, run_cli
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from toy_model import EMBED, MLP, MlpBlock, ToyModel, loss_fn

from t5lite import partitioning
from t5lite.insight.hlo import count_collectives_by_axes
from t5lite.insight.sharding import sharding_report
from t5lite.partitioning import Partitioner, PartitioningError

MESHES = [(1, 8), (2, 4), (4, 2), (8, 1)]
PRESETS = list(partitioning.PRESETS)  # every named layout, as gin, plan and notebooks see them


def preset_rules(name):
    """The rules table as the shipped gin preset binds it."""
    from t5lite.cli import registry as gin_registry
    from t5lite.cli.gin_config import find_gin_file

    with gin.unlock_config():
        gin.clear_config()
        try:
            gin.parse_config_file(find_gin_file(f"partitioning/{name}.gin"))
            return gin_registry.Partitioner(mesh=partitioning.create_mesh()).rules
        finally:
            gin.clear_config()


# Expected PartitionSpec of every toy parameter, per preset (independent of the mesh shape).
M, D = "model", "data"
EXPECTED = {
    "data_parallel": {
        "embedding": P(None, None), "scale": P(None),
        "attn/query": P(None, None, None), "attn/key": P(None, None, None),
        "attn/value": P(None, None, None), "attn/out": P(None, None, None),
        "mlp/wi": P(None, None), "mlp/wo": P(None, None),
    },
    "megatron": {
        "embedding": P(M, None), "scale": P(None),
        "attn/query": P(None, M, None), "attn/key": P(None, M, None),
        "attn/value": P(None, M, None), "attn/out": P(M, None, None),
        "mlp/wi": P(None, M), "mlp/wo": P(M, None),
    },
    "fsdp": {
        "embedding": P(M, D), "scale": P(D),
        "attn/query": P(D, M, None), "attn/key": P(D, M, None),
        "attn/value": P(D, M, None), "attn/out": P(M, None, D),
        "mlp/wi": P(D, M), "mlp/wo": P(M, D),
    },
    "activations_2d": {  # Megatron, plus embed -> model wherever `model` is still free
        "embedding": P(M, None), "scale": P(M),
        "attn/query": P(None, M, None), "attn/key": P(None, M, None),
        "attn/value": P(None, M, None), "attn/out": P(M, None, None),
        "mlp/wi": P(None, M), "mlp/wo": P(M, None),
    },
    "fully_sharded": {
        "embedding": P(M, D), "scale": P(M),
        "attn/query": P(D, M, None), "attn/key": P(D, M, None),
        "attn/value": P(D, M, None), "attn/out": P(M, None, D),
        "mlp/wi": P(D, M), "mlp/wo": P(M, D),
    },
}  # fmt: skip
# Sequence and context parallelism move activations only: their weights are Megatron's and data
# parallelism's; tensor_2d is the 2/2 table under its 2D tensor-parallel name.
EXPECTED["sequence_parallel"] = EXPECTED["megatron"]
EXPECTED["context_parallel"] = EXPECTED["data_parallel"]
EXPECTED["context_parallel_ring"] = EXPECTED["data_parallel"]
EXPECTED["tensor_2d"] = EXPECTED["fully_sharded"]
EXPECTED["expert_parallel"] = EXPECTED["megatron"]  # the toy model has no experts


def toy_init(rng):
    return ToyModel().init(rng, jnp.zeros((8, 8), jnp.int32))


def flat(tree):
    return {partitioning.path_str(p): v for p, v in jax.tree_util.tree_flatten_with_path(tree)[0]}


@pytest.fixture(scope="module")
def tokens():
    return jax.random.randint(jax.random.PRNGKey(1), (16, 8), 0, 64)


@pytest.fixture(scope="module")
def reference(tokens):
    """Loss and gradients on one device, no mesh."""
    # Jitted: op by op, the init alone compiled ~35 one-op programs on a cold cache.
    params = nn.unbox(jax.jit(toy_init)(jax.random.PRNGKey(0)))["params"]
    return jax.jit(jax.value_and_grad(loss_fn))(params, tokens)


# Every preset and every mesh shape appears in the fast set; the rest of the product is slow.
_CASES = [
    pytest.param(p, m, marks=() if i % len(MESHES) == j else pytest.mark.slow, id=f"{m}-{p}")
    for i, p in enumerate(PRESETS) for j, m in enumerate(MESHES)
]  # fmt: skip


def test_every_preset_has_its_gin_file_and_expectations():
    assert set(EXPECTED) == set(PRESETS)
    for name in PRESETS:
        assert preset_rules(name) == partitioning.preset_rules(name)


@pytest.mark.parametrize(("preset", "shape"), _CASES)
def test_exact_shardings_and_numerics(preset, shape, tokens, reference):
    require_devices(8)
    part = Partitioner(
        partitioning.create_mesh(ici_mesh_shape=shape), logical_axis_rules=preset_rules(preset)
    )
    variables, axes = part.initialize(toy_init, jax.random.PRNGKey(0))
    got = {k.removeprefix("params/"): v.sharding for k, v in flat(variables).items()}
    want = {k: NamedSharding(part.mesh, s) for k, s in EXPECTED[preset].items()}
    assert got == want
    # Parameters are born sharded: each device holds only its shard.
    wi = variables["params"]["mlp"]["wi"]
    assert wi.addressable_shards[0].data.shape == wi.sharding.shard_shape(wi.shape)

    params, params_axes = variables["params"], axes["params"]
    param_sh = part.shardings(params, params_axes)
    batch_sh = part.logical_to_sharding(P("batch", "length"))
    step = part.partition(
        jax.value_and_grad(loss_fn),
        in_shardings=(param_sh, batch_sh),
        out_shardings=(None, param_sh),
    )
    loss, grads = step(params, jax.device_put(tokens, batch_sh))
    ref_loss, ref_grads = reference
    np.testing.assert_allclose(loss, ref_loss, rtol=1e-5)
    for k, g in flat(grads).items():
        # On the host: `g - r` on a sharded and a one-device array compiled a program per leaf
        # shape and sharding (float subtraction is exact IEEE either way).
        g_host, r = np.asarray(g), np.asarray(flat(ref_grads)[k])
        assert np.max(np.abs(g_host - r)) <= 1e-5 * max(1.0, float(np.max(np.abs(r)))), k
        assert g.sharding == param_sh_flat(param_sh)[k]


def param_sh_flat(sh):
    return flat(sh)


def _mlp_hlo(part, with_grad):
    x = jax.ShapeDtypeStruct((8, 4, EMBED), jnp.float32)
    variables, axes = part.abstract_initialize(
        lambda r: MlpBlock().init(r, jnp.zeros((8, 4, EMBED))), jax.random.PRNGKey(0)
    )
    params, params_axes = variables["params"], axes["params"]
    param_sh = part.shardings(params, params_axes)
    x_sh = part.logical_to_sharding(P("batch", "length", "embed"))

    def fwd(p, x):
        return MlpBlock().apply({"params": p}, x)

    if with_grad:
        fn = jax.grad(lambda p, x: jnp.sum(fwd(p, x) ** 2), argnums=(0, 1))
        out = (param_sh, x_sh)
    else:
        fn, out = fwd, x_sh
    compiled = part.compile(part.partition(fn, (param_sh, x_sh), out), params, x)
    return compiled.as_text()


def test_megatron_mlp_all_reduce_counts():
    require_devices(8)
    part = Partitioner(
        partitioning.create_mesh(num_partitions=4), logical_axis_rules=preset_rules("megatron")
    )
    fwd = count_collectives_by_axes(_mlp_hlo(part, False), part.mesh)
    assert fwd == {("all-reduce", ("model",)): 1}
    both = count_collectives_by_axes(_mlp_hlo(part, True), part.mesh)
    assert both.get(("all-reduce", ("model",))) == 2
    # No other collective over `model`: activations are never gathered.
    assert {k: v for k, v in both.items() if k[1] == ("model",)} == {("all-reduce", ("model",)): 2}


# --- mesh construction ------------------------------------------------------------------------


def test_num_partitions_is_honoured_on_cpu():
    require_devices(8)
    mesh = partitioning.create_mesh(num_partitions=4)
    assert dict(mesh.shape) == {"data": 2, "model": 4}
    assert list(mesh.devices.flat) == jax.devices()[:8]
    assert dict(partitioning.create_mesh().shape) == {"data": 8, "model": 1}


def test_hybrid_mesh_puts_dcn_outermost():
    require_devices(8)
    mesh = partitioning.create_mesh(ici_mesh_shape=(1, 2, 2), dcn_mesh_shape=(2, 1, 1))
    assert mesh.axis_names == ("replica", "data", "model")
    assert dict(mesh.shape) == {"replica": 2, "data": 2, "model": 2}
    ids = np.vectorize(lambda d: d.id)(mesh.devices)
    # Each replica is one "slice" of 4 consecutive devices.
    assert ids[0].flatten().tolist() == [0, 1, 2, 3]
    mesh = partitioning.create_mesh(ici_mesh_shape=(2, 2), dcn_mesh_shape=(2, 1))
    assert np.vectorize(lambda d: d.id)(mesh.devices).tolist() == [[0, 1], [2, 3], [4, 5], [6, 7]]


def test_mesh_specifications_combine_when_they_agree():
    """A run preset's num_partitions and a user's multi-slice shapes build one mesh; shapes win."""
    require_devices(8)
    mesh = partitioning.create_mesh(4, ici_mesh_shape=(1, 1, 4), dcn_mesh_shape=(2, 1, 1))
    assert dict(mesh.shape) == {"replica": 2, "data": 1, "model": 4}
    assert dict(partitioning.create_mesh(2, model_parallel_submesh=(2,)).shape) == {
        "data": 4, "model": 2,
    }  # fmt: skip
    with pytest.raises(PartitioningError) as e:
        partitioning.create_mesh(1, ici_mesh_shape=(1, 2, 2), dcn_mesh_shape=(2, 1, 1))
    assert str(e.value) == (
        "create_mesh: num_partitions=1 (model axis 1), ici_mesh_shape=(1, 2, 2) x "
        "dcn_mesh_shape=(2, 1, 1) (model axis 2) contradict each other; give one, or the same "
        "model size"
    )


def test_an_explicit_axis_mesh_is_refused_up_front():
    require_devices(8)
    mesh = jax.make_mesh((2, 4), ("data", "model"))  # Explicit axes by default since JAX 0.9
    with pytest.raises(PartitioningError) as e:
        Partitioner(mesh=mesh)
    assert str(e.value) == (
        "mesh axes ['data', 'model'] are AxisType.Explicit, and Partitioner.shard_mode is "
        "'auto': pass shard_mode='explicit', or build the mesh with "
        "axis_types=(jax.sharding.AxisType.Auto,) * 2 (e.g. jax.make_mesh(shape, names, "
        "axis_types=...)), or use t5lite.create_mesh"
    )
    auto = jax.make_mesh((2, 4), ("data", "model"), axis_types=(jax.sharding.AxisType.Auto,) * 2)
    assert Partitioner(mesh=auto).mesh is auto


def test_batches_follow_the_rules_when_length_is_sharded():
    """A table that shards `length` places batches as it says (not a fixed P(batch, None)) and
    trains with the losses of the data-parallel table."""
    require_devices(8)
    from tiny_networks import TINY_T5

    from t5lite.model import optimizers
    from t5lite.model.models import EncoderDecoderModel
    from t5lite.trainer import Trainer, summarize

    model = EncoderDecoderModel(TINY_T5, optimizer=optimizers.AdamW(1e-2))
    rng = np.random.default_rng(0)
    tokens = rng.integers(2, 32, size=(8, 8)).astype(np.int32)
    batch = {"encoder_input_tokens": tokens, "decoder_target_tokens": tokens[:, ::-1].copy(),
             "decoder_input_tokens": np.pad(tokens[:, ::-1], ((0, 0), (1, 0)))[:, :-1]}  # fmt: skip
    losses = {}
    replicated = [(n, None) for n, _ in partitioning.data_parallel_logical_axis_rules()]
    by_length = [("batch", "data"), ("length", "model"), *replicated]  # earlier rules win
    for name, rules in [("dp", partitioning.data_parallel_logical_axis_rules()),
                        ("length", by_length)]:  # fmt: skip
        part = Partitioner(num_partitions=2, logical_axis_rules=rules)
        tr = Trainer(model, part, batch_size=8, lengths={"inputs": 8, "targets": 8})
        global_batch = tr.global_batch(batch)
        if name == "length":
            spec = global_batch["encoder_input_tokens"].sharding.spec
            assert tuple(spec) == ("data", "model")
        state = tr.init_state()
        losses[name] = []
        for _ in range(3):
            state, metrics = tr.train_step(state, global_batch)
            losses[name].append(summarize(metrics)["loss"])
    np.testing.assert_allclose(losses["length"], losses["dp"], rtol=1e-5)


@pytest.mark.slow
def test_multislice_recipe_with_the_run_presets(tmp_path, capsys):
    """docs/multi-process.md's multi-slice recipe on the quickstart (whose NUM_PARTITIONS is 4)."""
    require_devices(8)
    common = ["train", "--gin_file=quickstart.gin", "--gin_file=partitioning/multislice.gin",
              f"--gin.MODEL_DIR='{tmp_path}'", "--gin.TRAIN_STEPS=2", "--gin.train.evaluation=None",
              "--gin.warmup_cosine_schedule.warmup_steps=1",
              "--gin.Partitioner.dcn_mesh_shape=(2, 1, 1)"]  # fmt: skip
    assert run_cli(*common, "--gin.Partitioner.ici_mesh_shape=(1, 1, 4)") == 0
    assert (tmp_path / "checkpoint_2" / "COMMIT").is_file()
    capsys.readouterr()
    assert run_cli(*common, "--gin.Partitioner.ici_mesh_shape=(1, 2, 2)") == 1
    assert (
        capsys.readouterr()
        .err.strip()
        .startswith(
            "t5lite train: error: create_mesh: num_partitions=4 (model axis 4), ici_mesh_shape="
            "(1, 2, 2) x dcn_mesh_shape=(2, 1, 1) (model axis 2) contradict each other"
        )
    )


def test_model_parallel_submesh_tiles_physical_mesh():
    # A fake 2x2x1 TPU with 2 cores per chip: 8 cores, model groups of shape (1, 2, 1, 2).
    devs = [
        SimpleNamespace(id=i, coords=(x, y, 0), core_on_chip=c)
        for i, (x, y, c) in enumerate(
            (x, y, c) for y in range(2) for x in range(2) for c in range(2)
        )
    ]
    arr = partitioning.submesh_device_array(devs, (1, 2, 1, 2))
    assert arr.shape == (2, 4)
    for row in arr:  # every model group: one x, both y, both cores
        assert {d.coords[0] for d in row} == {row[0].coords[0]}
        assert {(d.coords[1], d.core_on_chip) for d in row} == {(0, 0), (0, 1), (1, 0), (1, 1)}
    with pytest.raises(PartitioningError, match=r"does not tile the physical mesh \(2, 2, 1, 2\)"):
        partitioning.submesh_device_array(devs, (1, 3, 1, 1))


def test_mesh_size_must_equal_device_count():
    require_devices(8)
    with pytest.raises(PartitioningError, match=r"mesh \(data=2, model=2\) has 4 devices but 8"):
        partitioning.create_mesh(ici_mesh_shape=(2, 2))
    with pytest.raises(PartitioningError, match="num_partitions=3 does not divide the 8 devices"):
        partitioning.create_mesh(num_partitions=3)


# --- rules --------------------------------------------------------------------------------------


def test_standard_rules_match_t5x_tables():
    r11 = dict(partitioning.standard_logical_axis_rules(1, 1))
    assert r11["batch"] == "data" and r11["mlp"] == "model" and r11["embed"] is None
    r22 = partitioning.standard_logical_axis_rules(2, 2)
    assert [a for n, a in r22 if n == "embed"] == ["model", "data"]
    for name in ("length", "kv", "relpos_buckets", "layers"):
        assert dict(r22)[name] is None
    with pytest.raises(PartitioningError, match="must each be 1 or 2"):
        partitioning.standard_logical_axis_rules(3, 1)


def test_priority_and_fallback():
    rules = partitioning.standard_logical_axis_rules(2, 2)
    resolve = partitioning.resolve_logical_axes
    # activations: batch takes data, embed takes model
    assert resolve(("batch", "length", "embed"), rules)[0] == P("data", None, "model")
    # parameters: mlp takes model, embed falls back to data
    assert resolve(("embed", "mlp"), rules)[0] == P("data", "model")
    # 2/1: embed's only rule (model) is taken by mlp -> replicated and flagged
    spec, flagged = resolve(("embed", "mlp"), partitioning.standard_logical_axis_rules(2, 1))
    assert spec == P(None, "model") and flagged == ("embed",)


# --- validation errors --------------------------------------------------------------------------


def test_error_logical_name_without_rule():
    part = Partitioner(partitioning.create_mesh(num_partitions=2))
    x = {"layer": {"w": jax.ShapeDtypeStruct((16, 4), jnp.float32)}}
    with pytest.raises(
        PartitioningError,
        match=r"parameter 'layer/w', shape \(16, 4\), logical axes \('embed', 'experts'\), "
        r"mesh \{data: 4, model: 2\}: logical axis 'experts' has no rule",
    ):
        part.placements(x, {"layer": {"w": P("embed", "experts")}})


def test_error_illegal_layout_same_mesh_axis_twice():
    part = Partitioner(partitioning.create_mesh(num_partitions=2))
    x = {"w": jax.ShapeDtypeStruct((8, 8), jnp.float32)}
    with pytest.raises(
        PartitioningError,
        match=r"parameter 'w', shape \(8, 8\).*illegal layout .*dimensions 0 and 1 are both "
        r"mapped to mesh axis 'model'",
    ):
        part.placements(x, {"w": partitioning.ExplicitSpec(P("model", "model"))})

    # The same through Flax's mesh-axis annotation in model code.
    class Bad(nn.Module):
        @nn.compact
        def __call__(self, x):
            return x @ self.param(
                "kernel", nn.with_partitioning(nn.initializers.ones, ("model", "model")), (8, 8)
            )

    with pytest.raises(PartitioningError, match=r"'params/kernel'.*illegal layout"):
        part.initialize(lambda r: Bad().init(r, jnp.ones((2, 8))), jax.random.PRNGKey(0))


def test_error_indivisible_dimension():
    part = Partitioner(partitioning.create_mesh(num_partitions=4))
    x = {"mlp": {"wi": jax.ShapeDtypeStruct((16, 6), jnp.float32)}}
    with pytest.raises(
        PartitioningError,
        match=r"parameter 'mlp/wi', shape \(16, 6\), logical axes \('embed', 'mlp'\), mesh "
        r"\{data: 2, model: 4\}: dimension 1 of size 6 is not divisible by mesh axes 'model' of "
        r"size 4",
    ):
        part.placements(x, {"mlp": {"wi": P("embed", "mlp")}})


def test_kv_heads_replicated_when_indivisible_and_flagged():
    part = Partitioner(partitioning.create_mesh(num_partitions=4))
    x = {"k": jax.ShapeDtypeStruct((16, 2, 4), jnp.float32)}
    (placement,) = jax.tree_util.tree_leaves(
        part.placements(x, {"k": P("embed", "kv_heads", "kv")}),
        is_leaf=lambda p: isinstance(p, partitioning.Placement),
    )
    assert placement.spec == P(None, None, None)
    assert placement.replicated_despite_rule == ("kv_heads",)


def test_error_batch_not_divisible_by_data_parallel_size():
    part = Partitioner(partitioning.create_mesh(num_partitions=2))
    with pytest.raises(
        PartitioningError,
        match=r"global batch size 6 is not divisible by the data-parallel size 4 "
        r"\(batch → mesh axes 'data' of mesh \{data: 4, model: 2\}\)",
    ):
        part.get_data_layout(6)


def test_error_rule_names_missing_mesh_axis():
    with pytest.raises(PartitioningError, match=r"rule \('batch', 'replica'\) names mesh axis "):
        Partitioner(
            partitioning.create_mesh(num_partitions=2),
            logical_axis_rules=partitioning.standard_logical_axis_rules(data_axis="replica"),
        )


def test_strict_mode_turns_flags_into_errors():
    mesh = partitioning.create_mesh(num_partitions=2)
    rules = partitioning.standard_logical_axis_rules(2, 1)
    x = {"wi": jax.ShapeDtypeStruct((16, 8), jnp.float32)}
    axes = {"wi": P("embed", "mlp")}
    report = sharding_report(Partitioner(mesh, logical_axis_rules=rules), x, axes)
    assert [p.path for p in report.flagged] == ["wi"]
    with pytest.raises(
        PartitioningError, match=r"'wi'.*logical axes \['embed'\] have sharding rules but stay "
    ):
        Partitioner(mesh, logical_axis_rules=rules, strict=True).placements(x, axes)


# --- data layout --------------------------------------------------------------------------------


def test_data_layout_and_global_batch():
    part = Partitioner(partitioning.create_mesh(num_partitions=2))
    layout = part.get_data_layout(16)
    # One process holds the whole batch.
    assert layout == partitioning.DataLayout(16, 0, 1, True)
    batch = part.host_local_to_global({"tokens": np.arange(16 * 3).reshape(16, 3)}, 16)
    assert batch["tokens"].sharding == NamedSharding(part.mesh, P("data", None))
    np.testing.assert_array_equal(batch["tokens"], np.arange(48).reshape(16, 3))
    with pytest.raises(PartitioningError, match="'tokens' has 8 local examples"):
        part.host_local_to_global({"tokens": np.zeros((8, 3))}, 16)


def test_global_batch_is_device_put_in_one_transfer_per_kind_of_feature():
    """Features of one shape, dtype and sharding go over stacked and are split on the devices:
    the same values, shardings and committed arrays as `jax.device_put` of each feature."""
    require_devices(8)
    part = Partitioner(partitioning.create_mesh(num_partitions=2))
    rng = np.random.default_rng(0)
    local = {
        "a": rng.integers(0, 99, (16, 3)).astype(np.int32),
        "b": rng.integers(0, 99, (16, 3)).astype(np.int32),
        "w": rng.random((16, 3)).astype(np.float32),  # another dtype: a transfer of its own
        "c": rng.integers(0, 99, (16, 4)).astype(np.int32),
        "d": rng.integers(0, 99, (16, 4)).astype(np.int32),  # sharded over its length too
        "e": rng.integers(0, 99, (16, 4)).astype(np.int32),
    }
    over_length = NamedSharding(part.mesh, P("data", "model"))
    shardings = {"d": over_length, "e": over_length}
    got = part.host_local_to_global(local, 16, shardings)
    want = jax.device_put(local, {k: shardings.get(k) or part.batch_sharding(2) for k in local})
    assert list(got) == list(local)
    for k in local:
        assert got[k].sharding == want[k].sharding and got[k].dtype == want[k].dtype, k
        assert got[k].committed and got[k].aval == want[k].aval, k
        np.testing.assert_array_equal(got[k], local[k])
        for g, w in zip(got[k].addressable_shards, want[k].addressable_shards, strict=True):
            assert g.device == w.device and g.index == w.index, k
    # One split per kind of feature that has company (a, b; d, e), traced once whatever the
    # values: the next batch reuses them.
    traces = []

    def listen(event, duration, **kw):
        if event == "/jax/core/compile/jaxpr_trace_duration":
            traces.append(kw.get("fun_name"))

    jax.monitoring.register_event_duration_secs_listener(listen)
    try:
        part.host_local_to_global({k: v + 1 for k, v in local.items()}, 16, shardings)
    finally:
        jax.monitoring.unregister_event_duration_listener(listen)
    assert traces == [] and len(part._splitters) == 2


# --- report -------------------------------------------------------------------------------------


def test_sharding_report_rows_and_totals():
    part = Partitioner(
        partitioning.create_mesh(num_partitions=4), logical_axis_rules=preset_rules("fsdp")
    )
    abstract, axes = part.abstract_initialize(toy_init, jax.random.PRNGKey(0))
    report = sharding_report(part, abstract["params"], axes["params"])
    rows = {p.path: p for p in report.placements}
    wi = rows["mlp/wi"]
    assert wi.shape == (EMBED, MLP) and wi.spec == P("data", "model")
    assert wi.shard_shape == (EMBED // 2, MLP // 4)
    assert wi.bytes_per_device == EMBED * MLP * 4 // 8
    assert report.bytes_total == sum(p.bytes_total for p in rows.values())
    text = report.format()
    assert re.search(r"mlp/wi\s+16x32\s+float32\s+embed,mlp\s+\(data,model\)\s+8x8\s+256 B", text)
    assert "bytes per device" in text
