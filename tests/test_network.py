"""T5.1.1 encoder-decoder and decoder-only networks: presets, sharding invariance, packing,
causality, scan/remat."""

from __future__ import annotations

import dataclasses
import functools

import gin
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import require_devices
from flax.core import meta
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from t5lite import partitioning
from t5lite.cli import registry as gin_registry
from t5lite.model import network
from t5lite.model.losses import cross_entropy_with_logits

# --- tiny configs --------------------------------------------------------------------------

T5_TINY = network.T5Config(
    vocab_size=128,
    emb_dim=16,
    num_heads=8,
    head_dim=4,
    mlp_dim=32,
    num_encoder_layers=2,
    num_decoder_layers=2,
    # NOTE: a small max distance so that the log-spaced buckets are exercised at length 8.
    relpos_num_buckets=8,
    relpos_max_distance=16,
)
LM_TINY = network.DecoderOnlyConfig(
    vocab_size=128,
    emb_dim=16,
    num_heads=8,
    num_kv_heads=4,
    head_dim=4,
    mlp_dim=32,
    num_layers=2,
)


def _tokens(key: jax.Array, shape: tuple[int, ...], vocab: int) -> jax.Array:
    return jax.random.randint(key, shape, 1, vocab, dtype=jnp.int32)


def _t5_batch(b: int = 8, s: int = 8, length: int = 8, seed: int = 0) -> dict[str, jax.Array]:
    k1, k2 = jax.random.split(jax.random.PRNGKey(seed))
    targets = _tokens(k2, (b, length), T5_TINY.vocab_size)
    targets = targets.at[1, 5:].set(0)  # some padding
    inputs = _tokens(k1, (b, s), T5_TINY.vocab_size).at[2, 6:].set(0)
    return {
        "encoder_input_tokens": inputs,
        "decoder_input_tokens": jnp.pad(targets[:, :-1], ((0, 0), (1, 0))),
        "decoder_target_tokens": targets,
    }


def _lm_batch(b: int = 8, length: int = 8, seed: int = 0) -> dict[str, jax.Array]:
    targets = _tokens(jax.random.PRNGKey(seed), (b, length), LM_TINY.vocab_size)
    targets = targets.at[1, 6:].set(0)
    return {
        "decoder_input_tokens": jnp.pad(targets[:, :-1], ((0, 0), (1, 0))),
        "decoder_target_tokens": targets,
    }


def _model(cfg):
    return (
        network.EncoderDecoder(cfg)
        if isinstance(cfg, network.T5Config)
        else network.DecoderOnly(cfg)
    )


def _init(cfg, batch):
    """Boxed variables (logical axes attached)."""
    init = functools.partial(_model(cfg).init, enable_dropout=False)
    return jax.jit(init)(jax.random.PRNGKey(42), **batch)


def _max_abs_diff(a, b) -> float:
    """max |a - b| on the host: the same number as jnp's (float subtraction and abs are exact
    IEEE operations either way), without compiling three tiny XLA programs per leaf shape and
    sharding (hundreds of programs over the mesh x rules matrix on a cold cache)."""
    return float(np.max(np.abs(np.asarray(a) - np.asarray(b))))


@functools.partial(jax.jit, static_argnums=0)
def _per_token_loss(cfg, params, batch):
    logits = _model(cfg).apply({"params": params}, **batch, enable_dropout=False)
    loss, _ = cross_entropy_with_logits(logits, batch["decoder_target_tokens"])
    return loss * (batch["decoder_target_tokens"] > 0)


def _mean_loss(cfg, params, batch):
    w = batch["decoder_target_tokens"] > 0
    return jnp.sum(_per_token_loss(cfg, params, batch)) / jnp.sum(w)


def _count(tree) -> int:
    return int(sum(np.prod(x.shape) for x in jax.tree.leaves(tree)))


# --- presets: shapes and parameter counts through eval_shape ----------------------------------


def _t5_count(v, d, h, k, f, ne, nd, buckets=32) -> int:
    """Closed form: shared embedding + untied logits + layers + 2 relpos tables + 2 final norms."""
    attn = 4 * d * h * k
    mlp = 3 * d * f
    enc_layer = attn + mlp + 2 * d
    dec_layer = 2 * attn + mlp + 3 * d
    return 2 * v * d + ne * enc_layer + nd * dec_layer + 2 * buckets * h + 2 * d


def _lm_count(v, d, h, g, k, f, n, tied) -> int:
    attn = d * h * k * 2 + d * g * k * 2
    layer = attn + 3 * d * f + 2 * d
    return (1 if tied else 2) * v * d + n * layer + d


# (preset, closed form, published count of the reference checkpoint or None)
PRESETS = [
    ("t5_1_1/tiny", _t5_count(32128, 64, 4, 16, 256, 2, 2), None),
    # google/t5-v1_1-{small,base,large,xl,xxl}, as reported by HF `num_parameters()`.
    ("t5_1_1/small", _t5_count(32128, 512, 6, 64, 1024, 8, 8), 76_961_152),
    ("t5_1_1/base", _t5_count(32128, 768, 12, 64, 2048, 12, 12), 247_577_856),
    ("t5_1_1/large", _t5_count(32128, 1024, 16, 64, 2816, 24, 24), 783_150_080),
    ("t5_1_1/xl", _t5_count(32128, 2048, 32, 64, 5120, 24, 24), 2_849_757_184),
    ("t5_1_1/xxl", _t5_count(32128, 4096, 64, 64, 10240, 24, 24), 11_135_332_352),
    ("decoder_only/tiny", _lm_count(32128, 64, 4, 2, 16, 256, 2, tied=True), None),
    ("decoder_only/125m", _lm_count(50304, 768, 12, 12, 64, 2048, 12, tied=True), None),
    # TinyLlama-1.1B and Llama-2-7B published parameter counts.
    ("decoder_only/1b", _lm_count(32000, 2048, 32, 4, 64, 5632, 22, tied=False), 1_100_048_384),
    ("decoder_only/llama_7b", _lm_count(32000, 4096, 32, 32, 128, 11008, 32, False), 6_738_415_616),
]


@pytest.mark.parametrize("scan", [False, True])
@pytest.mark.parametrize(("preset", "expected", "published"), PRESETS, ids=[p[0] for p in PRESETS])
def test_preset_parameter_count(preset, expected, published, scan):
    if published is not None:
        assert expected == published
    gin.clear_config()
    try:
        gin.add_config_file_search_path("configs")
        gin.parse_config_files_and_bindings(
            [f"configs/models/{preset}.gin"], [f"SCAN_LAYERS = {scan}"]
        )
        is_t5 = preset.startswith("t5")
        # The gin-bound config, as the run files hand it to the model.
        cfg = gin_registry.T5Config() if is_t5 else gin_registry.DecoderOnlyConfig()
        model = network.EncoderDecoder(cfg) if is_t5 else network.DecoderOnly(cfg)
    finally:
        gin.clear_config()
    assert model.config.scan_layers is scan
    x = jnp.ones((1, 4), jnp.int32)
    args = (x, x) if is_t5 else (x,)
    boxed = jax.eval_shape(
        functools.partial(model.init, enable_dropout=False), jax.random.PRNGKey(0), *args
    )
    params = meta.unbox(boxed)["params"]
    assert _count(params) == expected
    cfg = model.config
    emb = params["token_embedder"]["embedding"]
    assert (emb.shape, emb.dtype) == ((cfg.vocab_size, cfg.emb_dim), jnp.float32)
    layer = params["decoder"]["layers"] if scan else params["decoder"]["layers_0"]
    q = layer["self_attention"]["query"]["kernel"]
    lead = (cfg.num_decoder_layers if is_t5 else cfg.num_layers,) if scan else ()
    assert q.shape == (*lead, cfg.emb_dim, cfg.num_heads, cfg.head_dim)
    q_axes = boxed["params"]["decoder"]["layers" if scan else "layers_0"]["self_attention"]
    q_axes = q_axes["query"]["kernel"].names
    assert q_axes == (("layers",) if scan else ()) + ("embed", "heads", "kv")


def test_logical_axes_of_every_parameter():
    boxed = _init(T5_TINY, _t5_batch())
    axes = partitioning.logical_axes_of(boxed)["params"]
    flat = {
        jax.tree_util.keystr(path): spec
        for path, spec in jax.tree_util.tree_leaves_with_path(
            axes, is_leaf=lambda x: x is None or isinstance(x, P)
        )
    }
    assert None not in flat.values(), "every parameter carries logical axes"
    assert flat["['token_embedder']['embedding']"] == P("vocab", "embed")
    assert flat["['encoder']['relpos_bias']['rel_embedding']"] == P("heads", "relpos_buckets")
    assert flat["['encoder']['layers_0']['mlp']['wi_0']['kernel']"] == P("embed", "mlp")
    assert flat["['encoder']['layers_1']['mlp']['wo']['kernel']"] == P("mlp", "embed")
    assert flat["['decoder']['layers_0']['encoder_decoder_attention']['out']['kernel']"] == P(
        "heads", "kv", "embed"
    )
    assert flat["['decoder']['logits_dense']['kernel']"] == P("embed", "vocab")
    assert flat["['decoder']['decoder_norm']['scale']"] == P("embed")
    lm_axes = partitioning.logical_axes_of(_init(LM_TINY, _lm_batch()))["params"]
    assert lm_axes["decoder"]["layers_0"]["self_attention"]["key"]["kernel"] == P(
        "embed", "kv_heads", "kv"
    )


def test_t5_1_0_variant_and_param_dtype():
    # Pure bf16 storage (no fp32 masters) initialises bf16 parameters.
    cfg = dataclasses.replace(T5_TINY, variant="t5.1.0", precision="params=bf16,master=bf16")
    params = meta.unbox(_init(cfg, _t5_batch()))["params"]
    assert set(params["encoder"]["layers_0"]["mlp"]) == {"wi", "wo"}
    assert "logits_dense" not in params["decoder"]
    assert {x.dtype for x in jax.tree.leaves(params)} == {jnp.dtype(jnp.bfloat16)}
    logits = jax.jit(functools.partial(_model(cfg).apply, enable_dropout=False))(
        {"params": params}, **_t5_batch()
    )
    assert logits.dtype == jnp.float32
    # The old `param_dtype` spelling now means bf16 parameters over fp32 masters.
    old = dataclasses.replace(T5_TINY, param_dtype="bfloat16")
    assert old.precision == "params=bfloat16,compute=float32,output=float32,master=float32"
    with pytest.raises(ValueError, match="variant"):
        network.T5Config(variant="t5.2")
    with pytest.raises(ValueError, match="remat_policy"):
        network.DecoderOnlyConfig(remat_policy="some")


# --- the same numbers on every mesh and rules table -------------------------------------------

MESHES = [(1, 8), (2, 4), (4, 2), (8, 1)]
RULES = [(1, 1), (1, 2), (2, 1), (2, 2)]
# The fast set covers every mesh and every table; the rest of the product is marked slow.
_FAST = {((1, 8), (1, 1)), ((2, 4), (1, 1)), ((4, 2), (1, 1)), ((8, 1), (1, 1)),
         ((2, 4), (1, 2)), ((2, 4), (2, 1)), ((2, 4), (2, 2))}  # fmt: skip
_CASES = [
    pytest.param(m, r, marks=() if (m, r) in _FAST else pytest.mark.slow, id=f"{m}-{r}")
    for m in MESHES
    for r in RULES
]


@functools.cache
def _reference(arch: str):
    cfg = T5_TINY if arch == "t5" else dataclasses.replace(LM_TINY, scan_layers=True)
    batch = _t5_batch() if arch == "t5" else _lm_batch()
    boxed = _init(cfg, batch)
    params = meta.unbox(boxed)["params"]
    loss, grads = jax.jit(jax.value_and_grad(functools.partial(_mean_loss, cfg)))(params, batch)
    return cfg, batch, boxed, params, loss, grads


@pytest.mark.parametrize("arch", ["t5", "lm"])
@pytest.mark.parametrize(("mesh_shape", "dims"), _CASES)
def test_outputs_and_grads_equal_across_meshes(arch, mesh_shape, dims):
    require_devices(8)
    cfg, batch, boxed, params, ref_loss, ref_grads = _reference(arch)
    mesh = Mesh(np.array(jax.devices()[:8]).reshape(mesh_shape), ("data", "model"))
    rules = partitioning.standard_logical_axis_rules(*dims)
    part = partitioning.Partitioner(mesh=mesh, logical_axis_rules=rules)
    axes = partitioning.logical_axes_of(boxed)["params"]
    param_sh = part.shardings(params, axes)
    batch_sh = jax.tree.map(lambda _: NamedSharding(mesh, P("data")), batch)
    step = part.partition(
        jax.value_and_grad(functools.partial(_mean_loss, cfg)),
        in_shardings=(param_sh, batch_sh),
        out_shardings=(None, param_sh),
    )
    # Placed from host copies: putting device arrays onto another sharding compiles a resharding
    # program per leaf shape and sharding (hundreds over the mesh x rules matrix, cold).
    host = lambda tree: jax.tree.map(np.asarray, tree)
    loss, grads = step(
        jax.device_put(host(params), param_sh), jax.device_put(host(batch), batch_sh)
    )
    np.testing.assert_allclose(loss, ref_loss, atol=1e-5, rtol=0)
    diffs = jax.tree.map(_max_abs_diff, grads, ref_grads)
    assert max(jax.tree.leaves(diffs)) <= 1e-5, diffs
    # The gradients come out in the parameters' layout, which is the one the table asks for.
    same = jax.tree.map(lambda g, sh: g.sharding.is_equivalent_to(sh, g.ndim), grads, param_sh)
    assert all(jax.tree.leaves(same))
    if mesh_shape == (2, 4):
        layer = param_sh["decoder"]["layers" if arch == "lm" else "layers_0"]
        lead = (None,) if arch == "lm" else ()
        want = P(*lead, "data" if dims[1] == 2 else None, "model")  # [embed, mlp]
        assert layer["mlp"]["wi_0"]["kernel"].is_equivalent_to(
            NamedSharding(mesh, want), 2 + len(lead)
        )


# --- packing ----------------------------------------------------------------------------------


def _shift_right(t):
    return jnp.pad(t[..., :-1], ((0, 0), (1, 0)))


def _pack(examples, length):
    """Packs [(tokens...)] into one row: tokens, segment ids (1, 2, …), positions."""
    toks, segs, pos = [], [], []
    for i, ex in enumerate(examples):
        toks += list(ex)
        segs += [i + 1] * len(ex)
        pos += list(range(len(ex)))
    pad = length - len(toks)
    f = lambda x: jnp.array([x + [0] * pad], jnp.int32)
    return f(toks), f(segs), f(pos)


def _unpack(examples, length):
    return jnp.array([list(ex) + [0] * (length - len(ex)) for ex in examples], jnp.int32)


def _per_example(loss_row, segs_row, n):
    return [float(jnp.sum(jnp.where(segs_row == i + 1, loss_row, 0.0))) for i in range(n)]


@pytest.mark.parametrize("arch", ["t5", "lm"])
def test_packed_equals_unpacked(arch):
    cfg = T5_TINY if arch == "t5" else LM_TINY
    params = meta.unbox(_init(cfg, _t5_batch() if arch == "t5" else _lm_batch()))["params"]
    rng = np.random.RandomState(0)
    tgt = [rng.randint(1, 128, n).tolist() for n in (3, 5, 2)]
    inp = [rng.randint(1, 128, n).tolist() for n in (4, 2, 6)]
    L = 12
    tp, ts, tpos = _pack(tgt, L)
    dec_in_packed = jnp.where(tpos == 0, 0, jnp.pad(tp[:, :-1], ((0, 0), (1, 0))))
    unpacked_t = _unpack(tgt, L)
    if arch == "t5":
        ip, iseg, ipos = _pack(inp, L)
        packed = {
            "encoder_input_tokens": ip,
            "decoder_input_tokens": dec_in_packed,
            "decoder_target_tokens": tp,
            "encoder_segment_ids": iseg,
            "decoder_segment_ids": ts,
            "encoder_positions": ipos,
            "decoder_positions": tpos,
        }
        unpacked = {
            "encoder_input_tokens": _unpack(inp, L),
            "decoder_input_tokens": _shift_right(unpacked_t),
            "decoder_target_tokens": unpacked_t,
        }
    else:
        packed = {
            "decoder_input_tokens": dec_in_packed,
            "decoder_target_tokens": tp,
            "decoder_segment_ids": ts,
            "decoder_positions": tpos,
        }
        unpacked = {
            "decoder_input_tokens": _shift_right(unpacked_t),
            "decoder_target_tokens": unpacked_t,
        }
    packed_loss = _per_token_loss(cfg, params, packed)[0]
    packed_per_ex = _per_example(packed_loss, ts[0], 3)
    unpacked_per_ex = [float(x) for x in jnp.sum(_per_token_loss(cfg, params, unpacked), -1)]
    np.testing.assert_allclose(packed_per_ex, unpacked_per_ex, atol=1e-5, rtol=0)
    assert min(unpacked_per_ex) > 1.0  # non-trivial losses


# --- causality ------------------------------------------------------------------------------


def _input_jacobian_norms(cfg, batch, t, **kwargs):
    """|d logits[:, t] / d embedded_inputs[:, s]| for every s, via the 'perturbations' hook."""
    model = _model(cfg)
    variables = meta.unbox(_init(cfg, batch))
    # Under jit: an eager apply compiles every op of the forward pass as its own program.
    _, state = jax.jit(
        functools.partial(model.apply, enable_dropout=False, mutable=["perturbations"])
    )(variables, **batch, **kwargs)

    def out_t(perturbations):
        logits = model.apply(
            {**variables, **perturbations}, **batch, **kwargs, enable_dropout=False
        )
        return jnp.sum(logits[:, t] * jnp.arange(logits.shape[-1]))

    g = jax.jit(jax.grad(out_t))(state)["perturbations"]["decoder"]["embedded_inputs"]
    return np.asarray(jnp.sum(jnp.abs(g), axis=(0, 2)))


@pytest.mark.parametrize("arch", ["t5", "lm", "lm_relative"])
def test_causality(arch):
    if arch == "t5":
        cfg, batch = T5_TINY, _t5_batch(b=2)
    else:
        cfg = (
            LM_TINY if arch == "lm" else dataclasses.replace(LM_TINY, position_embedding="relative")
        )
        batch = _lm_batch(b=2)
    batch["decoder_target_tokens"] = jnp.maximum(batch["decoder_target_tokens"], 1)  # no padding
    t = 4
    norms = _input_jacobian_norms(cfg, batch, t)
    assert np.all(norms[t + 1 :] == 0.0), norms
    assert np.all(norms[: t + 1] > 0.0), norms


def test_prefix_lm_attends_bidirectionally_over_inputs():
    batch = _lm_batch(b=2)
    batch["decoder_target_tokens"] = jnp.maximum(batch["decoder_target_tokens"], 1)
    causal_attention = jnp.array([[1, 1, 1, 1, 0, 0, 0, 0]] * 2, jnp.int32)
    norms = _input_jacobian_norms(LM_TINY, batch, 1, decoder_causal_attention=causal_attention)
    # Position 1 sees the whole prefix (0..3) and nothing after it.
    assert np.all(norms[:4] > 0.0) and np.all(norms[4:] == 0.0), norms
    norms = _input_jacobian_norms(LM_TINY, batch, 5, decoder_causal_attention=causal_attention)
    assert np.all(norms[:6] > 0.0) and np.all(norms[6:] == 0.0), norms


# --- scan and remat ---------------------------------------------------------------------------


@pytest.mark.parametrize("arch", ["t5", "lm"])
def test_scanned_equals_unscanned_with_converted_weights(arch):
    cfg = T5_TINY if arch == "t5" else LM_TINY
    batch = _t5_batch(b=2) if arch == "t5" else _lm_batch(b=2)
    scfg = dataclasses.replace(cfg, scan_layers=True)
    params = meta.unbox(_init(cfg, batch))["params"]
    scanned = network.scan_params(params)
    # The converted tree is exactly the tree a scanned network initializes.
    want = jax.eval_shape(lambda: meta.unbox(_init(scfg, batch))["params"])
    assert jax.tree.structure(scanned) == jax.tree.structure(want)
    assert jax.tree.map(lambda x: x.shape, scanned) == jax.tree.map(lambda x: x.shape, want)
    apply = lambda c, p: jax.jit(functools.partial(_model(c).apply, enable_dropout=False))(
        {"params": p}, **batch
    )
    out, out_s = apply(cfg, params), apply(scfg, scanned)
    np.testing.assert_allclose(out_s, out, atol=1e-5, rtol=0)
    back = network.unscan_params(scanned)
    assert jax.tree.all(jax.tree.map(lambda a, b: np.array_equal(a, b), back, params))
    # And the scanned tree is annotated with the 'layers' axis first.
    axes = partitioning.logical_axes_of(_init(scfg, batch))["params"]
    assert axes["decoder"]["layers"]["mlp"]["wo"]["kernel"] == P("layers", "mlp", "embed")


@pytest.mark.parametrize("policy", ["minimal", "full"])
def test_remat_does_not_change_gradients(policy):
    batch = _lm_batch(b=2)
    base = dataclasses.replace(LM_TINY, scan_layers=True)
    params = meta.unbox(_init(base, batch))["params"]
    ref = jax.jit(jax.grad(functools.partial(_mean_loss, base)))(params, batch)
    cfg = dataclasses.replace(base, remat_policy=policy)
    got = jax.jit(jax.grad(functools.partial(_mean_loss, cfg)))(params, batch)
    diffs = jax.tree.map(_max_abs_diff, got, ref)
    assert max(jax.tree.leaves(diffs)) <= 1e-6


def test_dropout_is_active_only_when_enabled():
    cfg = dataclasses.replace(LM_TINY, dropout_rate=0.5)
    batch = _lm_batch(b=2)
    variables = meta.unbox(_init(cfg, batch))
    model = _model(cfg)
    apply = jax.jit(model.apply, static_argnames="enable_dropout")
    a = apply(variables, **batch, enable_dropout=False)
    b = apply(variables, **batch, enable_dropout=False)
    c = apply(variables, **batch, rngs={"dropout": jax.random.PRNGKey(1)})
    np.testing.assert_array_equal(a, b)
    assert _max_abs_diff(a, c) > 1e-3


def test_rope_scaling_config_is_validated_with_one_line():
    with pytest.raises(ValueError, match=r"rope_scaling must be one of .* got 'dynamic'"):
        network.DecoderOnlyConfig(rope_scaling="dynamic")
    with pytest.raises(ValueError, match=r"rope_high_freq_factor \(1.0\) must exceed"):
        network.DecoderOnlyConfig(rope_scaling="llama3", rope_high_freq_factor=1.0)
    with pytest.raises(ValueError, match="scale_logits=True needs tied logits"):
        network.T5Config(tie_logits=False, scale_logits=True)
