"""Loss normalisations, t5x's included: a constant factor and NUM_TOTAL_TARGET_TOKENS.

Values are checked against numpy; with microbatches, against the gradient of the big batch's
loss written out directly.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import require_devices, reverse_batch
from tiny_networks import TINY_T5

from t5lite import partitioning
from t5lite.model import losses, optimizers
from t5lite.model.models import EncoderDecoderModel
from t5lite.trainer import Trainer

B, L, V = 4, 6, 11


def _inputs(seed=0):
    rng = np.random.default_rng(seed)
    logits = rng.normal(size=(B, L, V)).astype(np.float32)
    targets = rng.integers(1, V, size=(B, L)).astype(np.int32)
    targets[:, -2:] = 0
    targets[1, 2:] = 0
    return logits, targets


def _np_token_losses(logits, targets):
    m = logits.max(-1, keepdims=True)
    logz = np.log(np.exp(logits - m).sum(-1)) + m[..., 0]
    picked = np.take_along_axis(logits, targets[..., None], -1)[..., 0]
    return (logz - picked) * (targets > 0)


@pytest.mark.parametrize(
    "normalization, divisor",
    [
        ("sum", lambda t: 1.0),
        (None, lambda t: 1.0),  # t5x's loss_normalizing_factor=None
        ("per_real_token", lambda t: float((t > 0).sum())),
        ("NUM_REAL_TARGET_TOKENS", lambda t: float((t > 0).sum())),
        ("per_total_token", lambda t: float(t.size)),
        ("NUM_TOTAL_TARGET_TOKENS", lambda t: float(t.size)),
        (233472, lambda t: 233472.0),  # T5.1.1 fine-tuning: 2048 x 114
        (7.5, lambda t: 7.5),
    ],
)
def test_normalized_loss_matches_numpy(normalization, divisor):
    logits, targets = _inputs()
    loss, metrics = losses.weighted_cross_entropy(
        jnp.asarray(logits), jnp.asarray(targets), z_loss=0.0, normalization=normalization
    )
    want = _np_token_losses(logits, targets).sum() / divisor(targets)
    np.testing.assert_allclose(float(loss), want, rtol=1e-5)
    # The readable metrics do not depend on the normalisation.
    np.testing.assert_allclose(float(metrics["loss_sum"]), _np_token_losses(logits, targets).sum(),
                               rtol=1e-5)  # fmt: skip


def test_canonical_names_and_errors():
    canon = losses.canonical_normalization
    assert canon("AVERAGE_PER_SEQUENCE") == "per_sequence"
    assert canon(233472) == 233472.0 and isinstance(canon(233472), float)

    class Special:  # stands in for a t5x `SpecialLossNormalizingFactor` member
        name = "NUM_TOTAL_TARGET_TOKENS"

    assert canon(Special()) == "per_total_token"
    for bad in ("per_token", 0, -1.0, True):
        with pytest.raises(ValueError, match="loss normalization must be one of"):
            canon(bad)
    model = EncoderDecoderModel(loss_normalization="NUM_TOTAL_TARGET_TOKENS")
    assert model.loss_normalization == "per_total_token"
    assert EncoderDecoderModel(loss_normalization=233472).loss_normalization == 233472.0
    with pytest.raises(ValueError, match="loss normalization"):
        EncoderDecoderModel(loss_normalization="mean")


@pytest.mark.parametrize("normalization", ["per_total_token", 233472.0])
@pytest.mark.parametrize("k", [1, 4])
def test_microbatched_gradients_normalise_over_the_whole_batch(normalization, k):
    """k microbatches give the gradient of sum(token losses) / divisor of the whole batch."""
    require_devices(8)
    model = EncoderDecoderModel(
        TINY_T5, optimizer=optimizers.AdamW(1e-2), loss_normalization=normalization
    )
    tr = Trainer(model, partitioning.Partitioner(num_partitions=2), batch_size=16,
                 lengths={"inputs": 8, "targets": 8}, num_microbatches=k)  # fmt: skip
    batch = reverse_batch(16, seed=3, ragged=True)
    state = tr.init_state()
    grads, metrics = jax.jit(tr._grads)(state.params, tr.global_batch(batch), jax.random.PRNGKey(0))
    divisor = 16 * 8 if normalization == "per_total_token" else normalization
    if normalization == "per_total_token":
        assert float(metrics["loss_denominator"]) == divisor

    plain = dataclasses.replace(model, loss_normalization="sum")
    params = jax.device_get(state.params)

    def reference(p):
        num, _ = plain.loss_terms(p, {n: jnp.asarray(x) for n, x in batch.items()}, None)
        return num / divisor

    # Jitted: run op by op, the reference's forward and backward pass compiled ~120 one-op
    # programs (cold, more than this test's own train step); fusion moves at most last bits.
    want = jax.jit(jax.grad(reference))(params)
    for a, b in zip(jax.tree_util.tree_leaves(grads), jax.tree_util.tree_leaves(want)):
        np.testing.assert_allclose(a, b, atol=1e-6 * max(1.0, float(np.max(np.abs(b)))))
