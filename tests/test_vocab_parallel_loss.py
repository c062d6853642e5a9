"""Vocab-parallel cross-entropy: exact numbers, and no all-gather of [B, L, V] under Megatron."""

from __future__ import annotations

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from conftest import require_devices
from flax.core import meta
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from t5lite import partitioning
from t5lite.model import network
from t5lite.model.losses import cross_entropy_with_logits

VOCAB = 200  # a size no other dimension of the test program has


def test_matches_reference_and_z_loss():
    k1, k2 = jax.random.split(jax.random.PRNGKey(0))
    logits = 30.0 * jax.random.normal(k1, (2, 5, VOCAB))  # large: exercises the max shift
    targets = jax.random.randint(k2, (2, 5), 0, VOCAB)
    loss, z = cross_entropy_with_logits(logits, targets, z_loss=1e-4)
    lse = jax.nn.logsumexp(logits, axis=-1)
    ref = optax.softmax_cross_entropy_with_integer_labels(logits, targets)
    np.testing.assert_allclose(z, 1e-4 * lse**2, rtol=1e-6)
    np.testing.assert_allclose(loss, ref + 1e-4 * lse**2, rtol=1e-6, atol=1e-5)
    assert loss.dtype == z.dtype == jnp.float32
    # Gradient: softmax - one_hot (+ z-loss term), per token.
    g = jax.grad(lambda x: jnp.sum(cross_entropy_with_logits(x, targets)[0]))(logits)
    want = jax.nn.softmax(logits) - jax.nn.one_hot(targets, VOCAB)
    np.testing.assert_allclose(g, want, atol=1e-6)
    # bf16 logits are upcast before the reductions.
    lb, _ = cross_entropy_with_logits(logits.astype(jnp.bfloat16), targets)
    assert lb.dtype == jnp.float32


_GATHER_RE = re.compile(r"=\s*(?P<shape>.+?)\s+all-gather(?:-start)?\(")
_DIMS_RE = re.compile(r"\[([\d,]*)\]")


def _all_gather_shapes(hlo: str) -> list[tuple[int, ...]]:
    shapes = []
    for m in _GATHER_RE.finditer(hlo):
        for dims in _DIMS_RE.findall(m.group("shape")):
            shapes.append(tuple(int(d) for d in dims.split(",") if d))
    return shapes


def _megatron_2x4():
    mesh = Mesh(np.array(jax.devices()[:8]).reshape(2, 4), ("data", "model"))
    rules = partitioning.standard_logical_axis_rules(1, 1)
    return mesh, partitioning.Partitioner(mesh=mesh, logical_axis_rules=rules)


def test_loss_alone_has_no_vocab_all_gather():
    require_devices(8)
    mesh, part = _megatron_2x4()
    logits_sh = NamedSharding(mesh, P("data", None, "model"))
    tgt_sh = NamedSharding(mesh, P("data"))

    def loss_and_grad(logits, targets):
        return jax.value_and_grad(lambda x: jnp.mean(cross_entropy_with_logits(x, targets)[0]))(
            logits
        )

    fn = part.partition(loss_and_grad, (logits_sh, tgt_sh), (None, logits_sh))
    args = (
        jax.ShapeDtypeStruct((8, 16, VOCAB), jnp.float32),
        jax.ShapeDtypeStruct((8, 16), jnp.int32),
    )
    hlo = fn.lower(*args).compile().as_text()
    assert _all_gather_shapes(hlo) == []
    # The reductions over V become all-reduces of [B/2, L] (max, sum-exp, target logit).
    assert len(re.findall(r"all-reduce(?:-start)?\(", hlo)) >= 2


@pytest.mark.parametrize("one_hot", [False, True])
def test_full_model_megatron_has_no_vocab_all_gather(one_hot):
    """Loss-and-grad of a decoder-only LM under 1/1 rules on a 2x4 mesh: nothing gathers V."""
    require_devices(8)
    cfg = network.DecoderOnlyConfig(
        vocab_size=VOCAB, emb_dim=16, num_heads=4, head_dim=4, mlp_dim=32, num_layers=2,
        logits_via_embedding=False, one_hot_embedding=one_hot,
    )  # fmt: skip
    model = network.DecoderOnly(cfg)
    tokens = jnp.ones((8, 12), jnp.int32)
    mesh, part = _megatron_2x4()
    boxed = jax.eval_shape(
        functools.partial(model.init, enable_dropout=False), jax.random.PRNGKey(0), tokens
    )
    axes = partitioning.logical_axes_of(boxed)["params"]
    abstract = meta.unbox(boxed)["params"]
    param_sh = part.shardings(abstract, axes)
    assert param_sh["decoder"]["logits_dense"]["kernel"].spec == P(None, "model")
    assert param_sh["token_embedder"]["embedding"].spec == P("model", None)

    def loss_fn(params, inputs, targets):
        logits = model.apply({"params": params}, inputs, targets, enable_dropout=False)
        return jnp.mean(cross_entropy_with_logits(logits, targets)[0])

    tok_sh = NamedSharding(mesh, P("data"))
    fn = part.partition(jax.value_and_grad(loss_fn), (param_sh, tok_sh, tok_sh), (None, param_sh))
    hlo = fn.lower(abstract, tokens, tokens).compile().as_text()
    with_vocab = [s for s in _all_gather_shapes(hlo) if VOCAB in s or VOCAB // 4 in s]
    assert with_vocab == []
