"""Model wrappers around the networks: loss, eval metrics, scoring and prediction (t5x BaseModel).

A model owns a network, an optimizer definition and the loss settings. Everything here is a pure
function of (params, batch), so the trainer can partition it; nothing here names a mesh axis.
"""

from __future__ import annotations

import abc
import dataclasses
from collections.abc import Mapping
from typing import Any, ClassVar

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from t5lite import losses, network
from t5lite.optimizers import AdamW, Optimizer

Array = jax.Array
Batch = Mapping[str, Array]
PyTree = Any

# Logical axes of every model feature (all are [batch, length]).
FEATURE_AXES = ("batch", "length")


@dataclasses.dataclass(frozen=True)
class BaseModel(abc.ABC):
    """Shared loss/metric logic. Subclasses say how a batch is fed to their network."""

    network_config: Any
    optimizer: Optimizer = AdamW()  # noqa: RUF009 (frozen: safe to share)
    z_loss: float = 1e-4  # T5.1.1's auxiliary z-loss coefficient
    label_smoothing: float = 0.0
    loss_normalization: str = "per_real_token"  # "sum" | "per_real_token" | "per_sequence"

    # --- to be provided by subclasses -----------------------------------------------------
    FEATURES: ClassVar[tuple[str, ...]] = ()

    @abc.abstractmethod
    def module(self) -> nn.Module:
        """The Flax network."""

    @abc.abstractmethod
    def _logits(self, params: PyTree, batch: Batch, dropout_rng: Array | None) -> Array:
        """Teacher-forced fp32 logits [B, L, V]; dropout on when `dropout_rng` is given."""

    # --- shared -----------------------------------------------------------------------------

    def dummy_batch(self, batch_size: int, lengths: Mapping[str, int]) -> dict[str, np.ndarray]:
        """Zero features of the right shapes, e.g. for initialisation and AOT compilation."""
        return {
            k: np.zeros((batch_size, lengths[k.split("_")[0]]), np.int32) for k in self.FEATURES
        }

    def init(self, rng: Array, batch: Batch) -> PyTree:
        """Flax variables (boxed with logical axes) for batches shaped like `batch`."""
        return self.module().init(
            {"params": rng, "dropout": rng}, **self._inputs(batch), enable_dropout=False
        )

    def _inputs(self, batch: Batch) -> dict[str, Array]:
        return {k: batch[k] for k in self.FEATURES if k in batch and k in self._INPUT_NAMES}

    _INPUT_NAMES: ClassVar[tuple[str, ...]] = ()

    def loss_terms(
        self, params: PyTree, batch: Batch, dropout_rng: Array | None
    ) -> tuple[Array, dict[str, Array]]:
        """Loss numerator and summable metrics (loss = numerator / loss_denominator)."""
        logits = self._logits(params, batch, dropout_rng)
        return losses.cross_entropy_terms(
            logits,
            batch["decoder_target_tokens"],
            batch.get("decoder_loss_weights"),
            z_loss=self.z_loss,
            label_smoothing=self.label_smoothing,
            normalization=self.loss_normalization,
            segment_ids=batch.get("decoder_segment_ids"),
        )

    def loss_fn(
        self, params: PyTree, batch: Batch, dropout_rng: Array | None
    ) -> tuple[Array, dict[str, Array]]:
        """Training loss (normalised as configured) and summable metrics."""
        numerator, metrics = self.loss_terms(params, batch, dropout_rng)
        return numerator / jnp.maximum(metrics["loss_denominator"], 1.0), metrics

    def eval_fn(self, params: PyTree, batch: Batch) -> dict[str, Array]:
        """Summable eval metrics (no dropout)."""
        _, metrics = self.loss_fn(params, batch, None)
        return metrics

    def score_batch(self, params: PyTree, batch: Batch) -> Array:
        """Log-likelihood of each example's weighted targets, [B] (per row; unpacked batches)."""
        logits = self._logits(params, batch, None).astype(jnp.float32)
        targets = batch["decoder_target_tokens"]
        weights = batch.get("decoder_loss_weights")
        weights = (targets > 0) if weights is None else weights
        token_loss, _ = losses.cross_entropy_with_logits(logits, targets, 0.0)
        return -jnp.sum(token_loss * weights, axis=-1)


@dataclasses.dataclass(frozen=True)
class EncoderDecoderModel(BaseModel):
    """T5-style model; features from seqio_lite's encoder-decoder feature converter."""

    network_config: network.T5Config = network.T5Config()  # noqa: RUF009
    FEATURES: ClassVar[tuple[str, ...]] = (
        "encoder_input_tokens",
        "decoder_input_tokens",
        "decoder_target_tokens",
        "decoder_loss_weights",
        "encoder_segment_ids",
        "decoder_segment_ids",
        "encoder_positions",
        "decoder_positions",
    )
    _INPUT_NAMES: ClassVar[tuple[str, ...]] = (
        "encoder_input_tokens",
        "decoder_input_tokens",
        "decoder_target_tokens",
        "encoder_segment_ids",
        "decoder_segment_ids",
        "encoder_positions",
        "decoder_positions",
    )

    def module(self) -> network.EncoderDecoder:
        return network.EncoderDecoder(self.network_config)

    def dummy_batch(self, batch_size: int, lengths: Mapping[str, int]) -> dict[str, np.ndarray]:
        enc, dec = lengths["inputs"], lengths["targets"]
        return {
            k: np.zeros((batch_size, enc if k.startswith("encoder") else dec), np.int32)
            for k in self.FEATURES
        }

    def _logits(self, params: PyTree, batch: Batch, dropout_rng: Array | None) -> Array:
        rngs = {"dropout": dropout_rng} if dropout_rng is not None else {}
        return self.module().apply(
            {"params": params},
            **self._inputs(batch),
            enable_dropout=dropout_rng is not None,
            rngs=rngs,
        )

    def predict_batch(self, params: PyTree, batch: Batch, max_decode_length: int) -> Array:
        """Greedy decoding, [B, max_decode_length] ids (0 after EOS).

        Recomputes the decoder over the whole prefix at every step; the KV-cached decoder of
        `decoding.py` replaces this where available.
        """
        module = self.module()
        enc_tokens = batch["encoder_input_tokens"]
        encoded = module.apply(
            {"params": params}, enc_tokens, enable_dropout=False, method=module.encode
        )
        b = enc_tokens.shape[0]

        def step(i: int, state: tuple[Array, Array]) -> tuple[Array, Array]:
            out, done = state
            dec_in = jnp.concatenate([jnp.zeros((b, 1), out.dtype), out[:, :-1]], axis=1)
            logits = module.apply(
                {"params": params},
                encoded,
                enc_tokens,
                dec_in,
                enable_dropout=False,
                method=module.decode,
            )
            nxt = jnp.argmax(logits[:, i], axis=-1).astype(out.dtype)
            nxt = jnp.where(done, 0, nxt)
            out = out.at[:, i].set(nxt)
            return out, done | (nxt == 1)

        out = jnp.zeros((b, max_decode_length), jnp.int32)
        out, _ = jax.lax.fori_loop(0, max_decode_length, step, (out, jnp.zeros((b,), bool)))
        return out


@dataclasses.dataclass(frozen=True)
class DecoderOnlyModel(BaseModel):
    """Decoder-only LM (or prefix-LM); features from the LM / prefix-LM feature converters."""

    network_config: network.DecoderOnlyConfig = network.DecoderOnlyConfig()  # noqa: RUF009
    FEATURES: ClassVar[tuple[str, ...]] = (
        "decoder_input_tokens",
        "decoder_target_tokens",
        "decoder_loss_weights",
        "decoder_segment_ids",
        "decoder_positions",
        "decoder_causal_attention",
    )
    _INPUT_NAMES: ClassVar[tuple[str, ...]] = (
        "decoder_input_tokens",
        "decoder_target_tokens",
        "decoder_segment_ids",
        "decoder_positions",
        "decoder_causal_attention",
    )

    def module(self) -> network.DecoderOnly:
        return network.DecoderOnly(self.network_config)

    def dummy_batch(self, batch_size: int, lengths: Mapping[str, int]) -> dict[str, np.ndarray]:
        length = lengths["targets"] + lengths.get("inputs", 0)
        return {k: np.zeros((batch_size, length), np.int32) for k in self.FEATURES}

    def _logits(self, params: PyTree, batch: Batch, dropout_rng: Array | None) -> Array:
        rngs = {"dropout": dropout_rng} if dropout_rng is not None else {}
        return self.module().apply(
            {"params": params},
            **self._inputs(batch),
            enable_dropout=dropout_rng is not None,
            rngs=rngs,
        )
