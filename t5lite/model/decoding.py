"""Autoregressive decoding: greedy, temperature sampling (top-k, top-p) and beam search.

Model-agnostic, as t5x's decoding.py: the model supplies a `tokens_to_logits(state)` callback
that feeds `state.cur_token` [B, 1] through its KV cache (`state.cache`) and returns the logits
for the next token [B, V] (or [B, 1, V]) and the updated cache. Everything here runs inside one
`jax.lax.while_loop`, so it jits and partitions like any other step.

Coordinates. `prompt_BL[b, i]` is the token fed to the decoder at position i (position 0 is
BOS = PAD = 0); row b starts decoding at `initial_index[b]`: its cache already holds positions
< initial_index (a prefill, for decoder-only prompts) and the first token fed is
`prompt_BL[b, initial_index[b]]`. Returned sequences are in *target* coordinates:
`sequences[..., j]` is the token predicted at position j, so positions j < initial_index hold
the prompt (`prompt_BL[b, j + 1]`), generated tokens follow and everything after EOS is 0.
Decoding of a row stops at EOS, at the last position (L - 1) or after `max_decode_steps` tokens.

The cache is any pytree whose leaves have the batch on axis 0 (t5lite's KV cache does, scanned
or not); for several decodes per example (samples, beams) it is repeated per decode here, so
the model prefills each example once.

Shape letters: B=batch, L=length, V=vocab, N=decodes per example, W=beams.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import flax.struct
import jax
import jax.numpy as jnp

from seqio_lite.vocabularies import EOS_ID, PAD_ID

Array = jax.Array
PyTree = Any

# NOTE: a large finite negative (not -inf) keeps sums and divisions of scores finite.
NEG_INF = -1.0e7


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


def _start(
    prompt_BL: Array, initial_index_B: Array, max_decode_steps: int | None
) -> tuple[Array, Array, Array]:
    """Initial target-coordinate sequences, first tokens [B, 1] and each row's last position."""
    length = prompt_BL.shape[1]
    j = jnp.arange(length)[None]
    shifted_BL = jnp.pad(prompt_BL[:, 1:], ((0, 0), (0, 1)))
    sequences_BL = jnp.where(j < initial_index_B[:, None], shifted_BL, PAD_ID)
    first_B1 = jnp.take_along_axis(
        prompt_BL, jnp.clip(initial_index_B, 0, length - 1)[:, None], axis=1
    )
    last_B = jnp.full_like(initial_index_B, length - 1)
    if max_decode_steps is not None:
        last_B = jnp.minimum(last_B, initial_index_B + max_decode_steps - 1)
    return sequences_BL.astype(jnp.int32), first_B1.astype(jnp.int32), last_B


def _logits_BV(logits: Array) -> Array:
    logits = logits.astype(jnp.float32)
    return logits.reshape(logits.shape[0], logits.shape[-1])


def filter_logits(logits_BV: Array, top_k: int = 0, top_p: float = 1.0) -> Array:
    """Keeps the top-k logits and the smallest top-p nucleus; the rest get NEG_INF.

    Args:
      logits_BV: fp32 logits (already divided by the temperature).
      top_k: keep the k largest (0: no limit). Ties at the k-th value are all kept.
      top_p: keep the most probable tokens whose cumulative probability first reaches top_p
        (1.0: no limit); the most probable token is always kept.

    Returns:
      Filtered logits, same shape.
    """
    if top_k > 0:
        kth_B1 = jax.lax.top_k(logits_BV, top_k)[0][:, -1:]
        logits_BV = jnp.where(logits_BV < kth_B1, NEG_INF, logits_BV)
    if top_p < 1.0:
        sorted_BV = jnp.sort(logits_BV, axis=-1)[:, ::-1]
        probs_BV = jax.nn.softmax(sorted_BV, axis=-1)
        # A token is kept when the mass of the more probable ones is still below top_p.
        keep_BV = (jnp.cumsum(probs_BV, axis=-1) - probs_BV) < top_p
        n_keep_B1 = jnp.maximum(jnp.sum(keep_BV, axis=-1, keepdims=True), 1)
        threshold_B1 = jnp.take_along_axis(sorted_BV, n_keep_B1 - 1, axis=-1)
        logits_BV = jnp.where(logits_BV < threshold_B1, NEG_INF, logits_BV)
    return logits_BV


def temperature_sample(
    prompt_BL: Array,
    cache: PyTree,
    tokens_to_logits: TokensToLogits,
    *,
    decode_rng: Array | None = None,
    initial_index: Array | None = None,
    num_decodes: int = 1,
    temperature: float = 1.0,
    top_k: int = 0,
    top_p: float = 1.0,
    eos_id: int = EOS_ID,
    max_decode_steps: int | None = None,
) -> tuple[Array, Array]:
    """Samples `num_decodes` continuations per row (greedy when temperature == 0 or top_k == 1).

    Args:
      prompt_BL: int decoder inputs [B, L] (see the module docstring); zeros for no prompt.
      cache: the model's cache for B rows, positions < initial_index filled.
      tokens_to_logits: the model's step function.
      decode_rng: PRNG key for sampling (default PRNGKey(0); unused when greedy).
      initial_index: [B] first position to decode per row (default 0).
      num_decodes: N samples per row (the cache is repeated N times).
      temperature: logits are divided by it before sampling; 0 means greedy (argmax).
      top_k, top_p: see `filter_logits`.
      eos_id: decoding of a row stops after this token.
      max_decode_steps: at most this many new tokens per row (default: up to position L - 1).

    Returns:
      (sequences [B, N, L] int32, log_probs [B, N] fp32): decodes sorted by the model's
      log-probability of the generated tokens (raw logits, before temperature and filtering),
      most likely first.
    """
    b, length = prompt_BL.shape
    if initial_index is None:
        initial_index = jnp.zeros((b,), jnp.int32)
    greedy = temperature == 0.0 or top_k == 1
    rng = jax.random.PRNGKey(0) if decode_rng is None else decode_rng
    prompt_BL, index_B, cache = expand_batch(
        (prompt_BL, initial_index.astype(jnp.int32), cache), num_decodes
    )
    sequences_BL, token_B1, last_B = _start(prompt_BL, index_B, max_decode_steps)
    positions_1L = jnp.arange(length)[None]

    def cond(carry):
        return ~jnp.all(carry[5])

    def body(carry):
        step, index_B, token_B1, sequences_BL, cache, done_B, logp_B = carry
        logits, cache = tokens_to_logits(DecodingState(index_B, token_B1, sequences_BL, cache))
        logits_BV = _logits_BV(logits)
        if greedy:
            next_B = jnp.argmax(logits_BV, axis=-1)
        else:
            scaled_BV = filter_logits(logits_BV / temperature, top_k, top_p)
            next_B = jax.random.categorical(jax.random.fold_in(rng, step), scaled_BV, axis=-1)
        next_B = jnp.where(done_B, PAD_ID, next_B).astype(jnp.int32)
        token_logp_B = jnp.take_along_axis(
            jax.nn.log_softmax(logits_BV, axis=-1), next_B[:, None], axis=-1
        )[:, 0]
        logp_B = logp_B + jnp.where(done_B, 0.0, token_logp_B)
        write_BL = (positions_1L == index_B[:, None]) & ~done_B[:, None]
        sequences_BL = jnp.where(write_BL, next_B[:, None], sequences_BL)
        done_B = done_B | (next_B == eos_id) | (index_B >= last_B)
        return step + 1, index_B + 1, next_B[:, None], sequences_BL, cache, done_B, logp_B

    carry = (
        jnp.zeros((), jnp.int32), index_B, token_B1, sequences_BL, cache,
        index_B > last_B, jnp.zeros(index_B.shape, jnp.float32),
    )  # fmt: skip
    carry = jax.lax.while_loop(cond, body, carry)
    sequences_BNL = carry[3].reshape(b, num_decodes, length)
    logp_BN = carry[6].reshape(b, num_decodes)
    order_BN = jnp.argsort(-logp_BN, axis=1)
    sequences_BNL = jnp.take_along_axis(sequences_BNL, order_BN[:, :, None], axis=1)
    return sequences_BNL, jnp.take_along_axis(logp_BN, order_BN, axis=1)


def greedy(
    prompt_BL: Array,
    cache: PyTree,
    tokens_to_logits: TokensToLogits,
    **kwargs: Any,
) -> tuple[Array, Array]:
    """Argmax decoding: `temperature_sample` with temperature 0 (same arguments and returns)."""
    return temperature_sample(prompt_BL, cache, tokens_to_logits, temperature=0.0, **kwargs)


def _take_beams(x_BW: Array, beam_BK: Array) -> Array:
    """[B, W, ...] -> [B, K, ...]: beam `beam_BK[b, k]` of row b."""
    idx = beam_BK.reshape(*beam_BK.shape, *([1] * (x_BW.ndim - 2)))
    return jnp.take_along_axis(x_BW, idx, axis=1)


def _reorder_cache(cache: PyTree, beam_BW: Array) -> PyTree:
    """Cache leaves [B * W, ...] -> the same rows reordered by beam origin [B, W]."""
    b, w = beam_BW.shape

    def one(x: Array) -> Array:
        return _take_beams(x.reshape(b, w, *x.shape[1:]), beam_BW).reshape(x.shape)

    return jax.tree.map(one, cache)


def beam_search(
    prompt_BL: Array,
    cache: PyTree,
    tokens_to_logits: TokensToLogits,
    *,
    beam_size: int = 4,
    alpha: float = 0.6,
    initial_index: Array | None = None,
    eos_id: int = EOS_ID,
    max_decode_steps: int | None = None,
) -> tuple[Array, Array]:
    """Beam search with the t5x brevity penalty `((5 + len) / 6) ** alpha`.

    Each step extends the W live beams by every token, keeps the 2W best candidates, moves
    those ending in EOS (all of them at a row's last position) to the finished pool scored by
    `log_prob / brevity_penalty(alpha, generated_length)`, and keeps the W best others live.
    A row stops when its last position is reached or no live beam can still beat the worst
    finished one.

    Args:
      prompt_BL, cache, tokens_to_logits, initial_index, eos_id, max_decode_steps: as for
        `temperature_sample`.
      beam_size: W, beams per row (the cache is repeated W times).
      alpha: brevity penalty exponent (0: plain log-probability).

    Returns:
      (sequences [B, W, L] int32, scores [B, W] fp32), best first.
    """
    b, length = prompt_BL.shape
    w = beam_size
    if initial_index is None:
        initial_index = jnp.zeros((b,), jnp.int32)
    first_BL, token_B1, last_B = _start(
        prompt_BL, initial_index.astype(jnp.int32), max_decode_steps
    )
    index_B = initial_index.astype(jnp.int32)
    max_len_B = (last_B - index_B + 1).astype(jnp.float32)
    positions_11L = jnp.arange(length)[None, None]

    def cond(carry):
        return ~jnp.all(carry[-1])

    def body(carry):
        index_B, token_BW1, live_BWL, live_logp_BW, fin_BWL, fin_score_BW, cache, done_B = carry
        state = DecodingState(
            jnp.repeat(index_B, w), token_BW1, live_BWL.reshape(b * w, length), cache
        )
        logits, cache = tokens_to_logits(state)
        logp_BWV = jax.nn.log_softmax(_logits_BV(logits), axis=-1).reshape(b, w, -1)
        vocab = logp_BWV.shape[-1]
        cand_logp_BC, flat_BC = jax.lax.top_k(
            (live_logp_BW[:, :, None] + logp_BWV).reshape(b, w * vocab), 2 * w
        )
        cand_beam_BC, cand_token_BC = flat_BC // vocab, flat_BC % vocab
        cand_BCL = _take_beams(live_BWL, cand_beam_BC)
        write_1CL = positions_11L == index_B[:, None, None]
        cand_BCL = jnp.where(write_1CL, cand_token_BC[:, :, None], cand_BCL)
        at_end_B1 = (index_B >= last_B)[:, None]
        finishes_BC = (cand_token_BC == eos_id) | at_end_B1
        penalty_B1 = brevity_penalty(alpha, index_B - initial_index + 1)[:, None]
        new_fin_BC = jnp.where(finishes_BC, cand_logp_BC / penalty_B1, NEG_INF)
        # Finished pool: the W best of the old pool and this step's finished candidates.
        pool_score = jnp.concatenate([fin_score_BW, new_fin_BC], axis=1)
        pool_seqs = jnp.concatenate([fin_BWL, cand_BCL], axis=1)
        top_fin_BW, top_idx_BW = jax.lax.top_k(pool_score, w)
        top_fin_BWL = jnp.take_along_axis(pool_seqs, top_idx_BW[:, :, None], axis=1)
        # Live beams: the W best candidates that did not end in EOS.
        live_cand = jnp.where(cand_token_BC == eos_id, NEG_INF, cand_logp_BC)
        new_live_logp_BW, live_idx_BW = jax.lax.top_k(live_cand, w)
        new_live_BWL = jnp.take_along_axis(cand_BCL, live_idx_BW[:, :, None], axis=1)
        origin_BW = jnp.take_along_axis(cand_beam_BC, live_idx_BW, axis=1)
        cache = _reorder_cache(cache, origin_BW)
        new_token_BW1 = jnp.take_along_axis(cand_token_BC, live_idx_BW, axis=1).reshape(-1, 1)
        # A finished row keeps its pool; rows still running take the new one.
        keep_B1 = done_B[:, None]
        fin_score_BW = jnp.where(keep_B1, fin_score_BW, top_fin_BW)
        fin_BWL = jnp.where(keep_B1[:, :, None], fin_BWL, top_fin_BWL)
        # No live beam can beat the worst finished one: its log-probability only falls, and the
        # penalty divides by at most the penalty of the longest possible decode.
        best_possible_B = new_live_logp_BW[:, 0] / brevity_penalty(alpha, max_len_B)
        done_B = done_B | at_end_B1[:, 0] | (fin_score_BW[:, -1] >= best_possible_B)
        return (
            index_B + 1, new_token_BW1.astype(jnp.int32), new_live_BWL, new_live_logp_BW,
            fin_BWL, fin_score_BW, cache, done_B,
        )  # fmt: skip

    live_logp_BW = jnp.concatenate(
        [jnp.zeros((b, 1), jnp.float32), jnp.full((b, w - 1), NEG_INF, jnp.float32)], axis=1
    )  # only beam 0 is live at first, so the W copies do not yield W equal candidates
    live_BWL = jnp.repeat(first_BL[:, None], w, axis=1)
    carry = (
        index_B, jnp.repeat(token_B1, w, axis=0), live_BWL, live_logp_BW, live_BWL,
        jnp.full((b, w), NEG_INF, jnp.float32), expand_batch(cache, w), index_B > last_B,
    )  # fmt: skip
    carry = jax.lax.while_loop(cond, body, carry)
    fin_BWL, fin_score_BW = carry[4], carry[5]
    return fin_BWL.astype(jnp.int32), fin_score_BW
