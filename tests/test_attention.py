"""The attention core's implementations: numbers, refusals, and where each one is reached.

`cudnn` is `attention.fused_attention(..., implementation='cudnn')`; that same call with
`implementation=None` / `'xla'` (JAX's own einsum path, which runs on CPU) is compared here with
t5lite's `xla` implementation, forward and gradients, on the masks and head layouts `cudnn`
claims. Tolerance: fp32 with the suite's 'highest' matmul precision, atol 2e-6 (outputs and
gradients of unit-scale inputs; the two paths sum in different orders).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import require_devices
from flax import linen as nn

from t5lite import collectives, context_parallel
from t5lite.model import attention, layers, network
from t5lite.model.masks import MaskParts
from t5lite.partitioning import create_mesh, preset_rules

B, L, H, G, K = 2, 6, 6, 2, 8  # batch, length, heads, kv heads (R = 3), head width
ATOL = 2e-6


def _qkv(h=H, g=G, dtype=jnp.float32):
    ks = jax.random.split(jax.random.PRNGKey(0), 3)
    q = jax.random.normal(ks[0], (B, L, h, K), dtype)
    k = jax.random.normal(ks[1], (B, L, g, K), dtype)
    v = jax.random.normal(ks[2], (B, L, g, K), dtype)
    return q, k, v


def _masks():
    causal = layers.make_causal_mask(B, L)
    tokens = jnp.array([[5, 6, 7, 8, 0, 0], [5, 6, 7, 8, 9, 4]])
    valid = tokens > 0
    padding = layers.make_attention_mask(valid, valid)
    segments = jnp.array([[1, 1, 1, 2, 2, 0], [1, 1, 2, 2, 2, 2]])
    packed = layers.make_attention_mask(segments, segments, jnp.equal)
    return {
        "causal": causal,
        "padding": padding,
        "causal+padding": jnp.logical_and(causal, padding),
        "causal+segments": jnp.logical_and(causal, packed),
        "none": None,
    }


@pytest.mark.parametrize("mask_name", list(_masks()))
@pytest.mark.parametrize("heads", [(H, G), (H, H), (H, 1)], ids=["gqa", "mha", "mqa"])
@pytest.mark.parametrize("implementation", [None, "xla"])
def test_fused_call_equals_the_einsum_path(mask_name, heads, implementation):
    q, k, v = _qkv(*heads)
    mask = _masks()[mask_name]

    def ours(q, k, v):
        return attention.dot_product_attention(q, k, v, None, mask, implementation="xla")

    def fused(q, k, v):
        return attention.fused_attention(q, k, v, None, mask, implementation=implementation)

    np.testing.assert_allclose(fused(q, k, v), ours(q, k, v), atol=ATOL, rtol=0)
    cotangent = jax.random.normal(jax.random.PRNGKey(1), q.shape)

    def grads(f):
        return jax.grad(lambda *a: jnp.sum(f(*a) * cotangent), argnums=(0, 1, 2))(q, k, v)

    for got, want in zip(grads(fused), grads(ours)):
        np.testing.assert_allclose(got, want, atol=ATOL, rtol=0)


def test_fused_call_equals_the_einsum_path_with_a_bias():
    # The fused call takes T5's bias too (JAX's path); `cudnn` refuses it (see below).
    q, k, v = _qkv(H, H)
    bias = jax.random.normal(jax.random.PRNGKey(2), (1, H, L, L))
    mask = _masks()["padding"]
    want = attention.dot_product_attention(q, k, v, bias, mask)
    got = attention.fused_attention(q, k, v, bias, mask, implementation="xla")
    np.testing.assert_allclose(got, want, atol=ATOL, rtol=0)


def test_xla_is_the_default_and_auto_is_xla_on_cpu():
    q, k, v = _qkv(dtype=jnp.bfloat16)
    mask = _masks()["causal"]
    default = attention.dot_product_attention(q, k, v, None, mask, dtype=jnp.bfloat16)
    auto = attention.dot_product_attention(
        q, k, v, None, mask, implementation="auto", dtype=jnp.bfloat16
    )
    np.testing.assert_array_equal(np.asarray(auto, np.float32), np.asarray(default, np.float32))
    features = attention.Features(dtype=jnp.dtype(jnp.bfloat16), head_dim=K, lengths=(L, L))
    assert attention.resolve("auto", features) == "xla"  # no CUDA GPU here
    assert attention.resolve("cudnn", features) == "cudnn"


BF16 = "params=bfloat16,compute=bfloat16,output=float32"
SETTING = "DecoderOnlyConfig.attention_implementation"


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (
            {"attention_implementation": "flash"},
            f"{SETTING}='flash' is not one of xla, cudnn, chunked, splash, auto",
        ),
        (
            {"attention_implementation": "cudnn"},
            f"{SETTING}='cudnn' needs bfloat16 or float16 inputs (the compute dtype), got "
            "float32; use 'xla'",
        ),
        (
            {"attention_implementation": "cudnn", "precision": BF16, "dropout_rate": 0.1},
            f"{SETTING}='cudnn' cannot apply attention dropout (dropout_rate > 0 in training); "
            "use 'xla'",
        ),
        (
            {"attention_implementation": "cudnn", "precision": BF16, "head_dim": 12},
            f"{SETTING}='cudnn' needs a head_dim that is a multiple of 8 and at most 256, got "
            "12; use 'xla'",
        ),
        (
            {
                "attention_implementation": "cudnn",
                "precision": BF16,
                "position_embedding": "relative",
            },
            f"{SETTING}='cudnn' cannot take an additive attention bias (T5's relative position "
            "bias); use 'xla'",
        ),
    ],
)
def test_decoder_only_config_refusals(kwargs, message):
    with pytest.raises(ValueError) as e:
        network.DecoderOnlyConfig(**kwargs)
    assert str(e.value) == message


def test_t5_config_refuses_cudnn_and_takes_the_others():
    with pytest.raises(ValueError) as e:
        network.T5Config(attention_implementation="cudnn", precision=BF16)
    assert str(e.value) == (
        "T5Config.attention_implementation='cudnn' cannot take an additive attention bias "
        "(T5's relative position bias); use 'xla'"
    )
    with pytest.raises(ValueError) as e:
        network.T5Config(attention_implementation="XLA")
    assert str(e.value) == (
        "T5Config.attention_implementation='XLA' is not one of xla, cudnn, chunked, splash, auto"
    )
    assert network.T5Config(attention_implementation="auto").attention_implementation == "auto"
    cfg = network.DecoderOnlyConfig(attention_implementation="cudnn", precision=BF16)
    assert cfg.attention_implementation == "cudnn"


def test_call_refusals():
    q, k, v = _qkv(dtype=jnp.bfloat16)
    odd = layers.make_causal_mask(B, L - 1)
    with pytest.raises(ValueError) as e:
        attention.dot_product_attention(
            q[:, 1:], k[:, 1:], v[:, 1:], None, odd, implementation="cudnn"
        )
    assert str(e.value) == (
        "attention_implementation='cudnn' cannot take a mask over an odd query or key length "
        "(L=5, S=5); use 'xla'"
    )
    with pytest.raises(ValueError) as e:
        attention.dot_product_attention(q, k, v, implementation="flash")
    assert str(e.value) == (
        "attention_implementation='flash' is not one of xla, cudnn, chunked, splash, auto"
    )
    with pytest.raises(ValueError) as e:
        attention.dot_product_attention(
            q,
            k,
            v,
            dropout_rate=0.1,
            dropout_rng=jax.random.PRNGKey(0),
            deterministic=False,
            implementation="cudnn",
        )
    assert str(e.value) == (
        "attention_implementation='cudnn' cannot apply attention dropout (dropout_rate > 0 in "
        "training); use 'xla'"
    )


def test_a_whole_mask_refusal_names_decoding_and_context_parallelism():
    """A kernel that needs the mask by its parts is handed a whole one by the KV cache's decode
    steps and by context parallelism's per-device attention: the line names both."""
    q, k, v = _qkv()
    whole = layers.make_causal_mask(B, L)
    with pytest.raises(ValueError) as e:
        attention.dot_product_attention(q, k, v, None, whole, implementation="chunked")
    assert str(e.value) == (
        "attention_implementation='chunked' needs the mask by its parts, but got a whole one, "
        "as the KV cache's decode steps and context parallelism (attention inside its shard_map) "
        "give (chunked is for training, scoring and prefill without context parallelism); use "
        "'xla'"
    )


@pytest.fixture
def cudnn_runs_as_jax_xla(monkeypatch):
    """`jax.nn.dot_product_attention` records each call's implementation and shapes, then runs
    JAX's einsum path: `cudnn`'s code runs on CPU up to the kernel."""
    calls = []
    real = jax.nn.dot_product_attention

    def recording(q, k, v, bias=None, mask=None, *, implementation=None, **kw):
        calls.append((implementation, q.shape, k.shape))
        return real(q, k, v, bias, mask, implementation="xla", **kw)

    monkeypatch.setattr(jax.nn, "dot_product_attention", recording)
    return calls


LM = dict(
    vocab_size=32,
    emb_dim=16,
    num_heads=4,
    num_kv_heads=2,
    num_layers=2,
    head_dim=8,
    mlp_dim=32,
    precision=BF16,
)


def _lm_logits_and_grads(cfg, decoder_segment_ids=None):
    model = network.DecoderOnly(cfg)
    tokens = jnp.array([[3, 4, 5, 6, 7, 0], [3, 4, 5, 6, 7, 8]])
    params = model.init(jax.random.PRNGKey(0), tokens, enable_dropout=False)["params"]

    def loss(p):
        logits = model.apply(
            {"params": p}, tokens, tokens, decoder_segment_ids, enable_dropout=False
        )
        return jnp.mean(logits.astype(jnp.float32) ** 2), logits

    (_, logits), grads = jax.value_and_grad(loss, has_aux=True)(params)
    return logits, grads


def test_cudnn_is_reached_from_the_config(cudnn_runs_as_jax_xla):
    # Through the network, `cudnn` computes what `xla` does (bf16: atol 2e-2 on unit logits).
    xla = network.DecoderOnlyConfig(**LM)
    cudnn = network.DecoderOnlyConfig(**LM, attention_implementation="cudnn")
    segments = jnp.array([[1, 1, 1, 2, 2, 0], [1, 1, 1, 1, 1, 1]])
    want, want_grads = _lm_logits_and_grads(xla, segments)
    assert cudnn_runs_as_jax_xla == []
    got, got_grads = _lm_logits_and_grads(cudnn, segments)
    # One per layer in `init` and one per layer in the differentiated `apply`.
    assert [c[0] for c in cudnn_runs_as_jax_xla] == ["cudnn"] * 4
    np.testing.assert_allclose(np.float32(got), np.float32(want), atol=2e-2)
    for g, w in zip(jax.tree.leaves(got_grads), jax.tree.leaves(want_grads)):
        np.testing.assert_allclose(np.float32(nn.meta.unbox(g)), np.float32(w), atol=2e-2)


def test_decoding_with_the_kv_cache_runs_xla(cudnn_runs_as_jax_xla):
    cfg = network.DecoderOnlyConfig(**LM, attention_implementation="cudnn")
    model = network.DecoderOnly(cfg)
    tokens = jnp.array([[3, 4, 5, 6, 7, 8]])
    params = model.init(jax.random.PRNGKey(0), tokens, enable_dropout=False)["params"]
    assert len(cudnn_runs_as_jax_xla) == 2  # teacher forcing: cudnn, one per layer
    cudnn_runs_as_jax_xla.clear()
    cache = model.init(
        jax.random.PRNGKey(0), tokens, decode=True, max_decode_length=L, enable_dropout=False
    )["cache"]
    step, _ = model.apply(
        {"params": params, "cache": cache},
        tokens[:, :1],
        decode=True,
        max_decode_length=L,
        enable_dropout=False,
        mutable=["cache"],
    )
    assert step.shape == (1, 1, 32)
    assert cudnn_runs_as_jax_xla == []  # creating the cache and a step: xla


def test_context_parallel_attention_goes_through_the_seam(cudnn_runs_as_jax_xla):
    require_devices(8)
    mesh = create_mesh(4)  # data=2 x model=4; context parallelism splits `length` over model
    mha = layers.MultiHeadAttention(
        num_heads=4,
        num_kv_heads=2,
        head_dim=8,
        dtype=jnp.bfloat16,
        attention_implementation="cudnn",
        scale_logits=True,
    )
    x = jax.random.normal(jax.random.PRNGKey(0), (2, 8, 16), jnp.bfloat16)
    mask = layers.make_causal_mask(2, 8)
    params = mha.init(jax.random.PRNGKey(0), x, x, mask)
    want = mha.apply(params, x, x, mask)
    with jax.set_mesh(mesh), nn.logical_axis_rules(preset_rules("context_parallel")):
        q = jnp.zeros((2, 8, 4, 8), jnp.bfloat16)
        choice = context_parallel.select_attention_strategy(q, q[:, :, :2], None, mask, "kv_heads")
        assert choice.strategy is collectives.Strategy.CONTEXT_PARALLEL
        got = jax.jit(lambda p, x, m: mha.apply(p, x, x, m))(params, x, mask)
    # Each device attends its 2 of 8 query positions (1 of 2 batch rows) to all 8 keys.
    assert cudnn_runs_as_jax_xla[-1] == ("cudnn", (1, 2, 4, 8), (1, 8, 2, 8))
    np.testing.assert_allclose(np.float32(got), np.float32(want), atol=2e-2)


def test_cudnn_gets_a_causal_mask_as_is_causal_and_the_rest_as_a_mask(monkeypatch):
    calls = []
    real = jax.nn.dot_product_attention

    def recording(q, k, v, bias=None, mask=None, *, implementation=None, is_causal=False, **kw):
        lengths = kw.get("key_value_seq_lengths")
        lengths = None if lengths is None else np.asarray(lengths).tolist()
        calls.append((is_causal, None if mask is None else mask.shape, lengths))
        return real(q, k, v, bias, mask, implementation="xla", is_causal=is_causal, **kw)

    monkeypatch.setattr(jax.nn, "dot_product_attention", recording)
    q, k, v = _qkv(dtype=jnp.bfloat16)
    valid = jnp.arange(L)[None].repeat(B, 0) < jnp.array([[L], [L - 2]])
    parts = {
        "causal": MaskParts(causal=True),
        "causal + padding": MaskParts(valid, valid, causal=True),
        "prefix-LM": MaskParts(prefix_q=valid, prefix_kv=valid, causal=True),
    }
    for name, mask in parts.items():
        want = attention.dot_product_attention(q, k, v, None, mask.dense(L, L), dtype=jnp.bfloat16)
        got = attention.dot_product_attention(
            q, k, v, None, mask, implementation="cudnn", dtype=jnp.bfloat16
        )
        # Padding queries (no key to attend to) are read by no loss: left out.
        live = np.asarray(mask.dense(L, L).any(-1))[:, 0, :, None, None]
        np.testing.assert_allclose(
            np.float32(got) * live, np.float32(want) * live, atol=1e-2, err_msg=name
        )
    # A plain causal mask is cuDNN's own (no mask array), padding is each row's length (a mask
    # array is a bias cuDNN reads in every block), a prefix is a per-row mask.
    assert calls == [(True, None, None), (True, None, [L, L - 2]), (False, (B, 1, L, L), None)]


def test_chunked_through_the_networks_equals_xla():
    """Both families, every mask the networks build (padding, packing, causal, prefix-LM, T5's
    relative bias and cross-attention): logits and gradients in fp32."""
    lm = dict(LM, precision="float32")
    tokens = jnp.array([[3, 4, 5, 6, 7, 0], [3, 4, 5, 6, 7, 8]])
    segments = jnp.array([[1, 1, 1, 2, 2, 0], [1, 1, 1, 1, 1, 1]])
    prefix = jnp.array([[1, 1, 0, 0, 0, 0], [1, 1, 1, 0, 0, 0]])

    def lm_apply(cfg):
        model = network.DecoderOnly(cfg)
        params = model.init(jax.random.PRNGKey(0), tokens, enable_dropout=False)["params"]

        def loss(p):
            logits = model.apply(
                {"params": p}, tokens, tokens, segments, None, prefix, enable_dropout=False
            )
            return jnp.mean(logits**2), logits

        return jax.value_and_grad(loss, has_aux=True)(params)

    t5 = dict(
        vocab_size=32,
        emb_dim=16,
        num_heads=4,
        head_dim=8,
        mlp_dim=32,
        num_encoder_layers=2,
        num_decoder_layers=2,
    )

    def t5_apply(cfg):
        model = network.EncoderDecoder(cfg)
        inputs = jnp.array([[5, 6, 7, 8, 0, 0], [5, 6, 7, 8, 9, 10]])
        args = (inputs, tokens, tokens)
        params = model.init(jax.random.PRNGKey(0), *args, enable_dropout=False)["params"]

        def loss(p):
            logits = model.apply({"params": p}, *args, enable_dropout=False)
            return jnp.mean(logits**2), logits

        return jax.value_and_grad(loss, has_aux=True)(params)

    for name, run, base in (
        ("lm", lm_apply, network.DecoderOnlyConfig(**lm)),
        ("t5", t5_apply, network.T5Config(**t5)),
    ):
        (_, want), want_grads = run(base)
        (_, got), got_grads = run(dataclasses.replace(base, attention_implementation="chunked"))
        np.testing.assert_allclose(got, want, atol=1e-5, err_msg=name)
        for g, w in zip(jax.tree.leaves(got_grads), jax.tree.leaves(want_grads)):
            np.testing.assert_allclose(
                nn.meta.unbox(g), nn.meta.unbox(w), atol=1e-5, rtol=1e-4, err_msg=name
            )


@pytest.mark.skipif(not attention.IMPLEMENTATIONS["cudnn"].runs_here(), reason="no CUDA GPU")
@pytest.mark.parametrize(
    "mask_name", ["causal", "causal+padding", "causal+segments", "none", "parts: causal+padding"]
)
def test_cudnn_on_a_gpu_equals_xla(mask_name):
    # bf16 inputs, L = S = 128, K = 64, GQA 8/2; tolerance 2e-2 of each array's largest value.
    b, length, h, g, kd = 2, 128, 8, 2, 64
    ks = jax.random.split(jax.random.PRNGKey(0), 4)
    q = jax.random.normal(ks[0], (b, length, h, kd), jnp.bfloat16)
    k = jax.random.normal(ks[1], (b, length, g, kd), jnp.bfloat16)
    v = jax.random.normal(ks[2], (b, length, g, kd), jnp.bfloat16)
    causal = layers.make_causal_mask(b, length)
    valid = jnp.arange(length)[None] < jnp.array([[100], [128]])
    segments = jnp.where(jnp.arange(length)[None] < 60, 1, 2) * valid
    masks = {
        "causal": causal,
        "causal+padding": jnp.logical_and(causal, layers.make_attention_mask(valid, valid)),
        "causal+segments": jnp.logical_and(
            causal, layers.make_attention_mask(segments, segments, jnp.equal)
        ),
        "none": None,
        # As the networks pass it: cuDNN gets the padding as each row's length.
        "parts: causal+padding": MaskParts(valid, valid, causal=True),
    }
    mask = masks[mask_name]
    # A query with no key to attend to (padding) is read by no loss: its output and gradient
    # are compared as the loss sees them (zero cotangent there, output rows left out).
    dense = mask.dense(length, length) if isinstance(mask, MaskParts) else mask
    live_BL = jnp.ones((b, length), bool) if dense is None else dense.any(-1)[:, 0]
    cotangent = jax.random.normal(ks[3], q.shape, jnp.float32) * live_BL[:, :, None, None]

    def run(implementation):
        def f(q, k, v):
            out = attention.dot_product_attention(
                q, k, v, None, mask, implementation=implementation, dtype=jnp.bfloat16
            )
            return jnp.sum(out.astype(jnp.float32) * cotangent), out

        (_, out), grads = jax.jit(jax.value_and_grad(f, argnums=(0, 1, 2), has_aux=True))(q, k, v)
        out = jnp.where(live_BL[:, :, None, None], out, 0)
        return [np.float32(x) for x in (out, *grads)]

    for got, want in zip(run("cudnn"), run("xla")):
        np.testing.assert_allclose(got, want, atol=2e-2 * np.abs(want).max(), rtol=0)
