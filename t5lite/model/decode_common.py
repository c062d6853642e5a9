"""What the decoding loops share: the state a model's callback sees, prompts and their checks,
the start of a decode, logit filtering and the order of decodes (see `decoding.py`'s docstring
for the coordinates and semantics).

Shape letters: B=batch, L=length, V=vocab, N=decodes per example.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

Array = jax.Array
PyTree = Any

# NOTE: a large finite negative (not -inf) keeps sums and divisions of scores finite.
NEG_INF = -1.0e7
# t5x's ids (T5's SentencePiece vocabulary); models pass their own.
EOS_ID, PAD_ID, DECODER_START_ID = 1, 0, 0
ORDERS = ("best_first", "best_last")


@flax.struct.dataclass
class DecodingState:
    """What `tokens_to_logits` sees at each step.

    Attributes:
      cur_index: [B] int32, the position of `cur_token` in each row.
      cur_token: [B, 1] int32, the token to feed.
      sequences: [B, L] int32, the decoded sequence so far (target coordinates).
      cache: the model's cache (batch on axis 0 of every leaf).
    """

    cur_index: Array
    cur_token: Array
    sequences: Array
    cache: PyTree


TokensToLogits = Callable[[DecodingState], tuple[Array, PyTree]]


def brevity_penalty(alpha: float, length: Array) -> Array:
    """t5x / GNMT length penalty `((5 + length) / 6) ** alpha` (1 when alpha = 0)."""
    return jnp.power((5.0 + length.astype(jnp.float32)) / 6.0, alpha)


def expand_batch(tree: PyTree, n: int) -> PyTree:
    """Repeats every leaf n times along axis 0: row b becomes rows b*n .. b*n + n - 1."""
    if n == 1:
        return tree
    return jax.tree.map(lambda x: jnp.repeat(x, n, axis=0), tree)


def _per_row(x: float | Array, b: int, name: str) -> Array:
    """A scalar or per-row [B] option as fp32 [B]."""
    x = jnp.asarray(x, jnp.float32)
    if x.ndim == 0:
        return jnp.full((b,), x)
    if x.shape != (b,):
        raise ValueError(f"{name} must be a scalar or one value per row [{b}], got {x.shape}")
    return x


def _check_order(order: str) -> None:
    if order not in ORDERS:
        raise ValueError(f"order must be one of {ORDERS}, got {order!r}")


@flax.struct.dataclass
class _Start:
    """Where each row starts and ends, from the prompt."""

    index_B: Array  # first position fed
    token_B1: Array  # first token fed
    sequences_BL: Array  # target coordinates: the prompt before index_B, pad after
    forced_BL: Array  # target coordinates: the prompt token to force at j (pad: none)
    last_B: Array  # last position decoded


def _start(
    prompt_BL: Array,
    initial_index: Array | None,
    max_decode_steps: int | Array | None,
    pad_id: int,
    decoder_start_token_id: int,
    steps_after_prompt: bool = False,
) -> _Start:
    b, length = prompt_BL.shape
    if initial_index is None:
        index_B = jnp.zeros((b,), jnp.int32)
    else:
        index_B = jnp.asarray(initial_index).astype(jnp.int32).reshape(b)
    prompt_BL = jnp.asarray(prompt_BL).astype(jnp.int32)
    # Where `max_decode_steps` counts from: the first position decoded, or (t5x) the position
    # after the prompt's non-pad tokens (position 0 is the start slot, never the prompt).
    steps_from_B = index_B
    if steps_after_prompt:
        steps_from_B = jnp.sum(prompt_BL[:, 1:] != pad_id, axis=1).astype(jnp.int32)
    _check_prompt(
        prompt_BL, index_B, steps_from_B, max_decode_steps, pad_id, decoder_start_token_id
    )
    prompt_BL = prompt_BL.at[:, 0].set(decoder_start_token_id)
    forced_BL = jnp.pad(prompt_BL[:, 1:], ((0, 0), (0, 1)), constant_values=pad_id)
    sequences_BL = jnp.where(jnp.arange(length)[None] < index_B[:, None], forced_BL, pad_id)
    token_B1 = jnp.take_along_axis(prompt_BL, jnp.clip(index_B, 0, length - 1)[:, None], axis=1)
    last_B = jnp.full_like(index_B, length - 1)
    if max_decode_steps is not None:
        last_B = jnp.minimum(last_B, steps_from_B + max_decode_steps - 1)
    return _Start(index_B, token_B1, sequences_BL.astype(jnp.int32), forced_BL, last_B)


def _check_prompt(
    prompt_BL: Array,
    index_B: Array,
    steps_from_B: Array,
    max_decode_steps: int | Array | None,
    pad_id: int,
    start_id: int,
) -> None:
    """Raises ValueError for a prompt that cannot be honoured (only for concrete inputs)."""
    values = (prompt_BL, index_B, steps_from_B, max_decode_steps)
    if any(isinstance(x, jax.core.Tracer) for x in values):
        return  # under jit: values unknown
    prompt, index = np.asarray(prompt_BL), np.asarray(index_B)
    length = prompt.shape[1]
    bad = np.flatnonzero((index < 0) | (index >= length))
    if bad.size:
        r = bad[0]
        raise ValueError(
            f"initial_index[{r}] = {index[r]} leaves no position to decode: it must be in "
            f"[0, {length - 1}] for decode length {length}"
        )
    bad = np.flatnonzero((prompt[:, 0] != pad_id) & (prompt[:, 0] != start_id))
    if bad.size:
        r = bad[0]
        raise ValueError(
            f"prompt_BL[{r}, 0] = {prompt[r, 0]}, but position 0 is the decoder start slot "
            f"(prompt_BL is in decoder-input coordinates): put the prompt at positions 1.."
        )
    # Decoder-input position of each row's last prompt token (0: none).
    has_BL = prompt != pad_id
    has_BL[:, 0] = False
    last_prompt = np.where(has_BL.any(1), length - 1 - np.argmax(has_BL[:, ::-1], axis=1), 0)
    # The row predicts decoder-input positions index + 1 .. end; when the prompt reaches into
    # them (prompt tokens at <= index are in the cache already), one must be left free.
    end = np.full_like(index, length)
    if max_decode_steps is not None:
        end = np.minimum(end, np.asarray(steps_from_B) + int(np.asarray(max_decode_steps)))
    bad = np.flatnonzero((last_prompt > index) & (last_prompt >= end))
    if bad.size:
        r = bad[0]
        raise ValueError(
            f"the prompt of row {r} leaves no room to decode: it runs to prompt_BL[{r}, "
            f"{last_prompt[r]}], but the row decodes positions {index[r] + 1}..{end[r]} only "
            f"(decode length {length}, max_decode_steps {max_decode_steps}); shorten the "
            f"prompt or decode longer"
        )


def _forced(forced_BL: Array, index_B: Array, pad_id: int) -> tuple[Array, Array]:
    """The prompt token at each row's current position [B] and whether it is forced [B]."""
    length = forced_BL.shape[1]
    idx_B1 = jnp.clip(index_B, 0, length - 1)[:, None]
    token_B = jnp.take_along_axis(forced_BL, idx_B1, axis=1)[:, 0]
    return token_B, (token_B != pad_id) & (index_B < length)


def _logits_BV(logits: Array) -> Array:
    logits = logits.astype(jnp.float32)
    return logits.reshape(logits.shape[0], logits.shape[-1])


def _ordered(sequences_BNL: Array, scores_BN: Array, order: str) -> tuple[Array, Array]:
    """Best-first decodes as `order` asks (best_last: reversed, t5x's ascending order)."""
    if order == "best_last":
        return sequences_BNL[:, ::-1], scores_BN[:, ::-1]
    return sequences_BNL, scores_BN


def filter_logits(logits_BV: Array, top_k: int = 0, top_p: float | Array = 1.0) -> Array:
    """Keeps the top-k logits and the smallest top-p nucleus; the rest get NEG_INF.

    Args:
      logits_BV: fp32 logits (already divided by the temperature).
      top_k: keep the k largest (0: no limit); static. Ties at the k-th value are all kept.
      top_p: keep the most probable tokens whose cumulative probability first reaches top_p
        (1.0: no limit); the most probable token is always kept. A scalar or one per row [B];
        may be traced.

    Returns:
      Filtered logits, same shape.
    """
    if top_k > 0:
        kth_B1 = jax.lax.top_k(logits_BV, top_k)[0][:, -1:]
        logits_BV = jnp.where(logits_BV < kth_B1, NEG_INF, logits_BV)
    if isinstance(top_p, int | float) and top_p >= 1.0:
        return logits_BV  # statically no nucleus: skip the sort
    top_p_B1 = jnp.asarray(top_p, jnp.float32).reshape(-1, 1)
    sorted_BV = jnp.sort(logits_BV, axis=-1)[:, ::-1]
    probs_BV = jax.nn.softmax(sorted_BV, axis=-1)
    # A token is kept when the mass of the more probable ones is still below top_p (all of
    # them at top_p >= 1, where rounding could otherwise drop the tail).
    keep_BV = ((jnp.cumsum(probs_BV, axis=-1) - probs_BV) < top_p_B1) | (top_p_B1 >= 1.0)
    n_keep_B1 = jnp.maximum(jnp.sum(keep_BV, axis=-1, keepdims=True), 1)
    threshold_B1 = jnp.take_along_axis(sorted_BV, n_keep_B1 - 1, axis=-1)
    return jnp.where(logits_BV < threshold_B1, NEG_INF, logits_BV)


@flax.struct.dataclass
class SamplingLoopState:
    """The temperature-sampling loop's state: what a `state_callback_fn` sees and returns.

    t5x's field names, t5lite's coordinates: one row per decode (B * num_decodes rows).

    Attributes:
      step: int32 scalar, steps taken.
      cur_index: [B] int32, the position of `cur_token` in each row.
      cur_token: [B, 1] int32, the token fed at the next step.
      sequences: [B, L] int32 in target coordinates (see the module docstring): the next step
        writes position `cur_index`. A callback that writes a token there (or further on) forces
        it, as a prompt token; unlike a prompt token, a forced EOS ends the row (as in t5x).
      cache: the model's cache.
      ended: [B] bool, rows that stopped.
      log_prob: [B] fp32, the log-probability of each row's generated tokens.
    """

    step: Array
    cur_index: Array
    cur_token: Array
    sequences: Array
    cache: PyTree
    ended: Array
    log_prob: Array


StateCallbackFn = Callable[[SamplingLoopState], SamplingLoopState]
LogitCallbackFn = Callable[[Array, SamplingLoopState], Array]
