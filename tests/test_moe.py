"""Mixture-of-experts MLP (model/moe.py): routing and dispatch against independent numpy
references, the auxiliary losses, the partitioning presets' expert layouts and the one-line
errors."""

from __future__ import annotations

import dataclasses
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import require_devices
from flax import linen as nn
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from moe_fixtures import LM_MOE, T5_MOE, moe_trainer

from t5lite import partitioning
from t5lite.model import moe, network
from t5lite.model.models import DecoderOnlyModel, EncoderDecoderModel
from t5lite.partitioning import Partitioner, PartitioningError
from t5lite.trainer import Trainer

B, L, D, F, E = 2, 8, 8, 16, 4

_ACT = {
    "silu": lambda x: x / (1.0 + np.exp(-x)),
    "relu": lambda x: np.maximum(x, 0.0),
    "linear": lambda x: x,
}


def _x(seed: int = 0, shape=(B, L, D)) -> jax.Array:
    return jax.random.normal(jax.random.PRNGKey(seed), shape, jnp.float32)


def _run(block: moe.MoeBlock, x: jax.Array, params=None):
    """(output, params, intermediates) of one deterministic call."""
    if params is None:
        params = nn.unbox(block.init(jax.random.PRNGKey(1), x))["params"]
    y, state = block.apply({"params": params}, x, mutable=["intermediates"])
    inter = jax.tree.map(np.asarray, state["intermediates"])
    return np.asarray(y), jax.tree.map(np.asarray, params), inter


def _mlp(params, prefix_wi, wo, activations, x_D):
    """One expert's (gated) MLP in numpy: prod_i act_i(x @ wi_i) @ wo."""
    h = np.ones(wo.shape[0], np.float64)
    for wi, act in zip(prefix_wi, activations):
        h = h * _ACT[act](x_D @ wi)
    return h @ wo


def _wis(params, activations, e=None):
    names = ["wi"] if len(activations) == 1 else [f"wi_{i}" for i in range(len(activations))]
    return [params[n] if e is None else params[n][e] for n in names]


def _reference_routing(params, x_TD, top_k, router, normalize):
    """Router in numpy: probs [T, E], chosen experts [T, K] (best first), weights [T, K]."""
    logits = x_TD.astype(np.float64) @ params["router"]["kernel"]
    probs = np.exp(logits - logits.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    experts = np.argsort(-probs, axis=-1, kind="stable")[:, :top_k]
    if router == "softmax_then_topk":
        weights = np.take_along_axis(probs, experts, -1)
        if normalize:
            weights = weights / weights.sum(-1, keepdims=True)
    else:
        top = np.take_along_axis(logits, experts, -1)
        weights = np.exp(top - top.max(-1, keepdims=True))
        weights /= weights.sum(-1, keepdims=True)
    return logits, probs, experts, weights


def _reference(params, x_BLD, top_k, activations, router, normalize, capacity=None, shared=0):
    """Each token through its top-k experts' MLPs, weighted by the router. With `capacity`,
    per sequence: first choices of all tokens queue before second choices, tokens in order;
    a choice arriving at a full expert is dropped (contributes 0)."""
    b, length, d = x_BLD.shape
    x = np.asarray(x_BLD, np.float64)
    _, _, experts, weights = _reference_routing(params, x.reshape(-1, d), top_k, router, normalize)
    experts, weights = experts.reshape(b, length, top_k), weights.reshape(b, length, top_k)
    y = np.zeros_like(x)
    kept = np.ones((b, length, top_k), bool)
    for g in range(b):
        counts = np.zeros(params["wo"].shape[0], int)
        for j in range(top_k):
            for s in range(length):
                e = experts[g, s, j]
                if capacity is not None and counts[e] >= capacity:
                    kept[g, s, j] = False
                    continue
                counts[e] += 1
                wis = _wis(params, activations, e)
                out = _mlp(params, wis, params["wo"][e], activations, x[g, s])
                y[g, s] += weights[g, s, j] * out
    if shared:
        sp = params["shared_experts"]
        wis = [sp[n]["kernel"] for n in sorted(k for k in sp if k.startswith("wi"))]
        for g in range(b):
            for s in range(length):
                y[g, s] += _mlp(sp, wis, sp["wo"]["kernel"], activations, x[g, s])
    return y, kept


CASES = [  # (top_k, activations, router, normalize, shared experts)
    (2, ("silu", "linear"), "softmax_then_topk", True, 0),  # Mixtral
    (1, ("relu",), "softmax_then_topk", False, 0),  # Switch
    (2, ("silu", "linear"), "topk_then_softmax", False, 1),
    (3, ("relu",), "softmax_then_topk", False, 0),
]


@pytest.mark.parametrize(("top_k", "acts", "router", "normalize", "shared"), CASES)
def test_dropless_equals_a_per_token_reference(top_k, acts, router, normalize, shared):
    block = moe.MoeBlock(
        E,
        F,
        acts,
        top_k=top_k,
        router=router,
        normalize_top_k=normalize,
        dispatch="dropless",
        num_shared_experts=shared,
    )
    x = _x()
    y, params, inter = _run(block, x)
    want, _ = _reference(params, x, top_k, acts, router, normalize, shared=shared)
    np.testing.assert_allclose(y, want, rtol=2e-5, atol=2e-5)
    assert inter[moe.DROPPED] == (0.0,)


@pytest.mark.parametrize(("top_k", "acts", "router", "normalize", "shared"), CASES)
def test_capacity_with_room_for_every_token_equals_dropless(top_k, acts, router, normalize, shared):
    kw = dict(
        activations=acts,
        top_k=top_k,
        router=router,
        normalize_top_k=normalize,
        num_shared_experts=shared,
    )
    x = _x(1)
    dropless, params, _ = _run(moe.MoeBlock(E, F, dispatch="dropless", **kw), x)
    # factor E / k gives C = L slots: no expert can overflow.
    roomy = moe.MoeBlock(E, F, dispatch="capacity", eval_capacity_factor=E / top_k, **kw)
    y, _, inter = _run(roomy, x, params)
    np.testing.assert_allclose(y, dropless, rtol=2e-5, atol=2e-5)
    assert inter[moe.DROPPED] == (0.0,)


@pytest.mark.parametrize(("top_k", "factor"), [(1, 0.5), (2, 0.5), (2, 0.25)])
def test_small_capacity_drops_exactly_the_reference_choices(top_k, factor):
    acts = ("silu", "linear")
    block = moe.MoeBlock(E, F, acts, top_k=top_k, eval_capacity_factor=factor)
    x = _x(2, (4, 16, D))
    y, params, inter = _run(block, x)
    capacity = moe.expert_capacity(16, E, top_k, factor)
    assert capacity == int(np.ceil(factor * 16 * top_k / E))
    want, kept = _reference(params, x, top_k, acts, "softmax_then_topk", False, capacity)
    assert 0 < (~kept).sum() < kept.size  # the case drops some choices, not all
    np.testing.assert_allclose(y, want, rtol=2e-5, atol=2e-5)
    np.testing.assert_allclose(inter[moe.DROPPED][0], (~kept).mean(), rtol=1e-6)
    # A token with every choice dropped passes through the residual only: its output is 0.
    all_dropped = ~kept.any(-1)
    if top_k == 1:
        assert all_dropped.any()
    assert np.all(y[all_dropped] == 0.0)


@pytest.mark.parametrize("top_k", [1, 2])
def test_aux_and_z_losses_equal_the_switch_and_st_moe_formulas(top_k):
    block = moe.MoeBlock(E, F, top_k=top_k)
    x = _x(3)
    _, params, inter = _run(block, x)
    logits, probs, experts, _ = _reference_routing(
        params, np.asarray(x).reshape(-1, D), top_k, "softmax_then_topk", False
    )
    t = B * L
    # f_e: fraction of tokens routed to e (each of the k choices counted), P_e: mean prob.
    f = np.array([(experts == e).sum() / t for e in range(E)])
    p = probs.mean(0)
    np.testing.assert_allclose(inter[moe.AUX_LOSS][0], E * np.sum(f * p), rtol=1e-5)
    if top_k == 1:  # Switch's f_e: fraction of tokens whose argmax is e
        argmax = probs.argmax(-1)
        switch_f = np.array([(argmax == e).mean() for e in range(E)])
        np.testing.assert_allclose(inter[moe.AUX_LOSS][0], E * np.sum(switch_f * p), rtol=1e-5)
    log_z = np.log(np.exp(logits).sum(-1))
    np.testing.assert_allclose(inter[moe.Z_LOSS][0], np.mean(log_z**2), rtol=1e-5)
    np.testing.assert_allclose(inter[moe.EXPERT_LOAD][0], f / top_k, rtol=1e-6)


def test_router_jitter_changes_training_routing_only():
    block = moe.MoeBlock(E, F, top_k=1, jitter_noise=0.5, dispatch="dropless")
    x = _x(4)
    y, params, _ = _run(block, x)
    quiet = moe.MoeBlock(E, F, top_k=1, dispatch="dropless")
    np.testing.assert_array_equal(y, _run(quiet, x, params)[0])  # eval: no noise
    rngs = {"dropout": jax.random.PRNGKey(7)}
    noisy, _ = block.apply(
        {"params": params}, x, deterministic=False, rngs=rngs, mutable=["intermediates"]
    )
    assert not np.allclose(noisy, y)


# --- the model: layer choice, loss wiring ------------------------------------------------------


def _lm_batch(b: int = 8, length: int = 8, seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.RandomState(seed)
    targets = rng.randint(1, 64, (b, length)).astype(np.int32)
    targets[1, 5:] = 0
    return {
        "decoder_input_tokens": np.pad(targets[:, :-1], ((0, 0), (1, 0))),
        "decoder_target_tokens": targets,
        "decoder_loss_weights": (targets > 0).astype(np.float32),
    }


def test_moe_every_picks_the_layers_and_t5_gets_them_too():
    t5 = network.T5Config(
        vocab_size=64,
        emb_dim=16,
        num_heads=4,
        head_dim=4,
        mlp_dim=32,
        num_encoder_layers=4,
        num_decoder_layers=4,
        num_experts=4,
        moe_every=2,
    )
    assert [network.is_moe_layer(t5, i) for i in range(4)] == [False, True, False, True]
    model = network.EncoderDecoder(t5)
    tokens = jnp.ones((2, 8), jnp.int32)
    params = jax.eval_shape(model.init, jax.random.PRNGKey(0), tokens, tokens)["params"]
    for stack in ("encoder", "decoder"):
        sparse = [i for i in range(4) if "router" in params[stack][f"layers_{i}"]["mlp"]]
        assert sparse == [1, 3]
    wi = params["encoder"]["layers_1"]["mlp"]["wi_0"]
    assert wi.value.shape == (4, 16, 32) and wi.names == ("expert", "embed", "expert_mlp")


def test_training_loss_adds_the_weighted_aux_losses():
    batch = {k: jnp.asarray(v) for k, v in _lm_batch().items()}
    model = DecoderOnlyModel(network_config=LM_MOE)
    params = nn.unbox(model.init(jax.random.PRNGKey(0), batch))["params"]
    bare = DecoderOnlyModel(
        network_config=dataclasses.replace(LM_MOE, moe_aux_loss_coef=0.0, moe_z_loss_coef=0.0)
    )
    num, m = model.loss_terms(params, batch, None)
    num0, m0 = bare.loss_terms(params, batch, None)
    den = float(m["loss_denominator"])
    assert m["loss_sum"] == m0["loss_sum"] and den > 1
    aux, z = float(m["moe_aux_loss_sum"]) / den, float(m["moe_z_loss_sum"]) / den
    assert aux > 0 and z > 0
    np.testing.assert_allclose(float(num - num0), (0.01 * aux + 0.001 * z) * den, rtol=1e-4)
    # Scanned layers sow stacked values: the same statistics.
    scanned = DecoderOnlyModel(network_config=dataclasses.replace(LM_MOE, scan_layers=True))
    num_s, m_s = scanned.loss_terms(network.scan_params(params), batch, None)
    np.testing.assert_allclose(float(num_s), float(num), rtol=1e-5)
    for k in ("moe_aux_loss_sum", "moe_z_loss_sum", "moe_dropped_sum", "moe_load_imbalance_sum"):
        np.testing.assert_allclose(float(m_s[k]), float(m[k]), rtol=1e-5)


# --- partitioning --------------------------------------------------------------------------

M, DA = "model", "data"
EXPERT_SPECS = {  # mesh data=4 x model=2
    "megatron": {"wi_0": P(DA, None, M), "wo": P(DA, M, None), "router": P(None, DA)},
    "expert_parallel": {"wi_0": P(DA, None, None), "wo": P(DA, None, None), "router": P(None, DA)},
    "fsdp": {"wi_0": P(None, DA, M), "wo": P(None, M, DA), "router": P(DA, None)},
}


@pytest.mark.parametrize("preset", list(EXPERT_SPECS))
def test_expert_kernel_shardings(preset):
    require_devices(8)
    tr = moe_trainer(LM_MOE, preset)
    mlp = tr.state_shardings.params["decoder"]["layers_0"]["mlp"]
    got = {"wi_0": mlp["wi_0"], "wo": mlp["wo"], "router": mlp["router"]["kernel"]}
    mesh = tr.partitioner.mesh
    assert got == {k: NamedSharding(mesh, s) for k, s in EXPERT_SPECS[preset].items()}
    assert mlp["wi_1"] == got["wi_0"]


def _collectives(hlo: str) -> dict[str, int]:
    ops = ("all-to-all", "all-gather", "all-reduce", "reduce-scatter", "collective-permute")
    return {op: len(re.findall(rf"\s{op}(?:-start)?\(", hlo)) for op in ops}


def test_expert_parallel_train_step_uses_all_to_all_over_data():
    require_devices(8)
    tr = moe_trainer(dataclasses.replace(LM_MOE, num_layers=1))
    hlo = tr.train_step.lower(tr.abstract_state(), tr.batch_abstract).compile().as_text()
    counts = _collectives(hlo)
    # Dispatch and combine forward, their transposes backward: all-to-alls over `data`.
    assert counts["all-to-all"] >= 4, counts
    data_groups = [
        sorted(int(d.id) for d in col) for col in np.asarray(tr.partitioner.mesh.devices).T
    ]
    for line in hlo.splitlines():
        if re.search(r"\sall-to-all\(", line):
            groups = re.search(r"replica_groups=(\S+?),? ", line).group(1)
            assert groups in (_iota_groups(data_groups), "[2,4]<=[4,2]T(1,0)"), line


def _iota_groups(groups: list[list[int]]) -> str:
    return "{" + ",".join("{" + ",".join(map(str, g)) + "}" for g in groups) + "}"


PRESET_NAMES = list(partitioning.PRESETS)


@pytest.fixture(scope="module")
def one_device_reference():
    """Eval metrics of the tiny MoE LM on one device, per dispatch mode."""
    out = {}
    batch = _lm_batch()
    for dispatch in ("capacity", "dropless"):
        cfg = dataclasses.replace(LM_MOE, moe_dispatch=dispatch, moe_eval_capacity_factor=0.5)
        model = DecoderOnlyModel(network_config=cfg)
        params = nn.unbox(model.init(jax.random.PRNGKey(0), jax.tree.map(jnp.asarray, batch)))
        out[dispatch] = (params["params"], jax.jit(model.eval_fn)(params["params"], batch))
    return out


# Capacity under every preset; dropless under one table with and one without `expert_mlp`
# sharding.
LOSS_CASES = [(p, "capacity") for p in PRESET_NAMES] + [
    ("megatron", "dropless"),
    ("expert_parallel", "dropless"),
]


@pytest.mark.parametrize(("preset", "dispatch"), LOSS_CASES)
def test_losses_on_8_devices_equal_1_device(preset, dispatch, one_device_reference):
    require_devices(8)
    cfg = dataclasses.replace(LM_MOE, moe_dispatch=dispatch, moe_eval_capacity_factor=0.5)
    tr = moe_trainer(cfg, preset)
    params_ref, want = one_device_reference[dispatch]
    params = jax.tree.map(lambda x, s: jax.device_put(x, s), params_ref, tr.state_shardings.params)
    got = tr.eval_step(params, tr.global_batch_from_full(_lm_batch()))
    assert float(want["moe_dropped_sum"]) > 0 or dispatch == "dropless"
    for k in ("loss_sum", "moe_aux_loss_sum", "moe_z_loss_sum", "moe_dropped_sum"):
        np.testing.assert_allclose(float(got[k]), float(want[k]), rtol=2e-5, err_msg=k)


def test_capacity_on_explicit_axes_equals_1_device(one_device_reference):
    require_devices(8)
    cfg = dataclasses.replace(LM_MOE, moe_eval_capacity_factor=0.5)
    part = Partitioner(
        partitioning.create_mesh(2),
        logical_axis_rules=partitioning.preset_rules("megatron"),
        shard_mode="explicit",
    )
    tr = Trainer(DecoderOnlyModel(network_config=cfg), part, batch_size=8, lengths={"targets": 8})
    params_ref, want = one_device_reference["capacity"]
    params = jax.tree.map(jax.device_put, params_ref, tr.state_shardings.params)
    got = tr.eval_step(params, tr.global_batch_from_full(_lm_batch()))
    for k in ("loss_sum", "moe_aux_loss_sum", "moe_z_loss_sum", "moe_dropped_sum"):
        np.testing.assert_allclose(float(got[k]), float(want[k]), rtol=2e-5, err_msg=k)


@pytest.mark.parametrize("preset", ["megatron", "expert_parallel"])
def test_switch_style_t5_on_8_devices_equals_1_device(preset):
    require_devices(8)
    rng = np.random.RandomState(3)
    batch = _lm_batch(seed=3)
    batch["encoder_input_tokens"] = rng.randint(1, 64, (8, 8)).astype(np.int32)
    model = EncoderDecoderModel(
        network_config=dataclasses.replace(T5_MOE, moe_eval_capacity_factor=0.5)
    )
    params = nn.unbox(model.init(jax.random.PRNGKey(0), jax.tree.map(jnp.asarray, batch)))
    want = jax.jit(model.eval_fn)(params["params"], batch)
    assert float(want["moe_dropped_sum"]) > 0
    part = Partitioner(
        partitioning.create_mesh(2), logical_axis_rules=partitioning.preset_rules(preset)
    )
    tr = Trainer(model, part, batch_size=8, lengths={"inputs": 8, "targets": 8})
    sharded = jax.tree.map(jax.device_put, params["params"], tr.state_shardings.params)
    got = tr.eval_step(sharded, tr.global_batch_from_full(batch))
    for k in ("loss_sum", "moe_aux_loss_sum", "moe_z_loss_sum", "moe_dropped_sum"):
        np.testing.assert_allclose(float(got[k]), float(want[k]), rtol=2e-5, err_msg=k)


# --- one-line errors -------------------------------------------------------------------------

CONFIG_ERRORS = [
    (
        dict(num_experts=4, moe_top_k=5),
        "DecoderOnlyConfig.moe_top_k=5 must be between 1 and num_experts=4",
    ),
    (
        dict(num_experts=4, moe_capacity_factor=0.0),
        "DecoderOnlyConfig.moe_capacity_factor must be > 0, got 0.0",
    ),
    (
        dict(num_experts=4, moe_eval_capacity_factor=-1.0),
        "DecoderOnlyConfig.moe_eval_capacity_factor must be > 0, got -1.0",
    ),
    (
        dict(num_experts=4, moe_every=3),
        "DecoderOnlyConfig.moe_every=3 must be between 1 and the number of layers (2)",
    ),
    (
        dict(num_experts=4, moe_every=0),
        "DecoderOnlyConfig.moe_every=0 must be between 1 and the number of layers (2)",
    ),
    (
        dict(num_experts=4, moe_every=2, scan_layers=True),
        "DecoderOnlyConfig.moe_every=2 needs scan_layers=False (scanned layers are identical: "
        "use moe_every=1 to scan a mixture-of-experts model)",
    ),
    (
        dict(num_experts=4, moe_dispatch="sorted"),
        "DecoderOnlyConfig.moe_dispatch must be one of ('capacity', 'dropless'), got 'sorted'",
    ),
    (dict(num_experts=-1), "DecoderOnlyConfig.num_experts must be >= 0 (0: dense), got -1"),
]


@pytest.mark.parametrize(("kw", "message"), CONFIG_ERRORS)
def test_bad_settings_are_one_line(kw, message):
    with pytest.raises(ValueError) as e:
        dataclasses.replace(LM_MOE, **{"num_experts": 0, **kw})
    assert str(e.value) == message


def test_t5_config_names_itself():
    with pytest.raises(ValueError, match=r"^T5Config.moe_top_k=2 must be between 1 and "):
        network.T5Config(num_experts=1, moe_top_k=2)


def test_experts_not_dividing_their_mesh_axis_name_num_experts():
    require_devices(8)
    with pytest.raises(PartitioningError) as e:
        moe_trainer(dataclasses.replace(LM_MOE, num_experts=6))
    assert str(e.value).startswith(
        "num_experts=6 is not divisible by mesh axes 'data' of size 4, which the rules give "
        "'expert' ("
    )
    assert str(e.value).endswith("use a multiple of 4 experts or another rule for 'expert'")
    assert "\n" not in str(e.value)


def test_the_gin_files_build_the_tiny_moe_lm_and_the_preset():
    import gin

    from t5lite.cli import registry as gin_registry
    from t5lite.cli.gin_config import parse_gin

    try:
        parse_gin(["models/decoder_only/tiny_moe.gin", "partitioning/expert_parallel.gin"], [])
        with gin.unlock_config():
            cfg = gin_registry.DecoderOnlyConfig()
            rules = gin_registry.Partitioner(mesh=partitioning.create_mesh()).rules
    finally:
        with gin.unlock_config():
            gin.clear_config()
    assert (cfg.num_experts, cfg.moe_every, cfg.moe_top_k, cfg.moe_dispatch) == (
        4,
        1,
        2,
        "capacity",
    )
    assert cfg.moe_normalize_top_k and cfg.num_layers == 2
    assert rules == partitioning.preset_rules("expert_parallel")
    assert dict(rules)["expert"] == "data" and dict(rules)["expert_mlp"] is None
    assert dict(rules)["expert_capacity"] == "model"
